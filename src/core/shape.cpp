#include "loom/core/shape.h"

#include "loom/core/check.h"

namespace loom {

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  LOOM_CHECK(dims.size() <= size_t(kMaxDims), "[Shape] at most ", kMaxDims, " dims, got ", dims.size());
  for (int64_t d : dims) {
    LOOM_CHECK(d >= 0, "[Shape] negative extent ", d);
    dims_[ndim_++] = d;
  }
}

int64_t Shape::operator[](int i) const {
  const int j = i < 0 ? i + ndim_ : i;
  LOOM_CHECK(j >= 0 && j < ndim_, "[Shape] index ", i, " out of range for ", str());
  return dims_[j];
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < ndim_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  return s + ")";
}

}  // namespace loom
