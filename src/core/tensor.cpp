#include "loom/core/tensor.h"

#include <cstring>

#include "loom/core/allocator.h"

namespace loom {

void TensorView::check_type(size_t size, int tag) const {
  bool ok = false;
  switch (tag) {
    case 1: ok = dtype_ == DType::kF32; break;
    case 2: ok = dtype_ == DType::kI32; break;
    case 3: ok = dtype_ == DType::kI64; break;
    case 4: ok = dtype_size(dtype_) == 2; break;
    case 5: ok = dtype_size(dtype_) == 1; break;
    default: ok = dtype_size(dtype_) == size; break;
  }
  LOOM_CHECK(ok, "[tensor] typed access of size ", size, " to a ", desc(), " tensor");
}

TensorView TensorView::reshape(Shape s) const {
  LOOM_CHECK(s.numel() == numel(), "[tensor] reshape ", desc(), " to ", s.str(), " changes element count");
  return TensorView(data_, dtype_, s, device_);
}

TensorView TensorView::slice_flat(int64_t offset, Shape s) const {
  LOOM_CHECK(offset >= 0 && offset + s.numel() <= numel(), "[tensor] slice [", offset, ", ",
             offset + s.numel(), ") out of range for ", desc());
  return TensorView(static_cast<char*>(data_) + offset * int64_t(dtype_size(dtype_)), dtype_, s, device_);
}

bool overlaps(TensorView a, TensorView b) {
  const auto* pa = static_cast<const char*>(a.raw());
  const auto* pb = static_cast<const char*>(b.raw());
  return a.nbytes() > 0 && b.nbytes() > 0 && pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

std::string TensorView::desc() const {
  return std::string(dtype_name(dtype_)) + shape_.str() + "@" + device_.str();
}

Storage::~Storage() {
  if (owned && data) allocator_for(device).deallocate(data, bytes);
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->bytes = size_t(shape.numel()) * dtype_size(dtype);
  t.storage_->device = device;
  t.storage_->data = allocator_for(device).allocate(t.storage_->bytes);
  t.view_ = TensorView(t.storage_->data, dtype, shape, device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  LOOM_CHECK(device.is_cpu(), "[tensor] Tensor::zeros is host-only; use the backend's fill for ", device.str());
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::wrap(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = data;
  t.storage_->bytes = size_t(shape.numel()) * dtype_size(dtype);
  t.storage_->device = device;
  t.storage_->owned = false;
  t.view_ = TensorView(data, dtype, shape, device);
  return t;
}

Tensor Tensor::reshape(Shape s) const {
  Tensor t = *this;
  t.view_ = view_.reshape(s);
  return t;
}

Tensor Tensor::slice_flat(int64_t offset, Shape s) const {
  Tensor t = *this;
  t.view_ = view_.slice_flat(offset, s);
  return t;
}

void Tensor::zero_() {
  LOOM_CHECK(device().is_cpu(), "[tensor] zero_ on ", desc(), " (host only)");
  if (nbytes() > 0) std::memset(raw(), 0, size_t(nbytes()));
}

}  // namespace loom
