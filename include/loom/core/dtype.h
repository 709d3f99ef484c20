// Element types. Floating types are storage formats: arithmetic happens in f32 (or f64 in tests);
// conversions round to nearest, ties to even. FP8 conversions saturate to the largest finite value
// (as Transformer Engine's casts do) and keep NaN as NaN. Integer types hold token ids and indices.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace loom {

enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3, kF8E5M2, kI32, kI64, kU16 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);
bool dtype_is_float(DType dt);

uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t x);
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t x);
uint8_t f32_to_fp8_e4m3(float x);  // max finite 448, no infinities
float fp8_e4m3_to_f32(uint8_t x);
uint8_t f32_to_fp8_e5m2(float x);  // max finite 57344
float fp8_e5m2_to_f32(uint8_t x);

// Largest finite value of a floating dtype.
double dtype_max(DType dt);

// Element i of a float-dtype array as f32, and f32 stored into one (rounding as above): the scalar path
// for host code that walks arrays of any float dtype (checkpoint conversion, the KV cache).
float load_as_f32(const void* base, DType dt, int64_t i);
void store_from_f32(void* base, DType dt, int64_t i, float v);

template <typename T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kF32; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kI64; };

}  // namespace loom
