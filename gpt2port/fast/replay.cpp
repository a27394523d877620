// gpt2port::replay_make, replay_run and replay_free: a decode step's operator calls, recorded once as the model's
// forward made them (gpt2port/fast/replay.py) and called again from here, one Python call a step instead of ~250.
//
// Why: at 124M a decode step is ~250 operator calls around ~50 products, and calling each from Python (the modules,
// the interpreter, the argument parsing) took about as long as the products themselves (docs/performance.md). The
// calls here are the very operators the forward called, with the arguments it gave them, through PyTorch's
// dispatcher: nothing of the model is computed here.
//
// A program is text, one call a line (replay.py writes it): the operator's name and overload, then its arguments,
// then "->" and where its results go. Values live in numbered slots: the inputs first, then the constants (the
// other tensors the forward read but did not make: the weights), then every result. Argument tokens:
//   t<slot>  a tensor            T<slot|n>,...  a list of tensors (n: None, in a Tensor?[])
//   n  None   i<int>   f<float>   b0 b1   l<int>,...  a list of ints   s<text>
//   d<dtype>  D<device>   y<layout>   m<memory format>     k<name>=<token>: a keyword argument
// and result tokens: o<slot> a tensor, _ a result that is not one (a list of tensors counts one per tensor).
// Calls whose results nothing reads and that write nothing are dropped when the program is made (the reads of a
// number that the forward made for Python, such as a check of its token ids).
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Arg {
  enum Kind { kValue, kSlot, kSlots } kind = kValue;
  c10::IValue value;
  int64_t slot = -1;
  std::vector<int64_t> slots;  // kSlots: -1 for None
  bool optional_elements = false;
};

struct Call {
  c10::OperatorHandle op;
  std::vector<Arg> args;
  std::vector<int64_t> outs;  // per tensor of the results, flattened: its slot, or -1
};

struct Program {
  std::vector<Call> calls;
  std::vector<at::Tensor> slots;  // constants set once; inputs and results each run, results cleared after it
  int64_t inputs = 0, constants = 0, result = -1;
  std::mutex running;
};

std::mutex registry_lock;
std::map<int64_t, std::unique_ptr<Program>> registry;
int64_t next_id = 1;

std::vector<std::string> split(const std::string &s, char by) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, by)) parts.push_back(part);
  return parts;
}

int64_t number(const std::string &s, const std::string &where) {
  char *end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  TORCH_CHECK_VALUE(!s.empty() && *end == '\0', "gpt2port::replay_make: '", s, "' is not an integer (", where, ")");
  return v;
}

c10::ScalarType dtype(const std::string &name) {
  static const std::map<std::string, c10::ScalarType> names = {
      {"float32", c10::kFloat}, {"float64", c10::kDouble}, {"float16", c10::kHalf}, {"bfloat16", c10::kBFloat16},
      {"int64", c10::kLong},    {"int32", c10::kInt},      {"int16", c10::kShort}, {"int8", c10::kChar},
      {"uint8", c10::kByte},    {"bool", c10::kBool}};
  auto it = names.find(name);
  TORCH_CHECK_VALUE(it != names.end(), "gpt2port::replay_make: no dtype '", name, "'");
  return it->second;
}

// The type an argument takes, Optional[...] unwrapped.
c10::TypePtr unwrapped(const c10::Argument &a) {
  c10::TypePtr t = a.real_type();
  if (auto o = t->cast<c10::OptionalType>()) return o->getElementType();
  return t;
}

