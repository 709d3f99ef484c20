// Validation and test loss (see evaluator.h).
#include "train/evaluator.h"

#include "loom/pipeline/schedule.h"

namespace loom {

Evaluator::Evaluator(TrainingRun& run) : run_(run) {}

double Evaluator::evaluate(const std::shared_ptr<const SampleDataset>& ds, bool test_set, int64_t& consumed_samples) {
  const TrainConfig& cfg = run_.cfg;
  LoaderConfig lc = run_.loader_config(consumed_samples);
  lc.prefetch_depth = 0;
  lc.role = test_set ? "test" : "validation";
  Loader loader(ds, lc);
  // FP8: the weights changed since the last step's quantisation, and evaluation amaxes must not steer
  // the training scales.
  const std::vector<GPTModel*> chunks = run_.models();
  for (GPTModel* m : chunks) m->fp8_begin_step();
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
    total += run_pipeline_step(chunks, run_.ps->pp(), pc, cb).loss_sum;
    consumed_samples += run_.gbs;
  }
  for (GPTModel* m : chunks) m->fp8_discard_amaxes();
  const bool last = run_.ps->is_pipeline_last_stage();
  double loss = last ? total / double(cfg.eval.eval_iters * run_.nmb) : 0.0;
  loss = run_.ps->dp().all_reduce_scalar(loss) / double(run_.ps->dp_size());
  return run_.ps->pp().all_reduce_scalar(last ? loss : 0.0);
}

}  // namespace loom
