// Tensor-parallel building blocks: see loom/parallel/tensor_parallel.h. The lookup and the cross-entropy
// are built from the op table plus host-side bookkeeping (token ids are host tensors, as the embedding op
// requires); the cross-entropy's row arithmetic runs on host f32 rows.
#include "loom/parallel/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace loom {

namespace {
bool active(const Communicator* tp) { return tp != nullptr && tp->size() > 1; }
}  // namespace

ShardRange even_shard(int64_t size, int parts, int rank) {
  LOOM_CHECK(parts >= 1 && size % parts == 0 && rank >= 0 && rank < parts, "[even_shard] cannot split ", size,
             " evenly over ", parts, " parts (rank ", rank, ")");
  const int64_t n = size / parts;
  return {int64_t(rank) * n, n};
}

void tp_all_reduce(const Communicator* tp, TensorView x) {
  if (active(tp)) tp->all_reduce(x, ReduceOp::kSum);
}

void sp_all_gather(const Communicator* tp, TensorView full, TensorView shard) {
  LOOM_CHECK(tp != nullptr, "[sp_all_gather] sequence parallelism needs a tensor-parallel group");
  LOOM_CHECK(full.numel() == shard.numel() * tp->size(), "[sp_all_gather] full ", full.desc(), " is not ",
             tp->size(), " x shard ", shard.desc());
  tp->all_gather(full, shard);
}

void sp_reduce_scatter(const Communicator* tp, TensorView shard, TensorView full) {
  LOOM_CHECK(tp != nullptr, "[sp_reduce_scatter] sequence parallelism needs a tensor-parallel group");
  LOOM_CHECK(full.numel() == shard.numel() * tp->size(), "[sp_reduce_scatter] full ", full.desc(), " is not ",
             tp->size(), " x shard ", shard.desc());
  tp->reduce_scatter(shard, full);
}

void vocab_local_tokens(TensorView local, std::vector<int64_t>& outside, TensorView tokens, int64_t vocab_start,
                        int64_t rows) {
  LOOM_CHECK(tokens.dtype() == DType::kI32 && tokens.device().is_cpu() && local.dtype() == DType::kI32 &&
                 local.device().is_cpu() && local.numel() == tokens.numel(),
             "[vocab_local_tokens] expected host i32 tokens and output of one size, got ", tokens.desc(), " and ",
             local.desc());
  const int32_t* t = tokens.data<int32_t>();
  int32_t* o = local.data<int32_t>();
  outside.clear();
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    const int64_t v = int64_t(t[i]) - vocab_start;
    if (v >= 0 && v < rows) {
      o[i] = int32_t(v);
    } else {
      o[i] = 0;
      outside.push_back(i);
    }
  }
}

void embedding_positions(TensorView positions, TensorView position_ids) {
  LOOM_CHECK(positions.dtype() == DType::kI32 && positions.device().is_cpu() && positions.ndim() == 2,
             "[embedding_positions] expected host i32 (B, T), got ", positions.desc());
  int32_t* o = positions.data<int32_t>();
  const int64_t n = positions.numel(), T = positions.size(1);
  if (position_ids.defined()) {
    LOOM_CHECK(position_ids.numel() == n && position_ids.dtype() == DType::kI32 && position_ids.device().is_cpu(),
               "[embedding_positions] position_ids ", position_ids.desc(), " must match ", positions.desc());
    std::copy_n(position_ids.data<int32_t>(), n, o);
    return;
  }
  for (int64_t i = 0; i < n; ++i) o[i] = int32_t(i % T);
}

namespace {
// Zeroes the listed rows of x viewed as (rows, C).
void zero_rows(const DeviceContext& ctx, TensorView x, int64_t C, const std::vector<int64_t>& rows) {
  for (int64_t r : rows) ctx.ops().fill_(x.slice_flat(r * C, {1, C}), 0.0f);
}
}  // namespace

void vocab_parallel_embedding_forward(const DeviceContext& ctx, TensorView out, TensorView local_tokens,
                                      const std::vector<int64_t>& outside, TensorView wte_shard, TensorView wpe,
                                      TensorView positions, bool add_positions, TensorView scratch) {
  const OpTable& ops = ctx.ops();
  const int64_t C = wte_shard.size(1), N = local_tokens.numel();
  const Shape rows3{1, N, C};
  ops.embedding_forward(out.reshape(rows3), local_tokens.reshape({1, N}), wte_shard, TensorView());
  zero_rows(ctx, out, C, outside);
  if (add_positions && wpe.defined()) {
    // The position rows looked up as a table of their own (positions as "tokens"), added once.
    ops.embedding_forward(scratch.reshape(rows3), positions.reshape({1, N}), wpe, TensorView());
    ops.residual_forward(out.reshape({N, C}), out.reshape({N, C}), scratch.reshape({N, C}));
  }
}

