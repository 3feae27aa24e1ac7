// Module plumbing (state dicts, gradients) and Linear, the layer every other module is built on.
//
// Vocabulary: B batch, T queries, S keys/values, H heads, D head dim, E = H*D model width.
#include "attn/nn/module.hpp"

#include "attn/ops/activation.hpp"
#include "attn/ops/linear.hpp"
#include "kernels/cpu/parallel_for.hpp"
#include "nn/internal.hpp"
#include "ops/linear_parameter.hpp"

#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <typeinfo>

namespace attn::nn {

// ----------------------------------------------------------------------------------------------
// Internal helpers

namespace detail {

uint64_t name_stream(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a offset basis
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;  // FNV prime
  }
  return h;
}

uint64_t child_seed(uint64_t seed, std::string_view name) {
  // splitmix64's finaliser spreads the mix over all 64 bits, so nearby seeds give unrelated keys.
  uint64_t z = seed ^ (name_stream(name) + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string module_name(const Module& m) {
  const char* mangled = typeid(m).name();
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(
      abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  std::string name = (status == 0 && demangled) ? demangled.get() : mangled;
  size_t colon = name.rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

namespace {
// dst[i] += src[i] for i in [i0, i1): one task's range of a contiguous accumulate.
template <typename T>
void add_range(T* dst, const T* src, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i)
    dst[i] += src[i];
}

// Mixed precision's weight gradients (bf16 products into float32 masters): the widening is exact,
// so this is the generic loop's value without its per-element index arithmetic.
template <typename T>
void add_range(T* dst, const uint16_t* src, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i)
    dst[i] += static_cast<T>(bf16_to_float(src[i]));
}

// The elementwise loops below (accumulate, convert) run in tasks of 8K elements (16-32 KiB each
// side) on the threads when there are two or more: a weight gradient or a weight matrix of a few
// hundred KiB, which the backward's activations have pushed out of the caches, is worth a fork
// from 16K elements (a 128 x 128 projection). On one thread, the weight gradients' accumulation
// took ~1% of a training step at 2 threads and the bf16 weight conversions ~0.5% of a bf16 step
// while the other thread waited. Elementwise, so the same bits for any split.
constexpr int64_t kElementsPerTask = int64_t{1} << 13;

// f(i0, i1) for the tasks' ranges of [0, n), on up to `threads` threads (one task: the caller).
template <class F>
void for_tasks(int64_t n, int threads, F&& f) {
  const int64_t tasks = (n + kElementsPerTask - 1) / kElementsPerTask;
  cpu::parallel_for(tasks, static_cast<int>(std::min<int64_t>(threads, tasks)), [&](int64_t t) {
    f(t * kElementsPerTask, std::min(n, (t + 1) * kElementsPerTask));
  });
}

template <typename T>
void accumulate_typed(T* dst, const Tensor& g, int threads) {
  const int64_t n = g.numel();
  if (g.dtype() == dtype_of<T>() && g.is_contiguous()) {
    const T* src = g.data<T>();
    for_tasks(n, threads, [&](int64_t i0, int64_t i1) { add_range(dst, src, i0, i1); });
  } else if (g.dtype() == DType::BF16 && g.is_contiguous()) {
    const auto* src = static_cast<const uint16_t*>(g.raw_data());
    for_tasks(n, threads, [&](int64_t i0, int64_t i1) { add_range(dst, src, i0, i1); });
  } else {
    for (int64_t i = 0; i < n; ++i)
      dst[i] += static_cast<T>(g.flat(i));
  }
}
}  // namespace

Tensor convert(const Context& ctx, const Tensor& x, DType dtype) {
  const int64_t n = x.numel();
  const bool floats = (x.dtype() == DType::F32 && dtype == DType::BF16) ||
                      (x.dtype() == DType::BF16 && dtype == DType::F32);
  const int threads = ctx.resolved_threads();
  if (!floats || threads < 2 || n < 2 * kElementsPerTask || !x.is_contiguous()) return x.to(dtype);
  Tensor out = Tensor::empty(x.shape(), dtype);
  auto* src = static_cast<const std::byte*>(x.raw_data());
  auto* dst = static_cast<std::byte*>(out.raw_data());
  const int64_t in_size = x.dtype() == DType::F32 ? 4 : 2, out_size = 6 - in_size;
  for_tasks(n, threads, [&](int64_t i0, int64_t i1) {
    // Views of the task's range: contiguous on both sides, so copy_from takes the bulk
    // conversion.
    Tensor to = Tensor::wrap(dst + i0 * out_size, {i1 - i0}, dtype);
    to.copy_from(Tensor::wrap(const_cast<std::byte*>(src) + i0 * in_size, {i1 - i0}, x.dtype()));
  });
  return out;
}

bool autocasts(const Context& ctx, DType module_dtype) {
  return ctx.autocast_bf16 && module_dtype == DType::F32 && ctx.backend != Backend::kReference;
}

void accumulate(Tensor& grad, const Tensor& g, int threads) {
  check(grad.defined() && g.defined() && grad.numel() == g.numel(), "accumulate",
        "gradient of shape {} cannot accumulate into {}", shape_arg(g.shape()),
        shape_arg(grad.shape()));
  // Parameter gradients are always allocated contiguous (zeros with the value).
  if (grad.dtype() == DType::F32 && grad.is_contiguous()) {
    accumulate_typed(grad.data<float>(), g, threads);
  } else if (grad.dtype() == DType::F64 && grad.is_contiguous()) {
    accumulate_typed(grad.data<double>(), g, threads);
  } else if (grad.dtype() == DType::BF16 && g.dtype() == DType::BF16 && grad.is_contiguous() &&
             g.is_contiguous()) {
    // As PyTorch's bf16 grad += g: the sum in float, rounded to bf16 (0 + g is exactly g).
    auto* dst = static_cast<uint16_t*>(grad.raw_data());
    const auto* src = static_cast<const uint16_t*>(g.raw_data());
    for (int64_t i = 0; i < g.numel(); ++i)
      dst[i] = float_to_bf16(bf16_to_float(dst[i]) + bf16_to_float(src[i]));
  } else {
    for (int64_t i = 0; i < g.numel(); ++i)
      grad.set_flat(i, grad.flat(i) + g.flat(i));
  }
}

void check_input(const char* op, const char* what, const Tensor& x, int ndim, DType dtype) {
  check(x.defined(), op, "{} is undefined", what);
  check(ndim <= 0 || x.ndim() == ndim, op, "{} has shape {}, expected {} dimensions", what,
        shape_arg(x.shape()), ndim);
  check(ndim > 0 || x.ndim() >= 1, op, "{} is a scalar, expected at least 1 dimension", what);
  check(x.dtype() == dtype, op, "{} has dtype {}, expected {} (the module's dtype)", what,
        dtype_name(x.dtype()), dtype_name(dtype));
}

namespace {

// Copies between the (B, L, H, D) view of an activation and the head-major (B*H, L, D) layout
// d2l's transpose_qkv produces. kSplit: dst is head-major; otherwise src is.
// T is only moved, never computed with: uint16_t carries bfloat16 bits.
template <typename T, bool kSplit>
void permute_heads(const Tensor& src, Tensor& dst, int64_t B, int64_t L, int64_t H, int64_t D) {
  const T* s = static_cast<const T*>(src.raw_data());
  T* d = static_cast<T*>(dst.raw_data());
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const int64_t d0 = dst.stride(0), d1 = dst.stride(1), d2 = dst.stride(2);
  if (s2 == 1 && d2 == 1) {
    // Unit feature strides (every activation and gradient MultiHeadAttention passes): one row
    // of D contiguous elements per (b, h, l), a memcpy instead of D strided moves.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t l = 0; l < L; ++l) {
          if constexpr (kSplit) {
            std::memcpy(d + (b * H + h) * d0 + l * d1, s + b * s0 + l * s1 + h * D, D * sizeof(T));
          } else {
            std::memcpy(d + b * d0 + l * d1 + h * D, s + (b * H + h) * s0 + l * s1, D * sizeof(T));
          }
        }
    return;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t j = 0; j < D; ++j) {
          if constexpr (kSplit) {
            // head-major row (b*H + h, l) <- features [h*D, (h+1)*D) of X[b, l]
            d[(b * H + h) * d0 + l * d1 + j * d2] = s[b * s0 + l * s1 + (h * D + j) * s2];
          } else {
            d[b * d0 + l * d1 + (h * D + j) * d2] = s[(b * H + h) * s0 + l * s1 + j * s2];
          }
        }
}

}  // namespace

Tensor split_heads(const Tensor& X, int64_t num_heads) {
  const int64_t B = X.dim(0), L = X.dim(1), E = X.dim(2), D = E / num_heads;
  Tensor out = Tensor::empty({B * num_heads, L, D}, X.dtype());
  if (X.dtype() == DType::F32)
    permute_heads<float, true>(X, out, B, L, num_heads, D);
  else if (X.dtype() == DType::BF16)
    permute_heads<uint16_t, true>(X, out, B, L, num_heads, D);
  else
    permute_heads<double, true>(X, out, B, L, num_heads, D);
  return out;
}

Tensor merge_heads(const Tensor& Y, int64_t num_heads) {
  Tensor out = Tensor::empty({Y.dim(0) / num_heads, Y.dim(1), num_heads * Y.dim(2)}, Y.dtype());
  merge_heads_into(Y, num_heads, out);
  return out;
}

void merge_heads_into(const Tensor& Y, int64_t num_heads, Tensor& out) {
  const int64_t B = Y.dim(0) / num_heads, L = Y.dim(1), D = Y.dim(2);
  check(out.shape() == Shape({B, L, num_heads * D}) && out.dtype() == Y.dtype(), "merge_heads",
        "destination {} {} does not fit heads {} {} (H = {})", shape_arg(out.shape()),
        dtype_name(out.dtype()), shape_arg(Y.shape()), dtype_name(Y.dtype()), num_heads);
  if (Y.dtype() == DType::F32)
    permute_heads<float, false>(Y, out, B, L, num_heads, D);
  else if (Y.dtype() == DType::BF16)
    permute_heads<uint16_t, false>(Y, out, B, L, num_heads, D);
  else
    permute_heads<double, false>(Y, out, B, L, num_heads, D);
}

Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  Shape shape = t.shape();
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor out = Tensor::empty(shape, t.dtype());
  const Tensor src = t.contiguous();
  const size_t row_bytes = src.nbytes() / static_cast<size_t>(std::max<int64_t>(1, src.dim(0)));
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(
        static_cast<std::byte*>(out.raw_data()) + i * row_bytes,
        static_cast<const std::byte*>(src.raw_data()) + static_cast<size_t>(rows[i]) * row_bytes,
        row_bytes);
  return out;
}

}  // namespace detail

