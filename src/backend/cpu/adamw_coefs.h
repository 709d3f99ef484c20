// AdamW's per-step scalar coefficients, computed on the host once per call and shared by the CPU reference
// (optimizer.cpp) and the CUDA kernel (backend/cuda/optimizer.cu), so both backends round the same
// constants. PyTorch computes them in f64 from the Python floats the user wrote, so each f32
// hyper-parameter is read as the shortest decimal that rounds to it (0.9f counts as 0.9).
#pragma once
#include "loom/backend/ops.h"

namespace loom::cpu {

struct AdamWCoefs {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps, grad_scale;
};

// p.step >= 1 (1-based; checked by OpTable::adamw_update).
AdamWCoefs adamw_coefs(const AdamWParams& p);

}  // namespace loom::cpu
