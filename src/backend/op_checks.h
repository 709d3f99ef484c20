// Helpers for the backend-neutral argument checks of the op table (op_checks*.cpp define the OpTable entry
// points; ops.h states the rules). Private to the backend layer. Messages follow DESIGN.md: "[op] ..." naming
// the tensor at fault and what would be valid, so a failure reads the same whichever backend was called.
#pragma once
#include <cstdint>

#include "loom/backend/ops.h"

namespace loom::op_checks {

inline bool is_compute_dtype(DType dt) { return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16; }
inline bool is_fp8(DType dt) { return dt == DType::kF8E4M3 || dt == DType::kF8E5M2; }
// The dtypes the float utilities (cast, scale_, sum_squares, has_inf_or_nan) convert: compute dtypes and fp8.
inline bool is_float_dtype(DType dt) { return is_compute_dtype(dt) || is_fp8(dt); }

// t is given and lives on dev.
void require(Device dev, TensorView t, const char* op, const char* name);
// t, when given, lives on dev.
void on_device(Device dev, TensorView t, const char* op, const char* name);
void expect_numel(TensorView t, int64_t n, const char* op, const char* name);

// The compute dtype of a call, read from the activation `t`: f32, bf16 or f16.
DType compute_dtype(TensorView t, const char* op, const char* name);

// Attention head parameters shared by the attention, block and RoPE ops: NH a positive multiple of NKV,
// HS > 0.
void check_heads(const AttentionParams& p, const char* op);
// The masking and dropout parameters of the attention ops: window -1 or > 0 (causal only), dropout_p in
// [0, 1).
void check_attention_params(const AttentionParams& p, const char* op);

}  // namespace loom::op_checks
