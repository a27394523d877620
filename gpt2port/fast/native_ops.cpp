// The kernels of gpt2port's operators on the CPU, in C++: gpt2port::matvec (one row times a weight, matvec.c),
// gpt2port::attend_one (attention for one new token, attention.c), gpt2port::matvec_int4, dequantize_int4 and
// round_int4 (4-bit weights, int4.c), gpt2port::layer_norm and gelu_tanh (layers.c), each checking its arguments,
// then calling the library gpt2port/fast/native.py built from those C files.
//
// Why C++: a decode step makes ~50 one-row products (~200 at 1.5B), and a kernel written in Python costs each a round
// trip from PyTorch's dispatcher into the interpreter and out through ctypes, which an operator registered from C++
// does not pay (docs/performance.md). gpt2port/fast/native.py builds this file against the running
// PyTorch's headers and links it to the library; where that cannot be done (no C++ compiler, no headers), a Python
// kernel serves gpt2port::matvec, and attention stays on PyTorch's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

extern "C" {
void gpt2port_matvec(const float *W, const float *x, const float *b, float *y, int64_t n, int64_t k, int threads);
void gpt2port_matvec_bf16(const uint16_t *W, const float *x, const uint16_t *b, uint16_t *y, int64_t n, int64_t k,
                          int threads);
void gpt2port_attend_one(const float *qkv, float *K, float *V, float *y, int64_t H, int64_t T, int64_t D,
                         int64_t length, float scale, float *scratch, int threads);
void gpt2port_attend_one_bf16(const uint16_t *qkv, uint16_t *K, uint16_t *V, uint16_t *y, int64_t H, int64_t T,
                              int64_t D, int64_t length, float scale, float *scratch, int threads);
int gpt2port_matvec_int4(const uint8_t *P, const float *x, const float *b, float *y, int64_t n, int64_t k, int bits,
                         int threads);
void gpt2port_dequantize_int4(const uint8_t *P, float *W, int64_t n, int64_t k, int bits, int threads);
void gpt2port_round_int4(const float *x, float *out, int64_t rows, int64_t k, int threads);
int64_t gpt2port_int4_row_bytes(int64_t k, int bits);
void gpt2port_layer_norm(const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t n,
                         float eps);
void gpt2port_gelu_tanh(const float *x, float *y, int64_t n);
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
  TORCH_CHECK_VALUE(takes(weight, bias) && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                        x.numel() == weight.size(1) && x.scalar_type() == weight.scalar_type(),
                    "gpt2port::matvec takes one row of k numbers (1, ..., k) and a contiguous (n, k) weight of one "
                    "dtype, fp32 or bf16; got x ", shape(x), " ", x.scalar_type(), ", weight ", shape(weight), " ",
                    weight.scalar_type());
  int64_t n = weight.size(0), k = weight.size(1);
  std::vector<int64_t> shape_of_y = x.sizes().vec();  // x's shape, its last size n: (1, ..., n)
  shape_of_y.back() = n;
  at::Tensor y = at::empty(shape_of_y, weight.options());
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

// qkv (1, ..., 3 H D): q, k, v; keys, values: the layer's cache (1, H, T, D), written at `length` -> y (1, ..., H D).
at::Tensor attend_one(const at::Tensor &qkv, at::Tensor &keys, at::Tensor &values, int64_t length,
                      std::optional<double> scale) {
  auto dtype = keys.scalar_type();
  bool caches = keys.dim() == 4 && keys.size(0) == 1 && values.sizes() == keys.sizes() && keys.is_contiguous() &&
                values.is_contiguous() && values.scalar_type() == dtype && keys.device().is_cpu() &&
                values.device().is_cpu();
  TORCH_CHECK_VALUE(caches && (dtype == at::kFloat || dtype == at::kBFloat16) && qkv.scalar_type() == dtype &&
                        qkv.device().is_cpu() && qkv.dim() >= 1 && qkv.size(-1) == qkv.numel() &&
                        qkv.numel() == 3 * keys.size(1) * keys.size(3) && length >= 0 &&
                        length < keys.size(2),
                    "gpt2port::attend_one takes 3 H D numbers and contiguous caches (1, H, T, D) of their dtype, fp32 "
                    "or bf16, and a position below T; got qkv ", shape(qkv), " ", qkv.scalar_type(), ", keys ",
                    shape(keys), " ", keys.scalar_type(), ", values ", shape(values), ", position ", length);
  int64_t H = keys.size(1), T = keys.size(2), D = keys.size(3);
  // as scaled_dot_product_attention's default: 1 / sqrt(head size)
  float factor = scale ? static_cast<float>(*scale) : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  at::Tensor row = qkv.contiguous();
  at::Tensor scratch = at::empty({H * (length + 1 + 2 * D)}, keys.options().dtype(at::kFloat));
  std::vector<int64_t> shape_of_y = qkv.sizes().vec();  // qkv's shape, its last size H D: (1, ..., H D)
  shape_of_y.back() = H * D;
  at::Tensor y = at::empty(shape_of_y, keys.options());
  int threads = at::get_num_threads();
  if (dtype == at::kFloat) {
    gpt2port_attend_one(row.const_data_ptr<float>(), keys.mutable_data_ptr<float>(), values.mutable_data_ptr<float>(),
                        y.mutable_data_ptr<float>(), H, T, D, length, factor, scratch.mutable_data_ptr<float>(),
                        threads);
  } else {
    gpt2port_attend_one_bf16(static_cast<const uint16_t *>(row.const_data_ptr()),
                             static_cast<uint16_t *>(keys.mutable_data_ptr()),
                             static_cast<uint16_t *>(values.mutable_data_ptr()),
                             static_cast<uint16_t *>(y.mutable_data_ptr()), H, T, D, length, factor,
                             scratch.mutable_data_ptr<float>(), threads);
  }
  return y;
}

// The same, the position held in a one-element int64 tensor: a traced forward reads it anew at each replay.
at::Tensor attend_one_at(const at::Tensor &qkv, at::Tensor &keys, at::Tensor &values, const at::Tensor &length,
                         std::optional<double> scale) {
  TORCH_CHECK_VALUE(length.numel() == 1 && length.scalar_type() == at::kLong && length.device().is_cpu(),
                    "gpt2port::attend_one.at takes the position as one int64 number on the CPU; got ", shape(length),
                    " ", length.scalar_type());
  return attend_one(qkv, keys, values, *length.const_data_ptr<int64_t>(), scale);
}

// The bits of int4.c's packed rows of k numbers (k a multiple of 32), uint8 (n, k * bits / 8 + k / 16 + 4), bits 4,
// 6 or 8; 0 where `packed` is none of them.
int packed_bits(const at::Tensor &packed, int64_t k) {
  if (packed.scalar_type() != at::kByte || !packed.device().is_cpu() || packed.dim() != 2 || !packed.is_contiguous() ||
      k <= 0 || k % 32 != 0)
    return 0;
  for (int bits : {4, 6, 8})
    if (packed.size(1) == gpt2port_int4_row_bytes(k, bits)) return bits;
  return 0;
}

// x one row (1, ..., k) fp32, packed int4 rows, bias (n,) fp32 -> (1, ..., n) fp32
at::Tensor matvec_int4(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                       int64_t k) {
  int bits = packed_bits(packed, k);
  TORCH_CHECK_VALUE(bits && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
                        x.size(-1) == k && x.numel() == k &&
                        (!bias || (bias->scalar_type() == at::kFloat && bias->device().is_cpu() &&
                                   bias->is_contiguous() && bias->numel() == packed.size(0))),
                    "gpt2port::matvec_int4 takes one fp32 row of k numbers (1, ..., k), k a multiple of 32, and "
                    "contiguous packed rows (n, k * bits / 8 + k / 16 + 4) uint8, bits 4, 6 or 8; got x ", shape(x), " ",
                    x.scalar_type(),
                    ", packed ", shape(packed), " ", packed.scalar_type(), ", k ", k);
  int64_t n = packed.size(0);
  std::vector<int64_t> shape_of_y = x.sizes().vec();
  shape_of_y.back() = n;
  at::Tensor y = at::empty(shape_of_y, x.options());
  at::Tensor row = x.contiguous();
  int status = gpt2port_matvec_int4(packed.const_data_ptr<uint8_t>(), row.const_data_ptr<float>(),
                                    bias ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), n,
                                    k, bits, at::get_num_threads());
  TORCH_CHECK(status == 0, "gpt2port::matvec_int4: out of memory for its scratch");
  return y;
}