// ----------------------------------------------------------------------------------------------
// Module

namespace {

std::string expected_shape_str(const Parameter& p) {
  if (p.value.defined()) return shape_str(p.value.shape());
  if (p.lazy_shape.empty()) return "any shape";
  std::string s = "(";
  for (size_t i = 0; i < p.lazy_shape.size(); ++i) {
    if (i) s += ", ";
    s += p.lazy_shape[i] < 0 ? std::string("any") : std::to_string(p.lazy_shape[i]);
  }
  return s + ")";
}

bool shape_fits(const Parameter& p, const Shape& shape) {
  if (p.value.defined()) return shape == p.value.shape();
  if (p.lazy_shape.empty()) return true;
  if (shape.size() != p.lazy_shape.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i) {
    // A lazy dimension takes any positive size (a zero-width input is meaningless).
    if (p.lazy_shape[i] < 0 ? shape[i] <= 0 : shape[i] != p.lazy_shape[i]) return false;
  }
  return true;
}

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names)
    s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

StateDict Module::state_dict() {
  StateDict dict;
  // A lazy parameter that has not seen an input has no value yet and is left out (PyTorch would
  // store an UninitializedParameter, which no file format can hold).
  for (auto& [name, p] : named_parameters())
    if (p->value.defined()) dict.emplace(name, p->value.clone());
  return dict;
}