void vocab_parallel_embedding_backward(const DeviceContext& ctx, TensorView dwte_shard, TensorView dwpe,
                                       TensorView dout, TensorView local_tokens, const std::vector<int64_t>& outside,
                                       TensorView positions) {
  const OpTable& ops = ctx.ops();
  const int64_t C = dwte_shard.size(1), N = local_tokens.numel();
  const TensorView d = dout.reshape({1, N, C});
  if (dwpe.defined()) ops.embedding_backward(dwpe, TensorView(), d, positions.reshape({1, N}));
  zero_rows(ctx, dout, C, outside);
  ops.embedding_backward(dwte_shard, TensorView(), d, local_tokens.reshape({1, N}));
}

void vocab_parallel_cross_entropy(const DeviceContext& ctx, const Communicator* tp, TensorView losses,
                                  TensorView logits, TensorView targets, int64_t vocab_start, int64_t vocab_size,
                                  TensorView loss_mask, float scale, TensorView stats) {
  const char* op = "vocab_parallel_cross_entropy";
  LOOM_CHECK(logits.device().is_cpu() && (logits.dtype() == DType::kF32 || logits.dtype() == DType::kBF16 || logits.dtype() == DType::kF16), "[", op,
             "] expected host f32, bf16 or f16 logits, got ", logits.desc());
  const int64_t Vl = logits.shape().cols(), N = logits.numel() / Vl;
  LOOM_CHECK(losses.dtype() == DType::kF32 && losses.numel() == N && stats.dtype() == DType::kF32 &&
                 stats.numel() == 2 * N && targets.dtype() == DType::kI32 && targets.numel() == N,
             "[", op, "] expected f32 losses (", N, "), f32 stats (2, ", N, ") and i32 targets (", N, "), got ",
             losses.desc(), ", ", stats.desc(), ", ", targets.desc());
  const float* mask = nullptr;
  if (loss_mask.defined()) {
    LOOM_CHECK(loss_mask.dtype() == DType::kF32 && loss_mask.numel() == N, "[", op, "] expected f32 loss_mask (", N,
               "), got ", loss_mask.desc());
    mask = loss_mask.data<float>();
  }
  const int32_t* tgt = targets.data<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    LOOM_CHECK((mask && mask[n] == 0.0f) || (tgt[n] >= 0 && tgt[n] < vocab_size), "[", op, "] target ", tgt[n],
               " of row ", n, " is outside the vocabulary [0, ", vocab_size, ") and the row is not masked out");
  // Real (non-padding) columns of this shard: [0, Vv).
  const int64_t Vv = std::clamp<int64_t>(vocab_size - vocab_start, 0, Vl);
  const bool f32 = logits.dtype() == DType::kF32;
  std::vector<float> row_buf(f32 ? 0 : size_t(Vl));
  // Row n as f32 (widened into row_buf for bf16/f16).
  auto row = [&](int64_t n) -> float* {
    if (f32) return logits.data<float>() + n * Vl;
    ctx.ops().cast(TensorView(row_buf.data(), DType::kF32, {Vl}), logits.slice_flat(n * Vl, {Vl}));
    return row_buf.data();
  };
  float* mx = losses.data<float>();
  float* sum = stats.data<float>();
  float* xt = sum + N;
  for (int64_t n = 0; n < N; ++n) {
    const float* x = row(n);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < Vv; ++j) m = std::max(m, x[j]);
    mx[n] = m;
  }
  if (active(tp)) tp->all_reduce(losses, ReduceOp::kMax);
  for (int64_t n = 0; n < N; ++n) {
    const float* x = row(n);
    double s = 0;
    for (int64_t j = 0; j < Vv; ++j) s += std::exp(double(x[j]) - double(mx[n]));
    sum[n] = float(s);
    const int64_t t = int64_t(tgt[n]) - vocab_start;
    xt[n] = (t >= 0 && t < Vv) ? x[t] : 0.0f;  // only the rank holding the target column contributes
  }
  if (active(tp)) tp->all_reduce(stats, ReduceOp::kSum);
  const bool backward = scale != 0.0f;
  for (int64_t n = 0; n < N; ++n) {
    const bool valid = tgt[n] >= 0 && tgt[n] < vocab_size;
    const float m = mx[n];
    const double s = double(sum[n]);
    if (backward) {
      const float coef = valid ? scale * (mask ? mask[n] : 1.0f) : 0.0f;
      float* x = row(n);
      const int64_t t = int64_t(tgt[n]) - vocab_start;
      for (int64_t j = 0; j < Vv; ++j) x[j] = coef == 0.0f ? 0.0f : float(std::exp(double(x[j]) - m) / s * coef);
      if (valid && t >= 0 && t < Vv) x[t] -= coef;
      std::fill(x + Vv, x + Vl, 0.0f);
      if (!f32) ctx.ops().cast(logits.slice_flat(n * Vl, {Vl}), TensorView(row_buf.data(), DType::kF32, {Vl}));
    }
    mx[n] = valid ? float(double(m) + std::log(s) - double(xt[n])) : 0.0f;
  }
}

}  // namespace loom
