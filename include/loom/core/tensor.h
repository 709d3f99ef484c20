// Tensor: an owning, reference-counted handle to contiguous storage (dtype, shape, device).
// TensorView: a non-owning view with the same metadata; ops take views so they never care about
// ownership. A Tensor can be a view into a larger storage (e.g. one parameter inside the contiguous
// parameter buffer): `slice_flat` shares the storage and keeps it alive.
// An empty (default-constructed) TensorView means "absent" for optional op arguments.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "loom/core/check.h"
#include "loom/core/device.h"
#include "loom/core/dtype.h"
#include "loom/core/shape.h"

namespace loom {

class TensorView {
 public:
  TensorView() = default;
  TensorView(void* data, DType dtype, Shape shape, Device device = cpu_device())
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  bool defined() const { return data_ != nullptr; }
  explicit operator bool() const { return defined(); }
  void* raw() const { return data_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  Device device() const { return device_; }
  int64_t numel() const { return shape_.numel(); }
  int64_t nbytes() const { return numel() * int64_t(dtype_size(dtype_)); }
  int ndim() const { return shape_.ndim(); }
  int64_t size(int i) const { return shape_[i]; }

  // Typed pointer; checks that T matches the dtype (f32, i32, i64; 16/8-bit types via uint16_t/uint8_t).
  template <typename T>
  T* data() const {
    check_type(sizeof(T), type_tag<T>());
    return static_cast<T*>(data_);
  }
  // Same storage, new shape with the same number of elements.
  TensorView reshape(Shape s) const;
  // Elements [offset, offset + numel(s)) of the flat storage, viewed with shape s.
  TensorView slice_flat(int64_t offset, Shape s) const;
  std::string desc() const;  // "f32(2, 3)@cpu"

 private:
  template <typename T>
  static constexpr int type_tag() {
    if constexpr (std::is_same_v<T, float>) return 1;
    else if constexpr (std::is_same_v<T, int32_t>) return 2;
    else if constexpr (std::is_same_v<T, int64_t>) return 3;
    else if constexpr (std::is_same_v<T, uint16_t>) return 4;
    else if constexpr (std::is_same_v<T, uint8_t>) return 5;
    else if constexpr (std::is_same_v<T, double>) return 6;
    else return 0;
  }
  void check_type(size_t size, int tag) const;

  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  Device device_;
};

// Whether a and b share a byte of memory (their byte ranges intersect; an empty view shares none). Views on
// different devices never compare equal addresses in practice, so this is only meaningful per device.
bool overlaps(TensorView a, TensorView b);

struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device;
  bool owned = true;  // false: wraps memory owned elsewhere (mmap, caller buffers)
  ~Storage();
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device = cpu_device());
  static Tensor zeros(Shape shape, DType dtype, Device device = cpu_device());
  // Wraps memory the caller keeps alive for the lifetime of the tensor.
  static Tensor wrap(void* data, Shape shape, DType dtype, Device device = cpu_device());

  bool defined() const { return storage_ != nullptr; }
  explicit operator bool() const { return defined(); }
  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: implicit by design, ops take views

  DType dtype() const { return view_.dtype(); }
  const Shape& shape() const { return view_.shape(); }
  Device device() const { return view_.device(); }
  int64_t numel() const { return view_.numel(); }
  int64_t nbytes() const { return view_.nbytes(); }
  int ndim() const { return view_.ndim(); }
  int64_t size(int i) const { return view_.size(i); }
  void* raw() const { return view_.raw(); }
  template <typename T>
  T* data() const { return view_.data<T>(); }

  Tensor reshape(Shape s) const;
  Tensor slice_flat(int64_t offset, Shape s) const;
  void zero_();  // host tensors only; device tensors use the backend's fill
  std::string desc() const { return view_.desc(); }

 private:
  std::shared_ptr<Storage> storage_;
  TensorView view_;
};

}  // namespace loom