void Module::load_state_dict(const StateDict& dict, bool strict) {
  const std::string op = detail::module_name(*this) + "::load_state_dict";
  auto params = named_parameters();

  // Pass 1 validates every entry and converts it to the parameter's dtype; nothing is written
  // until everything has passed, so a bad dict leaves the module exactly as it was.
  std::vector<std::pair<Parameter*, Tensor>> staged;
  std::set<std::string> known;
  std::vector<std::string> missing;
  for (auto& [key, p] : params) {
    known.insert(key);
    auto it = dict.find(key);
    if (it == dict.end()) {
      missing.push_back(key);
      continue;
    }
    const Tensor& t = it->second;
    check(t.defined(), op.c_str(), "'{}' is an undefined tensor", key);
    check(is_floating(t.dtype()), op.c_str(), "'{}' has dtype {}, expected a float tensor", key,
          dtype_name(t.dtype()));
    check(shape_fits(*p, t.shape()), op.c_str(), "'{}' has shape {}, expected {}", key,
          shape_arg(t.shape()), expected_shape_str(*p));
    const DType target = p->value.defined() ? p->value.dtype() : dtype_;
    staged.emplace_back(p, t.to(target));
  }
  if (strict) {
    check(missing.empty(), op.c_str(), "missing {} (strict load; the dict has {} entries)",
          join(missing), dict.size());
    std::vector<std::string> unexpected;
    for (const auto& [key, t] : dict)
      if (!known.count(key)) unexpected.push_back(key);
    check(unexpected.empty(), op.c_str(), "unexpected {} (strict load; expected names: {})",
          join(unexpected), join(std::vector<std::string>(known.begin(), known.end())));
  }

  // Pass 2 commits. Existing values are overwritten in place, so views of them stay valid.
  for (auto& [p, t] : staged) {
    if (p->value.defined()) {
      p->value.copy_from(t);
    } else {
      p->value = t.clone();
    }
    if (!p->grad.defined() || p->grad.shape() != p->value.shape() ||
        p->grad.dtype() != p->value.dtype())
      p->grad = Tensor::zeros(p->value.shape(), p->value.dtype());
  }
}

