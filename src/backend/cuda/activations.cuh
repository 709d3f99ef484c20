// Activation math shared by the elementwise GeLU (elementwise.cu) and the gated MLP activations (glu.cu);
// include from .cu files only. Both ops use these very functions, so GeGLU with up = 1 reproduces
// gelu_forward bit for bit.
//
// Invariants: f32 arithmetic; GeLU is the CPU's tanh form (src/backend/cpu/elementwise.cpp) written as
// x · sigmoid(2u) = 0.5 x (1 + tanh(u)) with the accurate expf, which avoids the cancellation of 1 + tanh(u)
// for large negative x and stays within f32 rounding of the CPU.
#pragma once
#include <cuda_runtime.h>

#include <cmath>

namespace loom::cuda {

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

// sigmoid(x) and 1 - sigmoid(x) = e · sigmoid(x), e = exp(-x) (no cancellation when sigmoid(x) is near 1).
struct SigmoidPair {
  float s, one_minus_s;
};
__device__ __forceinline__ SigmoidPair sigmoid_pair(float x) {
  const float e = expf(-x);
  const float s = 1.0f / (1.0f + e);
  return {s, e < INFINITY ? e * s : 1.0f};  // e = inf: s = 0 and e * s would be NaN
}

__device__ __forceinline__ float gelu(float x) {
  const float u = kGeluK0 * (x + kGeluK1 * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}

}  // namespace loom::cuda
