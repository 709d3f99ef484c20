// Bit-preserving element packs for the memory-bound elementwise kernels (elementwise.cu, glu.cu, rope.cu;
// include from .cu files only). A Pack<T, E> holds E elements of T in their stored encoding (no f32
// conversion: callers load()/store<T>() each element themselves); kVec<T> elements make one 16-byte pack.
//
// Invariants: load_pack / store_pack of a 16-byte pack need a 16-byte aligned pointer (launchers check
// aligned16() from vec_io.cuh and the row geometry before choosing the vector path); smaller packs go element
// by element and need only T's alignment. Both paths move the same bits, so results never depend on the path.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda {

template <typename T>
constexpr int kVec = int(16 / sizeof(T));  // elements per 16-byte access

// E elements moved together. A 16-byte pack is one 128-bit access whose uint4 is packed and unpacked by
// hand and stored with __stwb (a plain store of a memcpy/union round trip was split by the compiler into
// pieces when a thread stores two packs); smaller packs go element by element.
template <typename T, int E>
struct Pack {
  T v[E];
};

template <typename T>
__device__ __forceinline__ uint32_t to_bits(T x) {
  if constexpr (std::is_same_v<T, float>) return __float_as_uint(x);
  else return x.bits;
}
template <typename T>
__device__ __forceinline__ T from_bits(uint32_t b) {
  if constexpr (std::is_same_v<T, float>) return __uint_as_float(b);
  else return T{uint16_t(b)};
}

template <typename T, int E>
__device__ __forceinline__ Pack<T, E> load_pack(const T* p) {
  Pack<T, E> out;
  if constexpr (sizeof(T) * E == 16) {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(T) == 4) {
        out.v[k] = from_bits<T>(w[k]);
      } else {
        out.v[2 * k] = from_bits<T>(w[k] & 0xFFFFu);
        out.v[2 * k + 1] = from_bits<T>(w[k] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) out.v[k] = p[k];
  }
  return out;
}
template <typename T, int E>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, E>& x) {
  if constexpr (sizeof(T) * E == 16) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(T) == 4) w[k] = to_bits(x.v[k]);
      else w[k] = to_bits(x.v[2 * k]) | (to_bits(x.v[2 * k + 1]) << 16);
    }
    __stwb(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) p[k] = x.v[k];
  }
}

}  // namespace loom::cuda