// A number given where a tensor is taken (x * 0.5): Python's wrapped number, as PyTorch makes it from the number
c10::IValue wrapped(const c10::IValue &number) {
  at::Tensor t = at::scalar_to_tensor(number.toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

Arg parse_value(const std::string &tok, const c10::Argument &a, int64_t slots);

Arg parse(const std::string &tok, const c10::Argument &a, int64_t slots) {
  Arg arg = parse_value(tok, a, slots);
  bool number = arg.kind == Arg::kValue && (arg.value.isInt() || arg.value.isDouble() || arg.value.isBool());
  if (number && unwrapped(a)->kind() == c10::TypeKind::TensorType) arg.value = wrapped(arg.value);
  return arg;
}

Arg parse_value(const std::string &tok, const c10::Argument &a, int64_t slots) {
  TORCH_CHECK_VALUE(!tok.empty(), "gpt2port::replay_make: an empty token for ", a.name());
  Arg arg;
  const std::string rest = tok.substr(1);
  switch (tok[0]) {
    case 't':
      arg.kind = Arg::kSlot;
      arg.slot = number(rest, a.name());
      TORCH_CHECK_VALUE(arg.slot >= 0 && arg.slot < slots, "gpt2port::replay_make: slot ", arg.slot, " out of range");
      return arg;
    case 'T': {
      arg.kind = Arg::kSlots;
      auto list = unwrapped(a)->cast<c10::ListType>();
      TORCH_CHECK_VALUE(list, "gpt2port::replay_make: a list of tensors given for ", a.name(), ", a ",
                        a.type()->str());
      arg.optional_elements = list->getElementType()->kind() == c10::TypeKind::OptionalType;
      for (const auto &s : rest.empty() ? std::vector<std::string>{} : split(rest, ',')) {
        int64_t slot = s == "n" ? -1 : number(s, a.name());
        TORCH_CHECK_VALUE(slot < slots && (slot >= 0 || arg.optional_elements), "gpt2port::replay_make: slot ", s,
                          " of ", a.name());
        arg.slots.push_back(slot);
      }
      return arg;
    }
    case 'n':
      return arg;
    case 'i': {
      int64_t v = number(rest, a.name());
      auto kind = unwrapped(a)->kind();
      arg.value = kind == c10::TypeKind::FloatType ? c10::IValue(static_cast<double>(v)) : c10::IValue(v);
      return arg;
    }
    case 'f': {
      char *end = nullptr;
      arg.value = std::strtod(rest.c_str(), &end);
      TORCH_CHECK_VALUE(!rest.empty() && *end == '\0', "gpt2port::replay_make: '", rest, "' is not a number");
      return arg;
    }
    case 'b':
      arg.value = rest == "1";
      return arg;
    case 'l': {
      std::vector<int64_t> v;
      for (const auto &s : rest.empty() ? std::vector<std::string>{} : split(rest, ',')) v.push_back(number(s, a.name()));
      arg.value = c10::IValue(v);
      return arg;
    }
    case 's':
      arg.value = rest;
      return arg;
    case 'd':
      arg.value = dtype(rest);
      return arg;
    case 'D':
      arg.value = c10::Device(rest);
      return arg;
    case 'y':
      TORCH_CHECK_VALUE(rest == "strided", "gpt2port::replay_make: layout ", rest);
      arg.value = c10::kStrided;
      return arg;
    case 'm':
      TORCH_CHECK_VALUE(rest == "contiguous_format" || rest == "preserve_format",
                        "gpt2port::replay_make: memory format ", rest);
      arg.value = rest == "contiguous_format" ? c10::MemoryFormat::Contiguous : c10::MemoryFormat::Preserve;
      return arg;
  }
  TORCH_CHECK_VALUE(false, "gpt2port::replay_make: token '", tok, "' for ", a.name());
  return arg;
}

Call parse_call(const std::string &line, int64_t slots) {
  std::vector<std::string> tokens = split(line, ' ');
  TORCH_CHECK_VALUE(!tokens.empty(), "gpt2port::replay_make: an empty call");
  std::string name = tokens[0], overload;
  auto dot = name.find('.', name.find("::"));
  if (dot != std::string::npos) overload = name.substr(dot + 1), name = name.substr(0, dot);
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  TORCH_CHECK_VALUE(handle, "gpt2port::replay_make: no operator ", tokens[0]);
  Call call{*handle, {}, {}};
  const auto &schema = handle->schema();
  const auto &params = schema.arguments();
  std::vector<std::optional<Arg>> args(params.size());
  size_t i = 1, positional = 0;
  for (; i < tokens.size() && tokens[i] != "->"; i++) {
    const std::string &tok = tokens[i];
    auto eq = tok.find('=');
    if (tok[0] == 'k' && eq != std::string::npos) {
      std::string key = tok.substr(1, eq - 1);
      auto index = schema.argumentIndexWithName(key);
      TORCH_CHECK_VALUE(index, "gpt2port::replay_make: ", tokens[0], " has no argument ", key);
      args[*index] = parse(tok.substr(eq + 1), params[*index], slots);
    } else {
      TORCH_CHECK_VALUE(positional < params.size(), "gpt2port::replay_make: too many arguments to ", tokens[0]);
      args[positional] = parse(tok, params[positional], slots);
      positional++;
    }
  }
  for (size_t p = 0; p < params.size(); p++) {
    if (!args[p]) {
      TORCH_CHECK_VALUE(params[p].default_value(), "gpt2port::replay_make: ", tokens[0], " lacks ", params[p].name());
      args[p] = Arg{};
      args[p]->value = *params[p].default_value();
    }
    call.args.push_back(std::move(*args[p]));
  }
  for (i++; i < tokens.size(); i++) {
    call.outs.push_back(tokens[i] == "_" ? -1 : number(tokens[i].substr(1), "a result"));
    TORCH_CHECK_VALUE(call.outs.back() < slots, "gpt2port::replay_make: result slot ", tokens[i], " out of range");
  }
  return call;
}

// Drops the calls whose results nothing reads and that write nothing, last to first.
void prune(Program &p) {
  std::vector<bool> needed(p.slots.size(), false);
  needed[p.result] = true;
  std::vector<Call> kept;
  for (auto it = p.calls.rbegin(); it != p.calls.rend(); ++it) {
    bool keep = it->op.schema().is_mutable();
    for (int64_t o : it->outs) keep = keep || (o >= 0 && needed[o]);
    if (!keep) continue;
    for (const auto &a : it->args) {
      if (a.kind == Arg::kSlot) needed[a.slot] = true;
      for (int64_t s : a.slots)
        if (s >= 0) needed[s] = true;
    }
    kept.push_back(std::move(*it));
  }
  p.calls.assign(std::make_move_iterator(kept.rbegin()), std::make_move_iterator(kept.rend()));
}

Program &find(int64_t id) {
  std::lock_guard<std::mutex> hold(registry_lock);
  auto it = registry.find(id);
  TORCH_CHECK_VALUE(it != registry.end(), "gpt2port::replay_run: no program ", id);
  return *it->second;
}

// program: "<slots> <result> <inputs>" then one call a line; constants: the tensors of slots inputs.. in order.
int64_t replay_make(const std::string &text, const std::vector<at::Tensor> &constants) {
  std::vector<std::string> lines = split(text, '\n');
  TORCH_CHECK_VALUE(!lines.empty(), "gpt2port::replay_make: an empty program");
  std::vector<std::string> head = split(lines[0], ' ');
  TORCH_CHECK_VALUE(head.size() == 3, "gpt2port::replay_make: a program starts with '<slots> <result> <inputs>'");
  auto p = std::make_unique<Program>();
  int64_t slots = number(head[0], "slots");
  p->result = number(head[1], "result");
  p->inputs = number(head[2], "inputs");
  p->constants = static_cast<int64_t>(constants.size());
  TORCH_CHECK_VALUE(slots >= p->inputs + p->constants && p->result >= 0 && p->result < slots && p->inputs >= 0,
                    "gpt2port::replay_make: ", slots, " slots cannot hold ", p->inputs, " inputs, ", p->constants,
                    " constants and result ", p->result);
  p->slots.resize(slots);
  for (int64_t c = 0; c < p->constants; c++) p->slots[p->inputs + c] = constants[c];
  for (size_t l = 1; l < lines.size(); l++)
    if (!lines[l].empty()) p->calls.push_back(parse_call(lines[l], slots));
  prune(*p);
  std::lock_guard<std::mutex> hold(registry_lock);
  int64_t id = next_id++;
  registry[id] = std::move(p);
  return id;
}

at::Tensor replay_run(int64_t id, const std::vector<at::Tensor> &inputs) {
  Program &p = find(id);
  std::lock_guard<std::mutex> hold(p.running);
  TORCH_CHECK_VALUE(static_cast<int64_t>(inputs.size()) == p.inputs, "gpt2port::replay_run: program ", id, " takes ",
                    p.inputs, " inputs, got ", inputs.size());
  for (int64_t i = 0; i < p.inputs; i++) p.slots[i] = inputs[i];
  std::vector<c10::IValue> stack;  // the dispatcher's boxed arguments, then results
  for (const Call &call : p.calls) {
    stack.clear();
    for (const Arg &a : call.args) {
      if (a.kind == Arg::kValue) {
        stack.push_back(a.value);
      } else if (a.kind == Arg::kSlot) {
        stack.push_back(p.slots[a.slot]);
      } else if (a.optional_elements) {
        c10::List<std::optional<at::Tensor>> list;
        for (int64_t s : a.slots) list.push_back(s < 0 ? std::optional<at::Tensor>() : p.slots[s]);
        stack.push_back(std::move(list));
      } else {
        c10::List<at::Tensor> list;
        for (int64_t s : a.slots) list.push_back(p.slots[s]);
        stack.push_back(std::move(list));
      }
    }
    call.op.callBoxed(stack);
    size_t out = 0;
    for (c10::IValue &r : stack) {
      if (r.isTensorList()) {
        for (const at::Tensor &t : r.toTensorList().vec()) {
          TORCH_CHECK(out < call.outs.size(), "gpt2port::replay_run: ", call.op.schema().name(), " gave more results");
          if (call.outs[out] >= 0) p.slots[call.outs[out]] = t;
          out++;
        }
      } else {
        TORCH_CHECK(out < call.outs.size(), "gpt2port::replay_run: ", call.op.schema().name(), " gave more results");
        if (call.outs[out] >= 0) p.slots[call.outs[out]] = r.isTensor() ? r.toTensor() : at::Tensor();
        out++;
      }
    }
    for (; out < call.outs.size(); out++)  // results the recording had that this call did not give: none kept
      TORCH_CHECK(call.outs[out] < 0, "gpt2port::replay_run: ", call.op.schema().name(), " gave fewer results");
  }
  at::Tensor result = p.slots[p.result];
  for (size_t s = 0; s < p.slots.size(); s++)  // the step's own tensors freed now, not at the next step
    if (static_cast<int64_t>(s) < p.inputs || static_cast<int64_t>(s) >= p.inputs + p.constants) p.slots[s].reset();
  return result;
}

void replay_free(int64_t id) {
  std::unique_ptr<Program> gone;  // released outside the lock: its tensors may be the last references
  std::lock_guard<std::mutex> hold(registry_lock);
  auto it = registry.find(id);
  if (it != registry.end()) gone = std::move(it->second), registry.erase(it);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpt2port, CompositeExplicitAutograd, m) {
  m.impl("replay_make", replay_make);
  m.impl("replay_run", replay_run);
  m.impl("replay_free", replay_free);
}
