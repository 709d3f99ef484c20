// 16-byte vector access helpers (include from .cu files only): the alignment test launchers use to choose a
// vector path, and chunk access for row kernels that work in f32 (norm.cu, embedding.cu; pack.cuh has the
// bit-preserving packs of the elementwise kernels).
//
// A chunk is kChunk<T> consecutive elements of T (4 f32 or 8 bf16/f16). load_chunk widens it to f32 and
// store_chunk rounds it back with device_utils.cuh's load()/store<T>(), so a chunk costs one 128-bit access
// per 16 bytes on the vector path and one access per element on the scalar path, with the same values in
// the same array slots either way: results never depend on which path a launcher chose.
//
// Invariants: the vector path (kVec = true) requires a 16-byte aligned pointer and a full chunk (n == kN);
// launchers pick it only when every pointer passes aligned16() and the row width is a multiple of the chunk.
// The scalar path touches only p[0, n); load_chunk fills the slots past n with zeros.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "loom/core/tensor.h"

namespace loom::cuda {

// 16-byte alignment, the condition for a 128-bit access. An undefined view passes (nothing is accessed).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool aligned16(TensorView t) { return !t.defined() || reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0; }

template <typename T>
inline constexpr int kChunk = int(16 / sizeof(T));  // elements per 16-byte chunk of T

template <typename T>
union Word16 {  // 16 bytes seen as elements of T
  uint4 raw;
  T e[16 / sizeof(T)];
};

// v[0, kN) = p[0, n) widened to f32 (zeros past n). kVec: n == kN and p is 16-byte aligned.
template <int kN, bool kVec, typename T>
__device__ __forceinline__ void load_chunk(const T* p, int n, float (&v)[kN]) {
  if constexpr (kVec) {
    constexpr int kPer = 16 / int(sizeof(T));
    static_assert(kN % kPer == 0, "chunk must be whole 16-byte words");
#pragma unroll
    for (int w = 0; w < kN / kPer; ++w) {
      Word16<T> word;
      word.raw = reinterpret_cast<const uint4*>(p)[w];
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[w * kPer + i] = load(word.e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = i < n ? load(p[i]) : 0.0f;
  }
}

// p[0, n) = v rounded to T.
template <int kN, bool kVec, typename T>
__device__ __forceinline__ void store_chunk(T* p, int n, const float (&v)[kN]) {
  if constexpr (kVec) {
    constexpr int kPer = 16 / int(sizeof(T));
#pragma unroll
    for (int w = 0; w < kN / kPer; ++w) {
      Word16<T> word;
#pragma unroll
      for (int i = 0; i < kPer; ++i) word.e[i] = store<T>(v[w * kPer + i]);
      reinterpret_cast<uint4*>(p)[w] = word.raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (i < n) p[i] = store<T>(v[i]);
  }
}

}  // namespace loom::cuda
