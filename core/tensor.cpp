#include "attn/core/tensor.hpp"

#include "attn/core/memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>

namespace attn {

namespace detail {
void throw_error(const char* op, fmt::string_view format, fmt::format_args args) {
  throw Error(op, fmt::vformat(format, args));
}
}  // namespace detail

std::string shape_str(const Shape& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + ")";
}

int64_t shape_numel(const Shape& shape, const char* op) {
  int64_t n = 1;
  bool negative = false, overflow = false;
  for (int64_t d : shape) {
    negative |= d < 0;
    overflow |= __builtin_mul_overflow(n, d, &n);
  }
  if (!negative && !overflow) [[likely]]
    return n;
  // The checks in order: a dim after a 0 cannot overflow the (empty) product.
  n = 1;
  for (int64_t d : shape) {
    check(d >= 0, op, "negative dimension in shape {}", shape_arg(shape));
    check(d == 0 || n <= std::numeric_limits<int64_t>::max() / d, op,
          "shape {} has more elements than fit in int64", shape_arg(shape));
    n *= d;
  }
  return n;
}

Strides contiguous_strides(const Shape& shape) {
  Strides s(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    s[i] = acc;
    acc *= std::max<int64_t>(shape[i], 1);
  }
  return s;
}

namespace {

// Allocates the storage's control block from the same per-thread small blocks as small tensors
// (attn/core/memory.hpp): a decoder step makes a few hundred tensors, and one malloc each for
// their control blocks overflowed glibc's per-thread cache into its slower bins.
template <class T>
struct ControlBlockAllocator {
  using value_type = T;
  ControlBlockAllocator() = default;
  template <class U>
  ControlBlockAllocator(const ControlBlockAllocator<U>&) {}  // NOLINT: rebinding converts
  T* allocate(size_t n) {
    size_t size = 0;
    void* p = detail::acquire_block(n * sizeof(T), &size);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  // The size class follows from the size asked for (a control block is far below the cached
  // large blocks, whose sizes may differ from it).
  void deallocate(T* p, size_t n) { detail::release_block(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const ControlBlockAllocator<U>&) const {
    return true;
  }
};

// 64-byte aligned so SIMD kernels can use aligned loads on fresh tensors; large blocks are
// reused after their tensors are freed (attn/core/memory.hpp).
std::shared_ptr<std::byte> allocate(size_t nbytes, const Shape& shape) {
  size_t size = 0;
  void* p = detail::acquire_block(nbytes, &size);
  check(p != nullptr, "Tensor::empty", "cannot allocate {} bytes for shape {}", nbytes,
        shape_arg(shape));
  return std::shared_ptr<std::byte>(
      static_cast<std::byte*>(p), [size](std::byte* q) { detail::release_block(q, size); },
      ControlBlockAllocator<std::byte>());
}

double load(const void* p, DType t) {
  switch (t) {
    case DType::F32:
      return *static_cast<const float*>(p);
    case DType::F64:
      return *static_cast<const double*>(p);
    case DType::BF16:
      return bf16_to_float(*static_cast<const uint16_t*>(p));
    case DType::F16:
      return f16_to_float(*static_cast<const uint16_t*>(p));
    case DType::I32:
      return *static_cast<const int32_t*>(p);
    case DType::I64:
      return static_cast<double>(*static_cast<const int64_t*>(p));
  }
  return 0;
}

void store(void* p, DType t, double v) {
  switch (t) {
    case DType::F32:
      *static_cast<float*>(p) = static_cast<float>(v);
      break;
    case DType::F64:
      *static_cast<double*>(p) = v;
      break;
    case DType::BF16:
      *static_cast<uint16_t*>(p) = float_to_bf16(static_cast<float>(v));
      break;
    case DType::F16:
      *static_cast<uint16_t*>(p) = float_to_f16(static_cast<float>(v));
      break;
    case DType::I32:
      *static_cast<int32_t*>(p) = static_cast<int32_t>(v);
      break;
    case DType::I64:
      *static_cast<int64_t*>(p) = static_cast<int64_t>(v);
      break;
  }
}

}  // namespace

// Requests beyond x86-64's 47-bit user address space (128 TiB) can never be met; refusing them
// here gives an Error instead of handing the allocator a size that sanitizers abort on.
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 47;

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  const int64_t numel = shape_numel(shape, "Tensor::empty");
  check(static_cast<uint64_t>(numel) <= kMaxTensorBytes / dtype_size(dtype), "Tensor::empty",
        "shape {} of {} needs more memory than this machine can address", shape_arg(shape),
        dtype_name(dtype));
  return Tensor(allocate(static_cast<size_t>(numel) * dtype_size(dtype), shape), shape, dtype,
                numel);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype) {
  Tensor t = empty(shape, dtype);
  t.fill(value);
  return t;
}

Tensor Tensor::from_vector(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  check(static_cast<int64_t>(values.size()) == t.numel_, "Tensor::from_vector",
        "{} values given for shape {} ({} elements)", values.size(), shape_arg(shape), t.numel_);
  for (int64_t i = 0; i < t.numel_; ++i)
    store(static_cast<std::byte*>(t.data_) + i * dtype_size(dtype), dtype, values[i]);
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape) {
  return from_vector(std::vector<double>(values.begin(), values.end()), shape, DType::F32);
}

Tensor Tensor::from_vector(const std::vector<int64_t>& values, const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  check(static_cast<int64_t>(values.size()) == t.numel_, "Tensor::from_vector",
        "{} values given for shape {} ({} elements)", values.size(), shape_arg(shape), t.numel_);
  for (int64_t i = 0; i < t.numel_; ++i) {
    auto* p = static_cast<std::byte*>(t.data_) + i * dtype_size(dtype);
    if (dtype == DType::I64)
      *reinterpret_cast<int64_t*>(p) = values[i];
    else
      store(p, dtype, static_cast<double>(values[i]));
  }
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, Strides strides) {
  Tensor t;
  t.numel_ = shape_numel(shape, "Tensor::wrap");
  check(strides.empty() || strides.size() == shape.size(), "Tensor::wrap",
        "{} strides given for shape {}", strides.size(), shape_arg(shape));
  check(data != nullptr || t.numel_ == 0, "Tensor::wrap", "null data for shape {}",
        shape_arg(shape));
  t.data_ = data;
  t.shape_ = shape;
  t.strides_ = strides.empty() ? contiguous_strides(shape) : std::move(strides);
  t.dtype_ = dtype;
  t.defined_ = true;
  return t;
}

Tensor Tensor::adopt(std::shared_ptr<std::byte> storage, const Shape& shape, DType dtype,
                     Device device) {
  Tensor t;
  t.numel_ = shape_numel(shape, "Tensor::adopt");
  check(storage != nullptr || t.numel_ == 0, "Tensor::adopt", "null storage for shape {}",
        shape_str(shape));
  t.storage_ = std::move(storage);
  t.data_ = t.storage_.get();
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.defined_ = true;
  return t;
}

void Tensor::require_host(const char* op) const {
  check(device_ == Device::kCpu, op, "tensor of shape {} lives on {}; copy it to the host first",
        shape_arg(shape_), device_name(device_));
}

void Tensor::bad_axis(int i, const char* op) const {
  throw Error(op, fmt::format("dimension {} out of range for shape {}", i, shape_str(shape_)));
}

bool Tensor::is_contiguous() const {
  if (numel_ == 0) return true;  // nothing to lay out: (2, 0) is as contiguous as it gets
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

namespace {
// The throwing branch of offset_of, out of line so that the accessor itself formats nothing.
[[noreturn, gnu::cold, gnu::noinline]] void throw_bad_index(const int64_t* index, size_t n,
                                                            const Shape& shape) {
  if (n != shape.size())
    throw Error("Tensor::at", fmt::format("{}-d index for shape {}", n, shape_str(shape)));
  for (size_t i = 0; i < n; ++i)
    if (index[i] < 0 || index[i] >= shape[i])
      throw Error("Tensor::at", fmt::format("index {} out of range in dimension {} of shape {}",
                                            index[i], i, shape_str(shape)));
  throw Error("Tensor::at", "bad index");
}
}  // namespace

int64_t Tensor::offset_of(const int64_t* index, size_t n) const {
  require_host("Tensor::at");
  if (n != shape_.size()) throw_bad_index(index, n, shape_);
  int64_t off = 0;
  for (size_t i = 0; i < n; ++i) {
    if (index[i] < 0 || index[i] >= shape_[i]) throw_bad_index(index, n, shape_);
    off += index[i] * strides_[i];
  }
  return off;
}

int64_t Tensor::offset_of_flat(int64_t i) const {
  int64_t off = 0;
  for (size_t d = shape_.size(); d-- > 0;) {
    off += (i % shape_[d]) * strides_[d];
    i /= shape_[d];
  }
  return off;
}

double Tensor::at(std::initializer_list<int64_t> index) const {
  return load(
      static_cast<std::byte*>(data_) + offset_of(index.begin(), index.size()) * dtype_size(dtype_),
      dtype_);
}

double Tensor::at(const std::vector<int64_t>& index) const {
  return load(
      static_cast<std::byte*>(data_) + offset_of(index.data(), index.size()) * dtype_size(dtype_),
      dtype_);
}

void Tensor::set(std::initializer_list<int64_t> index, double value) {
  store(
      static_cast<std::byte*>(data_) + offset_of(index.begin(), index.size()) * dtype_size(dtype_),
      dtype_, value);
}

void Tensor::set(const std::vector<int64_t>& index, double value) {
  store(static_cast<std::byte*>(data_) + offset_of(index.data(), index.size()) * dtype_size(dtype_),
        dtype_, value);
}

double Tensor::flat(int64_t i) const {
  require_host("Tensor::flat");
  check(i >= 0 && i < numel_, "Tensor::flat", "index {} out of range for {} elements", i, numel_);
  return load(static_cast<std::byte*>(data_) + offset_of_flat(i) * dtype_size(dtype_), dtype_);
}

void Tensor::set_flat(int64_t i, double value) {
  require_host("Tensor::set_flat");
  check(i >= 0 && i < numel_, "Tensor::set_flat", "index {} out of range for {} elements", i,
        numel_);
  store(static_cast<std::byte*>(data_) + offset_of_flat(i) * dtype_size(dtype_), dtype_, value);
}

std::vector<double> Tensor::to_vector() const {
  require_host("Tensor::to_vector");
  std::vector<double> v(static_cast<size_t>(numel_));
  for (int64_t i = 0; i < numel_; ++i)
    v[i] = flat(i);
  return v;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor t = empty(shape_, dtype);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      check(infer < 0, "Tensor::reshape", "more than one -1 in {}", shape_arg(shape));
      infer = static_cast<int>(i);
    } else {
      check(s[i] >= 0, "Tensor::reshape", "negative dimension in {}", shape_arg(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    check(known > 0 && numel_ % known == 0, "Tensor::reshape",
          "cannot reshape {} ({} elements) to {}", shape_arg(shape_), numel_, shape_arg(shape));
    s[infer] = numel_ / known;
  }
  check(shape_numel(s, "Tensor::reshape") == numel_, "Tensor::reshape",
        "cannot reshape {} ({} elements) to {}", shape_arg(shape_), numel_, shape_arg(shape));
  Tensor t = contiguous();
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::permute(const std::vector<int>& order) const {
  check(order.size() == shape_.size(), "Tensor::permute", "order of {} dims for shape {}",
        order.size(), shape_arg(shape_));
  std::vector<bool> seen(order.size(), false);
  Tensor t = *this;
  for (size_t i = 0; i < order.size(); ++i) {
    int o = order[i];
    check(o >= 0 && o < ndim() && !seen[o], "Tensor::permute",
          "order is not a permutation of 0..{}", ndim() - 1);
    seen[o] = true;
    t.shape_[i] = shape_[o];
    t.strides_[i] = strides_[o];
  }
  return t;
}

Tensor Tensor::transpose(int a, int b) const {
  int n = ndim();
  check(a >= -n && a < n && b >= -n && b < n, "Tensor::transpose",
        "dimensions {} and {} out of range for shape {}", a, b, shape_arg(shape_));
  if (a < 0) a += n;
  if (b < 0) b += n;
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i)
    order[i] = i;
  std::swap(order[a], order[b]);
  return permute(order);
}

Tensor Tensor::slice(int d, int64_t start, int64_t stop) const {
  int n = ndim();
  check(d >= -n && d < n, "Tensor::slice", "dimension {} out of range for shape {}", d,
        shape_arg(shape_));
  if (d < 0) d += n;
  check(0 <= start && start <= stop && stop <= shape_[d], "Tensor::slice",
        "range [{}, {}) out of bounds for dimension {} of shape {}", start, stop, d,
        shape_arg(shape_));
  Tensor t = *this;
  t.data_ = static_cast<std::byte*>(data_) + start * strides_[d] * dtype_size(dtype_);
  t.shape_[d] = stop - start;
  t.numel_ = shape_numel(t.shape_);
  return t;
}

Tensor Tensor::select(int d, int64_t index) const {
  int n = ndim();
  check(d >= -n && d < n, "Tensor::select", "dimension {} out of range for shape {}", d,
        shape_arg(shape_));
  if (d < 0) d += n;
  Tensor t = slice(d, index, index + 1);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

// The bulk float32 <-> bfloat16 conversions (mixed precision converts activations and gradients
// this way at every linear layer). GCC compiles each loop once per listed target and picks one
// at load time (ifunc): the baseline x86-64 build vectorises them with SSE2 only, and AVX-512
// converts 16 values per instruction. Same integer arithmetic in every clone, so the same
// bits. Left out under AddressSanitizer (ifunc resolvers run before its
// runtime starts) and for clang (the fuzz build): the plain loop there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define ATTN_CONVERT_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTN_CONVERT_CLONES
#endif

// float_to_bf16 without its branch, so the loop vectorises: round to nearest even, NaN kept
// quiet.
ATTN_CONVERT_CLONES void floats_to_bf16(const float* x, uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    y[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

ATTN_CONVERT_CLONES void bf16_to_floats(const uint16_t* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = bf16_to_float(x[i]);
}

#undef ATTN_CONVERT_CLONES

void Tensor::copy_from(const Tensor& src) {
  require_host("Tensor::copy_from");
  src.require_host("Tensor::copy_from");
  check(src.shape_ == shape_, "Tensor::copy_from", "source shape {} differs from destination {}",
        shape_arg(src.shape_), shape_arg(shape_));
  if (is_contiguous() && src.is_contiguous()) {
    if (src.dtype_ == dtype_) {
      if (nbytes()) std::memmove(data_, src.data_, nbytes());
      return;
    }
    // float32 <-> bfloat16 in bulk (the Python binding's dtype="bfloat16" and its float32
    // results): the same conversions as set_flat/flat below, without the per-element index
    // arithmetic and double round trip.
    if (src.dtype_ == DType::F32 && dtype_ == DType::BF16) {
      floats_to_bf16(static_cast<const float*>(src.data_), static_cast<uint16_t*>(data_), numel_);
      return;
    }
    if (src.dtype_ == DType::BF16 && dtype_ == DType::F32) {
      bf16_to_floats(static_cast<const uint16_t*>(src.data_), static_cast<float*>(data_), numel_);
      return;
    }
  }
  for (int64_t i = 0; i < numel_; ++i)
    set_flat(i, src.flat(i));
}

void Tensor::fill(double value) {
  require_host("Tensor::fill");
  if (numel_ > 0 && is_contiguous()) {
    // The value converted once, then its bytes copied to every element (a batch's padding and
    // lengths were filled through set_flat, an index computation per element).
    auto* p = static_cast<std::byte*>(data_);
    store(p, dtype_, value);
    auto replicate = [&](auto* first) { std::fill_n(first, numel_, *first); };
    switch (dtype_) {
      case DType::F32:
        return replicate(reinterpret_cast<float*>(p));
      case DType::F64:
        return replicate(reinterpret_cast<double*>(p));
      case DType::BF16:
      case DType::F16:
        return replicate(reinterpret_cast<uint16_t*>(p));
      case DType::I32:
        return replicate(reinterpret_cast<int32_t*>(p));
      case DType::I64:
        return replicate(reinterpret_cast<int64_t*>(p));
    }
  }
  for (int64_t i = 0; i < numel_; ++i)
    set_flat(i, value);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  check(a.shape() == b.shape(), "max_abs_diff", "shapes {} and {} differ", shape_arg(a.shape()),
        shape_arg(b.shape()));
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double d = std::abs(a.flat(i) - b.flat(i));
    if (std::isnan(d)) return d;
    m = std::max(m, d);
  }
  return m;
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol, std::string* detail) {
  if (a.shape() != b.shape()) {
    if (detail)
      *detail = fmt::format("shapes {} and {} differ", shape_str(a.shape()), shape_str(b.shape()));
    return false;
  }
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.flat(i), y = b.flat(i);
    if (std::isnan(x) && std::isnan(y)) continue;
    if (!(std::abs(x - y) <= atol + rtol * std::abs(y))) {
      if (detail)
        *detail =
            fmt::format("element {} (row-major): {} vs {} (diff {})", i, x, y, std::abs(x - y));
      return false;
    }
  }
  return true;
}

}  // namespace attn