void Module::zero_grad() {
  for (auto& [name, p] : named_parameters())
    if (p->grad.defined()) p->grad.fill(0.0);
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (auto& [name, p] : named_parameters())
    if (p->value.defined()) n += p->value.numel();
  return n;
}

void append_parameters(std::vector<std::pair<std::string, Parameter*>>& out,
                       const std::string& prefix, Module& child) {
  for (auto& [name, p] : child.named_parameters())
    out.emplace_back(prefix + "." + name, p);
}

// ----------------------------------------------------------------------------------------------
// Linear: y = x W^T + b

namespace {

// PyTorch's Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) on W reduces to
// U(-1/sqrt(in), 1/sqrt(in)), and the bias uses the same bound. Each tensor has its own stream.
Parameter make_uniform(const Shape& shape, double bound, DType dtype, uint64_t seed,
                       std::string_view name) {
  Parameter p;
  // bf16: the float32 draw rounded once, as PyTorch's module.to(torch.bfloat16) after init.
  p.value = Tensor::empty(shape, dtype == DType::BF16 ? DType::F32 : dtype);
  Rng rng(seed, detail::name_stream(name));
  detail::fill_with(p.value, [&] { return rng.uniform(-bound, bound); });
  if (dtype == DType::BF16) p.value = p.value.to(DType::BF16);
  p.grad = Tensor::zeros(shape, dtype);
  return p;
}

// A float32 parameter whose gradient is a contiguous float32 tensor of the value's shape, as
// make_uniform allocates it: linear_backward_accumulate can add into it.
bool sums_in_place(const Parameter& p) {
  return p.value.dtype() == DType::F32 && p.grad.defined() && p.grad.dtype() == DType::F32 &&
         p.grad.is_contiguous() && p.grad.shape() == p.value.shape();
}

// Whether a float32 Linear's weight (and bias) gradients can take linear_backward_accumulate's
// sums in place (a caller may have replaced them).
bool grads_accumulate_in_place(const Linear& l) {
  return sums_in_place(l.weight) && (!l.has_bias() || sums_in_place(l.bias));
}

}  // namespace

