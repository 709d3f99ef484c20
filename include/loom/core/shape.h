// Shape: up to kMaxDims int64 extents, row-major. Negative indices count from the end.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

namespace loom {

class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const;
  int64_t numel() const;
  // Product of all dimensions but the last (the "rows" of a 2-D view; well defined when the last dim is
  // 0, e.g. a K = 0 matmul operand), and the last dimension.
  int64_t rows() const {
    int64_t r = 1;
    for (int i = 0; i + 1 < ndim_; ++i) r *= dims_[i];
    return r;
  }
  int64_t cols() const { return ndim_ == 0 ? 1 : dims_[ndim_ - 1]; }
  const int64_t* begin() const { return dims_; }
  const int64_t* end() const { return dims_ + ndim_; }
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "(2, 3, 4)"

 private:
  int64_t dims_[kMaxDims] = {};
  int ndim_ = 0;
};

}  // namespace loom