// packed rows (n, k * bits / 8 + k / 16 + 4) -> the fp32 rows (n, k) they stand for
at::Tensor dequantize_int4(const at::Tensor &packed, int64_t k) {
  int bits = packed_bits(packed, k);
  TORCH_CHECK_VALUE(bits, "gpt2port::dequantize_int4 takes contiguous packed rows (n, k * bits / 8 + k / 16 + 4) "
                    "uint8, bits 4, 6 or 8, k a multiple of 32; got ", shape(packed), " ", packed.scalar_type(), ", k ",
                    k);
  at::Tensor w = at::empty({packed.size(0), k}, packed.options().dtype(at::kFloat));
  gpt2port_dequantize_int4(packed.const_data_ptr<uint8_t>(), w.mutable_data_ptr<float>(), packed.size(0), k, bits,
                           at::get_num_threads());
  return w;
}

// activations (..., k) fp32, k a multiple of 32 -> the same rounded to 8 bits per group of 32, as the int4 products
// take them (int4.c)
at::Tensor round_int4(const at::Tensor &x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) % 32 == 0,
                    "gpt2port::round_int4 takes fp32 rows (..., k), k a multiple of 32; got ", shape(x), " ",
                    x.scalar_type());
  at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  int64_t k = x.size(-1);
  gpt2port_round_int4(rows.const_data_ptr<float>(), y.mutable_data_ptr<float>(), k ? x.numel() / k : 0, k,
                      at::get_num_threads());
  return y;
}

