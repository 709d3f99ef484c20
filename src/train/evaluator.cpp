// Validation and test loss, and MLPerf's per-sequence metric (see evaluator.h).
#include "train/evaluator.h"

#include <cmath>

#include "loom/parallel/context_parallel.h"
#include "loom/parallel/host_collectives.h"
#include "loom/pipeline/schedule.h"

namespace loom {

void add_sequence_loss_sums(const float* losses, const float* mask, int64_t B, int64_t T,
                            const std::vector<int32_t>& positions, double* sums) {
  const int64_t Tl = positions.empty() ? T : int64_t(positions.size());
  for (int64_t b = 0; b < B; ++b) {
    double loss_sum = 0, mask_sum = 0;
    for (int64_t t = 0; t < Tl; ++t) {
      const int64_t pos = positions.empty() ? t : int64_t(positions[size_t(t)]);
      const double w = mask ? double(mask[b * T + pos]) : 1.0;
      if (w != 0.0) loss_sum += w * double(losses[b * Tl + t]);  // a masked-out NaN stays out, as in the model
      mask_sum += w;
    }
    sums[2 * b] += loss_sum;
    sums[2 * b + 1] += mask_sum;
  }
}

std::pair<double, int64_t> sum_of_sequence_means(const std::vector<double>& sums) {
  double total = 0;
  int64_t n = 0;
  for (size_t i = 0; i + 1 < sums.size(); i += 2)
    if (sums[i + 1] > 0) {
      total += sums[i] / sums[i + 1];
      ++n;
    }
  return {total, n};
}

Evaluator::Evaluator(TrainingRun& run) : run_(run) {}

EvalResult Evaluator::evaluate(const std::shared_ptr<const SampleDataset>& ds, bool test_set,
                               int64_t& consumed_samples) {
  const TrainConfig& cfg = run_.cfg;
  const ParallelState& ps = *run_.ps;
  LoaderConfig lc = run_.loader_config(consumed_samples);
  lc.prefetch_depth = 0;
  lc.role = test_set ? "test" : "validation";
  Loader loader(ds, lc);
  // FP8: the weights changed since the last step's quantisation, and evaluation amaxes must not steer
  // the training scales.
  const std::vector<GPTModel*> chunks = run_.models();
  for (GPTModel* m : chunks) m->fp8_begin_step();
  const bool last = ps.is_pipeline_last_stage();
  const bool masked = run_.batch_opts.eod_mask_loss || run_.batch_opts.dataset_extras;  // as model_batch
  const std::vector<int32_t> positions =
      ps.cp_size() > 1 ? cp_local_positions(run_.T, ps.cp_size(), ps.cp_rank()) : std::vector<int32_t>();
  // (loss sum, mask sum) of every sequence this rank evaluates: iteration, micro-batch, row.
  std::vector<double> sums(size_t(2 * cfg.eval.eval_iters * run_.nmb * run_.B), 0.0);
  Tensor host_losses;  // a device's per-token losses, brought back
  double total = 0;
  for (int64_t it = 0; it < cfg.eval.eval_iters; ++it) {
    std::vector<Batch> batches;
    for (int64_t mb = 0; mb < run_.nmb; ++mb) {
      std::optional<Batch> b = loader.next();
      if (!b) user_error("the evaluation data (", ds->description(), ") ran out; it was sized for --eval-iters ",
                         cfg.eval.eval_iters);
      batches.push_back(std::move(*b));
    }
    PipelineStepConfig pc;
    pc.num_microbatches = run_.nmb;
    pc.forward_only = true;
    PipelineCallbacks cb;
    cb.batch = [&](int64_t m) { return run_.model_batch(batches[size_t(m)]); };
    cb.after_loss = [&](int64_t m) {
      TensorView losses = chunks.back()->losses();  // (B, T / CP)
      if (!losses.device().is_cpu()) {
        if (!host_losses.defined() || host_losses.shape() != losses.shape())
          host_losses = Tensor::empty(losses.shape(), DType::kF32);
        run_.ctx->copy(host_losses, losses);
        losses = host_losses;
      }
      const float* mask = masked ? batches[size_t(m)].loss_mask.data<float>() : nullptr;
      add_sequence_loss_sums(losses.data<float>(), mask, run_.B, run_.T, positions,
                             sums.data() + 2 * (it * run_.nmb + m) * run_.B);
    };
    total += run_pipeline_step(chunks, ps.pp(), pc, cb).loss_sum;
    consumed_samples += run_.gbs;
  }
  for (GPTModel* m : chunks) m->fp8_discard_amaxes();
  EvalResult r;
  double loss = last ? total / double(cfg.eval.eval_iters * run_.nmb) : 0.0;
  loss = ps.dp().all_reduce_scalar(loss) / double(ps.dp_size());
  r.lm_loss = ps.pp().all_reduce_scalar(last ? loss : 0.0);
  // MLPerf's metric: whole sequences first (CP), then the sum of their means over the replicas (DP).
  if (last && ps.cp_size() > 1) {
    std::vector<float> fp(sums.begin(), sums.end());
    all_reduce_host(*run_.ctx, ps.cp(), fp.data(), int64_t(fp.size()));
    for (size_t i = 0; i < sums.size(); ++i) sums[i] = double(fp[i]);
  }
  auto [mean_sum, count] = last ? sum_of_sequence_means(sums) : std::pair<double, int64_t>{0.0, 0};
  mean_sum = ps.dp().all_reduce_scalar(mean_sum);
  double n = ps.dp().all_reduce_scalar(double(count));
  mean_sum = ps.pp().all_reduce_scalar(last ? mean_sum : 0.0);
  n = ps.pp().all_reduce_scalar(last ? n : 0.0);
  r.sequences = int64_t(n);
  r.sequence_loss = n > 0 ? mean_sum / n : NAN;
  return r;
}

}  // namespace loom
