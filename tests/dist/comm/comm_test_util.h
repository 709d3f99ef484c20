// Shared by the test_dist_comm sources: the world communicator (MPI is initialised on first use and
// finalised at exit) and exact test values for every dtype.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/tensor.h"
#include "loom/dist/communicator.h"

namespace loom::testing_dist {

inline const Communicator& world() {
  // 60 s: a broken test aborts the job with a message instead of running into ctest's timeout.
  static std::unique_ptr<Communicator> w = init_world(std::chrono::milliseconds(60000));
  return *w;
}

// Every dtype a communicator must carry.
inline std::vector<DType> all_dtypes() {
  return {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2,
          DType::kI32, DType::kI64, DType::kU16};
}

// Writes `v` (an integer exactly representable in every dtype used with it) as element i of t.
inline void set_value(TensorView t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::kF32: static_cast<float*>(t.raw())[i] = float(v); break;
    case DType::kBF16: static_cast<uint16_t*>(t.raw())[i] = f32_to_bf16(float(v)); break;
    case DType::kF16: static_cast<uint16_t*>(t.raw())[i] = f32_to_f16(float(v)); break;
    case DType::kF8E4M3: static_cast<uint8_t*>(t.raw())[i] = f32_to_fp8_e4m3(float(v)); break;
    case DType::kF8E5M2: static_cast<uint8_t*>(t.raw())[i] = f32_to_fp8_e5m2(float(v)); break;
    case DType::kI32: static_cast<int32_t*>(t.raw())[i] = int32_t(v); break;
    case DType::kI64: static_cast<int64_t*>(t.raw())[i] = int64_t(v); break;
    case DType::kU16: static_cast<uint16_t*>(t.raw())[i] = uint16_t(v); break;
  }
}

inline double get_value(TensorView t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return static_cast<const float*>(t.raw())[i];
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(t.raw())[i]);
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(t.raw())[i]);
    case DType::kF8E4M3: return fp8_e4m3_to_f32(static_cast<const uint8_t*>(t.raw())[i]);
    case DType::kF8E5M2: return fp8_e5m2_to_f32(static_cast<const uint8_t*>(t.raw())[i]);
    case DType::kI32: return static_cast<const int32_t*>(t.raw())[i];
    case DType::kI64: return double(static_cast<const int64_t*>(t.raw())[i]);
    case DType::kU16: return static_cast<const uint16_t*>(t.raw())[i];
  }
  return 0;
}

// The value a dtype stores for v (rounded once, as the communicator's f32 accumulation does).
inline double rounded(DType dt, double v) {
  std::vector<char> buf(8);
  TensorView t(buf.data(), dt, Shape{1});
  set_value(t, 0, v);
  return get_value(t, 0);
}

}  // namespace loom::testing_dist
