// Shape: a tensor's sizes (or strides), at most kMaxDims of them, stored inline.
//
// A decoder step at batch 1 makes a few hundred tensors, each with a shape and strides; as
// std::vector they cost two mallocs and two frees per tensor, about 15% of `attn translate
// --batch-size 1` (scripts/profile.sh). Like ggml's fixed ne[4] and gemma.cpp's Extents2D, the
// sizes live in the object. The interface is std::vector<int64_t>'s, as far as shapes use it,
// and converts to and from std::vector<int64_t> implicitly; a shape of more than kMaxDims
// dimensions throws Error naming the operation.
#pragma once

#include "attn/core/error.hpp"

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <vector>

namespace attn {

class Shape {
 public:
  static constexpr size_t kMaxDims = 8;

  using value_type = int64_t;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using pointer = int64_t*;
  using const_pointer = const int64_t*;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(size_t n, int64_t value = 0) { assign(n, value); }
  template <std::input_iterator It>
  Shape(It first, It last) {
    assign(first, last);
  }
  Shape(const std::vector<int64_t>& dims) { assign(dims.begin(), dims.end()); }  // NOLINT
  operator std::vector<int64_t>() const { return {begin(), end()}; }             // NOLINT

  Shape& operator=(std::initializer_list<int64_t> dims) {
    assign(dims.begin(), dims.end());
    return *this;
  }

  void assign(size_t n, int64_t value) {
    resize_unset(n);
    std::fill(begin(), end(), value);
  }
  template <std::input_iterator It>
  void assign(It first, It last) {
    size_ = 0;
    for (; first != last; ++first)
      push_back(static_cast<int64_t>(*first));
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  static constexpr size_t max_size() { return kMaxDims; }
  static constexpr size_t capacity() { return kMaxDims; }
  void reserve(size_t n) const { check_size(n); }
  void clear() { size_ = 0; }

  int64_t& operator[](size_t i) { return d_[i]; }
  const int64_t& operator[](size_t i) const { return d_[i]; }
  int64_t& at(size_t i) {
    check_index(i);
    return d_[i];
  }
  const int64_t& at(size_t i) const {
    check_index(i);
    return d_[i];
  }
  int64_t& front() { return d_[0]; }
  const int64_t& front() const { return d_[0]; }
  int64_t& back() { return d_[size_ - 1]; }
  const int64_t& back() const { return d_[size_ - 1]; }
  int64_t* data() { return d_; }
  const int64_t* data() const { return d_; }

  iterator begin() { return d_; }
  iterator end() { return d_ + size_; }
  const_iterator begin() const { return d_; }
  const_iterator end() const { return d_ + size_; }
  const_iterator cbegin() const { return d_; }
  const_iterator cend() const { return d_ + size_; }
  reverse_iterator rbegin() { return reverse_iterator(end()); }
  reverse_iterator rend() { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const { return const_reverse_iterator(begin()); }

  void push_back(int64_t v) {
    check_size(size_ + 1);
    d_[size_++] = v;
  }
  void pop_back() { --size_; }
  void resize(size_t n, int64_t value = 0) {
    const size_t old = size_;
    resize_unset(n);
    if (n > old) std::fill(d_ + old, d_ + n, value);
  }
  iterator insert(const_iterator pos, int64_t v) {
    const size_t i = static_cast<size_t>(pos - d_);
    check_size(size_ + 1);
    std::copy_backward(d_ + i, d_ + size_, d_ + size_ + 1);
    d_[i] = v;
    ++size_;
    return d_ + i;
  }
  template <std::input_iterator It>
  iterator insert(const_iterator pos, It first, It last) {
    const size_t i = static_cast<size_t>(pos - d_);
    Shape tail(d_ + i, d_ + size_);
    size_ = i;
    for (; first != last; ++first)
      push_back(static_cast<int64_t>(*first));
    for (int64_t v : tail)
      push_back(v);
    return d_ + i;
  }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    const size_t i = static_cast<size_t>(first - d_), j = static_cast<size_t>(last - d_);
    std::copy(d_ + j, d_ + size_, d_ + i);
    size_ -= j - i;
    return d_ + i;
  }

  friend bool operator==(const Shape& a, const Shape& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend std::strong_ordering operator<=>(const Shape& a, const Shape& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  int64_t d_[kMaxDims] = {};
  size_t size_ = 0;

  void resize_unset(size_t n) {
    check_size(n);
    size_ = n;
  }
  static void check_size(size_t n) {
    check(n <= kMaxDims, "Shape", "a tensor has at most {} dimensions, asked for {}", kMaxDims, n);
  }
  void check_index(size_t i) const {
    check(i < size_, "Shape::at", "index {} out of range for {} dimensions", i, size_);
  }
};

using Strides = Shape;

}  // namespace attn