// An optional LayerNorm weight or bias that fits rows of n fp32 numbers: none, or n contiguous fp32 on the CPU.
bool affine(const std::optional<at::Tensor> &t, int64_t n) {
  return !t || (t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous() && t->numel() == n);
}

// rows (..., n) fp32, weight and bias (n,) fp32 or None -> LayerNorm over the last dimension
at::Tensor layer_norm(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                      const std::optional<at::Tensor> &bias, double eps) {
  int64_t n = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && n > 0 && affine(weight, n) &&
                        affine(bias, n),
                    "gpt2port::layer_norm takes fp32 rows (..., n) and an fp32 weight and bias of n numbers or None; "
                    "got x ", shape(x), " ", x.scalar_type());
  at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  gpt2port_layer_norm(rows.const_data_ptr<float>(), weight ? weight->const_data_ptr<float>() : nullptr,
                      bias ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), x.numel() / n, n,
                      static_cast<float>(eps));
  return y;
}

// fp32 numbers of any shape -> GPT-2's tanh GELU of each
at::Tensor gelu_tanh(const at::Tensor &x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat,
                    "gpt2port::gelu_tanh takes fp32 numbers on the CPU; got ", shape(x), " ", x.scalar_type());
  at::Tensor numbers = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  gpt2port_gelu_tanh(numbers.const_data_ptr<float>(), y.mutable_data_ptr<float>(), x.numel());
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gpt2port, CPU, m) {
  m.impl("matvec", matvec);
  m.impl("attend_one", attend_one);
  m.impl("attend_one.at", attend_one_at);
  m.impl("matvec_int4", matvec_int4);
  m.impl("dequantize_int4", dequantize_int4);
  m.impl("round_int4", round_int4);
  m.impl("layer_norm", layer_norm);
  m.impl("gelu_tanh", gelu_tanh);
}