Linear::Linear(int64_t out_features, int64_t in_features, bool with_bias, DType dtype,
               uint64_t seed)
    : Module(dtype),
      out_features_(out_features),
      in_features_(in_features),
      has_bias_(with_bias),
      seed_(seed) {
  check(out_features > 0, "Linear", "out_features must be positive, got {}", out_features);
  check(in_features >= 0, "Linear", "in_features must be >= 0 (0 = lazy), got {}", in_features);
  check(dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16, "Linear",
        "dtype {} unsupported, expected F32, F64 or BF16", dtype_name(dtype));
  weight.lazy_shape = {out_features, -1};
  if (with_bias) bias.lazy_shape = {out_features};
  if (in_features > 0) materialize(in_features, "Linear");
}

std::vector<std::pair<std::string, Parameter*>> Linear::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out{{"weight", &weight}};
  if (has_bias_) out.emplace_back("bias", &bias);
  return out;
}

void Linear::materialize(int64_t in_features, const char* op) {
  check(in_features > 0, op, "Linear needs at least one input feature, got {}", in_features);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  if (weight.value.defined()) {
    check(weight.value.dim(1) == in_features, op,
          "input has {} features, but the Linear layer's weight is {} (out, in)", in_features,
          shape_arg(weight.value.shape()));
  } else {
    Parameter w = make_uniform({out_features_, in_features}, bound, dtype_, seed_, "weight");
    weight.value = w.value;
    weight.grad = w.grad;
  }
  // A non-strict load may have given the weight but not the bias (or the other way round).
  if (has_bias_ && !bias.value.defined()) {
    Parameter b = make_uniform({out_features_}, bound, dtype_, seed_, "bias");
    bias.value = b.value;
    bias.grad = b.grad;
  }
  in_features_ = in_features;
}

Tensor Linear::forward(Context& ctx, const Tensor& x) {
  return forward(ctx, x, detail::autocasts(ctx, dtype_) && x.defined() ? x.dtype() : dtype_);
}

Tensor Linear::forward(Context& ctx, const Tensor& x, DType y_dtype) {
  return forward_impl(ctx, x, y_dtype, false);
}

Tensor Linear::forward_relu(Context& ctx, const Tensor& x, DType y_dtype) {
  return forward_impl(ctx, x, y_dtype, true);
}

Tensor Linear::forward_impl(Context& ctx, const Tensor& x, DType y_dtype, bool relu_after) {
  autocast_ = detail::autocasts(ctx, dtype_);
  check(y_dtype == dtype_ || (autocast_ && y_dtype == DType::BF16), "Linear",
        "output dtype {} unsupported, expected the module's {} (or BF16 under autocast)",
        dtype_name(y_dtype), dtype_name(dtype_));
  if (autocast_ && x.defined() && x.dtype() == DType::BF16) {
    detail::check_input("Linear", "input", x, 0, DType::BF16);
  } else {
    detail::check_input("Linear", "input", x, 0, dtype_);
  }
  check(!weight.value.defined() || x.dim(-1) == weight.value.dim(1), "Linear",
        "input has shape {}, expected last dimension {} (weight {})", shape_arg(x.shape()),
        weight.value.defined() ? weight.value.dim(1) : 0, shape_arg(weight.value.shape()));
  materialize(x.dim(-1), "Linear");
  if (autocast_) {
    x_dtype_ = x.dtype();
    x_ = detail::convert(ctx, x, DType::BF16);
    // Rounded every forward: the optimiser updates the float32 weights in place.
    w_bf16_ = detail::convert(ctx, weight.value, DType::BF16);
    b_bf16_ = has_bias_ ? bias.value.to(DType::BF16) : Tensor();
    // ReLU commutes with the widening to a float32 y: the bits of relu(convert(y)).
    Tensor y =
        relu_after ? linear_relu(ctx, x_, w_bf16_, b_bf16_) : linear(ctx, x_, w_bf16_, b_bf16_);
    return detail::convert(ctx, y, y_dtype);
  }
  w_bf16_ = b_bf16_ = Tensor();
  x_ = x;
  const Tensor b = has_bias_ ? bias.value : Tensor();
  return attn::detail::linear_of_parameter(ctx, x, weight.value, b, relu_after);
}

