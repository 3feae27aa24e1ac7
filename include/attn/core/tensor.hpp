// Tensor: a typed, strided, n-dimensional array, owning or viewing memory.
//
// Glossary used across attn: B batch, T queries, S keys/values, H heads, D head dim,
// E = H*D model width (d2l's num_hiddens), V vocabulary.
//
// Layout: row-major by default; strides are in elements (not bytes), so a view such as one head
// of a (B, T, E) activation, (B, T, D) with strides (T*E, E, 1), needs no copy. A Tensor made by
// `empty`/`zeros`/... owns its memory (shared: copies of the Tensor object share it, like
// PyTorch); `Tensor::wrap` views memory that someone else owns and must outlive it.
#pragma once

#include "attn/core/device.hpp"
#include "attn/core/dtype.hpp"
#include "attn/core/error.hpp"
#include "attn/core/shape.hpp"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace attn {

// "(2, 4, 100)"; "()" for a scalar.
std::string shape_str(const Shape& shape);
// A shape for check()'s message, formatted as shape_str only when the check fails ("undefined" for
// an undefined tensor). Arguments of check() are evaluated on every call, so hot checks pass this
// rather than shape_str(...). It refers to the shape: use it within the call's expression only.
struct ShapeArg {
  const Shape* shape = nullptr;
};
inline ShapeArg shape_arg(const Shape& shape) {
  return ShapeArg{&shape};
}
// Number of elements; throws Error(op) when the product overflows int64 or a dim is negative.
int64_t shape_numel(const Shape& shape, const char* op = "Tensor");
Strides contiguous_strides(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false (used for "no valid_lens", "no bias")

  static Tensor empty(const Shape& shape, DType dtype = DType::F32);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32);
  // Copies `values` (row-major) into a new tensor of `shape` and `dtype`.
  static Tensor from_vector(const std::vector<double>& values, const Shape& shape,
                            DType dtype = DType::F32);
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape);
  static Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape,
                            DType dtype = DType::I64);
  // Non-owning view of `data`; strides default to contiguous.
  static Tensor wrap(void* data, const Shape& shape, DType dtype, Strides strides = {});
  // A contiguous tensor owning `storage` (its deleter frees it) on `device`: how a backend's
  // allocator (the CUDA pool) makes device tensors. Element access (at, to_vector, fill, ...)
  // needs host memory and throws Error for another device; views (slice, permute, ...) work.
  static Tensor adopt(std::shared_ptr<std::byte> storage, const Shape& shape, DType dtype,
                      Device device);

  bool defined() const { return defined_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Strides& strides() const { return strides_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Size of dimension i; negative i counts from the back (dim(-1) is the last).
  int64_t dim(int i) const { return shape_[axis(i, "Tensor::dim")]; }
  int64_t stride(int i) const { return strides_[axis(i, "Tensor::stride")]; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  bool is_contiguous() const;
  // True when the tensor owns (shares ownership of) its memory.
  bool owns_memory() const { return storage_ != nullptr; }

  // Typed pointer to element (0, ..., 0); throws Error if T does not match dtype().
  template <typename T>
  T* data() const {
    check(dtype_of<T>() == dtype_, "Tensor::data", "tensor has dtype {}, requested {}",
          dtype_name(dtype_), dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }
  void* raw_data() const { return data_; }

  // Element access by multi-index, converted to/from double (any dtype). For tests and
  // plumbing, not for inner loops.
  double at(std::initializer_list<int64_t> index) const;
  double at(const std::vector<int64_t>& index) const;
  void set(std::initializer_list<int64_t> index, double value);
  void set(const std::vector<int64_t>& index, double value);
  // Element at row-major logical position i (honours strides).
  double flat(int64_t i) const;
  void set_flat(int64_t i, double value);
  // All elements in row-major logical order.
  std::vector<double> to_vector() const;

  // A contiguous tensor with the same values: *this when already contiguous, else a copy.
  Tensor contiguous() const;
  Tensor clone() const;          // always a fresh contiguous owning copy
  Tensor to(DType dtype) const;  // converted copy (or *this when dtype matches)
  // Same data, new shape: a view when contiguous, a copy otherwise. One dim may be -1.
  Tensor reshape(const Shape& shape) const;
  Tensor permute(const std::vector<int>& order) const;       // view
  Tensor transpose(int a, int b) const;                      // view
  Tensor slice(int dim, int64_t start, int64_t stop) const;  // view of [start, stop) along dim
  Tensor select(int dim, int64_t index) const;               // view with dim removed

  // Copies values from `src` (same shape, any dtype) into this tensor's memory.
  void copy_from(const Tensor& src);
  void fill(double value);

 private:
  std::shared_ptr<std::byte> storage_;
  void* data_ = nullptr;
  Shape shape_;
  Strides strides_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
  Device device_ = Device::kCpu;
  bool defined_ = false;

  void require_host(const char* op) const;
  // Dimension i (negative counts from the back) as an index into shape_; throws Error(op)
  // naming the shape when it is out of range. Inline: every op asks for dims.
  size_t axis(int i, const char* op) const {
    const int n = ndim();
    if (i < -n || i >= n) [[unlikely]]
      bad_axis(i, op);
    return static_cast<size_t>(i < 0 ? i + n : i);
  }
  [[noreturn]] void bad_axis(int i, const char* op) const;

  int64_t offset_of(const int64_t* index, size_t n) const;
  int64_t offset_of_flat(int64_t i) const;

  // A fresh contiguous tensor on `storage` (Tensor::empty): each member set once by its
  // initializer. (A default-constructed Tensor, then assigned, was first zeroed whole with
  // `rep stos`: half of Tensor::empty's time.)
  Tensor(std::shared_ptr<std::byte> storage, const Shape& shape, DType dtype, int64_t numel)
      : storage_(std::move(storage)),
        data_(storage_.get()),
        shape_(shape),
        strides_(contiguous_strides(shape)),
        numel_(numel),
        dtype_(dtype),
        defined_(true) {}
};

inline ShapeArg shape_arg(const Tensor& t) {
  return ShapeArg{t.defined() ? &t.shape() : nullptr};
}

// Max |a - b| over all elements (shapes must match); NaN if either holds NaN.
double max_abs_diff(const Tensor& a, const Tensor& b);
// True when |a - b| <= atol + rtol * |b| everywhere (NaN equals NaN). `detail` (optional)
// receives the first offending index and values.
bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol,
              std::string* detail = nullptr);

}  // namespace attn

template <>
struct fmt::formatter<attn::ShapeArg> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  template <typename FormatContext>
  auto format(const attn::ShapeArg& a, FormatContext& ctx) const {
    return fmt::format_to(ctx.out(), "{}", a.shape ? attn::shape_str(*a.shape) : "undefined");
  }
};
