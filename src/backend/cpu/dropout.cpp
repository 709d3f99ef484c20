// CPU dropout (Megatron's --hidden-dropout): out = inp * keep / (1 - p), and the same for the gradient.
// Invariants:
//   - keep[i] = dropout_keep(seed, stream, offset + i, dropout_threshold(p)) for the flat element index i
//     (the rule of core/rng.h), so the mask is never stored: backward and a recomputed forward regenerate
//     it, and results do not depend on the thread count, on how the work is split, or on whether the
//     tensor is drawn whole or as pieces at their offsets;
//   - the words come 64 elements (16 Philox blocks) per call of philox_words_x64, vectorised;
//   - kept elements are widened to f32, multiplied by the f32 scale 1 / (1 - p) and rounded once to the
//     dtype; dropped elements are exactly 0 (a select, so an inf or NaN that is dropped does not leak);
//   - out may alias inp (each 64-element chunk is read completely before it is written); p == 0 is a copy,
//     or nothing when out is inp.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"
#include "backend/cpu/philox_simd.h"
#include "loom/core/rng.h"

namespace loom::cpu {

namespace {

constexpr int64_t kChunk = 64;                       // elements per philox_words_x64 call
constexpr int64_t kParallelMin = int64_t(1) << 15;  // elements; below this a thread team costs more than it saves

template <DType D>
using Elem = std::conditional_t<D == DType::kF32, float, uint16_t>;

template <DType D>
void dropout_apply(Elem<D>* out, const Elem<D>* inp, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset,
                   uint32_t threshold, float scale) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const uint64_t shift = offset % 4;  // an offset inside a Philox block: words of two block runs
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t e0 = c * kChunk, m = std::min(kChunk, n - e0);
    alignas(64) uint32_t words[2][kChunk];
    const uint64_t block = (offset + uint64_t(e0)) / 4;
    philox_words_x64(words[0], seed, stream, block);
    if (shift != 0) philox_words_x64(words[1], seed, stream, block + kChunk / 4);
    const uint32_t* w = &words[0][0] + shift;
    if constexpr (D == DType::kF32) {
      const float* x = inp + e0;
      float* y = out + e0;
#pragma omp simd
      for (int64_t e = 0; e < m; ++e) y[e] = w[e] >= threshold ? x[e] * scale : 0.0f;
    } else {
      alignas(64) float x[kChunk];
      Lowp<D>::widen(x, inp + e0, m);
#pragma omp simd
      for (int64_t e = 0; e < m; ++e) x[e] = w[e] >= threshold ? x[e] * scale : 0.0f;
      Lowp<D>::narrow(out + e0, x, m);
    }
  }
}

// out = inp * keep / (1 - p); out is inp itself or does not overlap it (checked by the OpTable entry point).
void dropout(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream, uint64_t offset) {
  if (p == 0.0f) {
    if (out.raw() != inp.raw()) std::memcpy(out.raw(), inp.raw(), size_t(inp.nbytes()));
    return;
  }
  const uint32_t threshold = dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);
  const int64_t n = inp.numel();
  switch (inp.dtype()) {
    case DType::kF32:
      dropout_apply<DType::kF32>(static_cast<float*>(out.raw()), static_cast<const float*>(inp.raw()), n, seed,
                                 stream, offset, threshold, scale);
      break;
    case DType::kBF16:
      dropout_apply<DType::kBF16>(static_cast<uint16_t*>(out.raw()), static_cast<const uint16_t*>(inp.raw()), n,
                                  seed, stream, offset, threshold, scale);
      break;
    default:
      dropout_apply<DType::kF16>(static_cast<uint16_t*>(out.raw()), static_cast<const uint16_t*>(inp.raw()), n,
                                 seed, stream, offset, threshold, scale);
      break;
  }
}

}  // namespace

void CpuOps::do_dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                                uint64_t offset) const {
  dropout(out, inp, p, seed, stream, offset);
}

void CpuOps::do_dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                                 uint64_t offset) const {
  dropout(dinp, dout, p, seed, stream, offset);
}

}  // namespace loom::cpu