Tensor Linear::backward(Context& ctx, const Tensor& dy) {
  return backward_impl(ctx, dy, Tensor());
}

Tensor Linear::backward_relu(Context& ctx, const Tensor& dy, const Tensor& relu_out) {
  check(relu_out.defined(), "Linear::backward_relu", "relu_out is undefined");
  return backward_impl(ctx, dy, relu_out);
}

Tensor Linear::backward_impl(Context& ctx, const Tensor& dy, const Tensor& relu_out) {
  check(x_.defined(), "Linear::backward", "called before forward");
  Shape expected = x_.shape();
  expected.back() = out_features_;
  if (autocast_) {
    check(dy.shape() == expected && (dy.dtype() == DType::F32 || dy.dtype() == DType::BF16),
          "Linear::backward",
          "dy has shape {} and dtype {}, expected {} and F32 or BF16 (autocast)",
          shape_arg(dy.shape()), dtype_name(dy.dtype()), shape_arg(expected));
    // forward: y = bf16(x) bf16(W)^T + bf16(b) in bf16; the products of the backward likewise.
    // A bf16 relu_out (the FFN's hidden layer) masks the bf16 dx in its product's region; a
    // float32 one masks the widened dx after (rounding it to bf16 could turn a tiny positive
    // value into 0).
    const bool fused = relu_out.defined() && relu_out.dtype() == DType::BF16;
    LinearGrads g = linear_backward(ctx, detail::convert(ctx, dy, DType::BF16), x_, w_bf16_,
                                    has_bias_, fused ? relu_out : Tensor());
    detail::accumulate(weight.grad, g.dW, ctx.resolved_threads());
    if (has_bias_) detail::accumulate(bias.grad, g.db, ctx.resolved_threads());
    Tensor dx = x_dtype_ == DType::BF16 ? g.dx : detail::convert(ctx, g.dx, x_dtype_);
    return relu_out.defined() && !fused ? relu_backward(ctx, dx, relu_out) : dx;
  }
  check(dy.shape() == expected && dy.dtype() == dtype_, "Linear::backward",
        "dy has shape {} and dtype {}, expected {} and {}", shape_arg(dy.shape()),
        dtype_name(dy.dtype()), shape_arg(expected), dtype_name(dtype_));
  // forward: y = x W^T + b, so dx = dy W, dW += dy^T x, db += sum over rows of dy. The sums go
  // straight into the gradients when they have the layer's dtype and layout (always, unless a
  // caller replaced them).
  if (grads_accumulate_in_place(*this))
    return linear_backward_accumulate(ctx, dy, x_, weight.value, weight.grad,
                                      has_bias_ ? &bias.grad : nullptr, relu_out);
  LinearGrads g = linear_backward(ctx, dy, x_, weight.value, has_bias_, relu_out);
  detail::accumulate(weight.grad, g.dW, ctx.resolved_threads());
  if (has_bias_) detail::accumulate(bias.grad, g.db, ctx.resolved_threads());
  return g.dx;
}

}  // namespace attn::nn
