// The operator gpt2port::matvec's CPU kernel in C++: the same checks as gpt2port/native.py's Python one, then a direct
// call into matvec.c's library.
//
// Why a second way to reach the same kernel: a decode step makes ~50 one-row products (~200 at 1.5B), and a kernel
// written in Python costs each of them a round trip from PyTorch's dispatcher into the interpreter and out through
// ctypes, ~3 us more than an operator registered from C++ (124M: ~0.15 ms of an ~11 ms step). gpt2port/native.py
// builds this file against the running PyTorch's headers and links it to the library it built from matvec.c; where
// that cannot be done (no C++ compiler, no headers), the Python kernel does the same job.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <sstream>
#include <string>

extern "C" {
void gpt2port_matvec(const float *W, const float *x, const float *b, float *y, int64_t n, int64_t k, int threads);
void gpt2port_matvec_bf16(const uint16_t *W, const float *x, const uint16_t *b, uint16_t *y, int64_t n, int64_t k,
                          int threads);
}

namespace {

// A shape as Python writes a tuple, so that the message reads as the Python kernel's does.
std::string shape(const at::Tensor &t) {
  std::ostringstream out;
  out << "(";
  for (int64_t i = 0; i < t.dim(); i++) out << (i ? ", " : "") << t.size(i);
  out << (t.dim() == 1 ? ",)" : ")");
  return out.str();
}

bool takes(const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
  auto dtype = weight.scalar_type();
  return (dtype == at::kFloat || dtype == at::kBFloat16) && weight.device().is_cpu() && weight.dim() == 2 &&
         weight.is_contiguous() &&
         (!bias || (bias->scalar_type() == dtype && bias->device().is_cpu() && bias->is_contiguous() &&
                    bias->numel() == weight.size(0)));
}

at::Tensor matvec(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
  TORCH_CHECK_VALUE(takes(weight, bias) && x.device().is_cpu() && x.numel() == weight.size(1) &&
                        x.scalar_type() == weight.scalar_type(),
                    "gpt2port::matvec takes k numbers and a contiguous (n, k) weight of one dtype, fp32 or bf16; "
                    "got x ", shape(x), " ", x.scalar_type(), ", weight ", shape(weight), " ", weight.scalar_type());
  int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor y = at::empty({n}, weight.options());
  int threads = at::get_num_threads();
  if (weight.scalar_type() == at::kFloat) {
    at::Tensor row = x.contiguous();
    gpt2port_matvec(weight.const_data_ptr<float>(), row.const_data_ptr<float>(),
                    bias ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), n, k, threads);
  } else {
    at::Tensor wide = x.to(at::kFloat).contiguous();  // exact: bf16 is the upper half of an fp32
    gpt2port_matvec_bf16(static_cast<const uint16_t *>(weight.const_data_ptr()), wide.const_data_ptr<float>(),
                         bias ? static_cast<const uint16_t *>(bias->const_data_ptr()) : nullptr,
                         static_cast<uint16_t *>(y.mutable_data_ptr()), n, k, threads);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gpt2port, CPU, m) { m.impl("matvec", matvec); }
