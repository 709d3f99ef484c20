// run_pipeline_step: GPTModel chunks as PipelineStages for the schedules of schedule.cpp. Kept in its own
// file so that code driving run_pipeline_schedule with other stages (the unit tests) does not link the
// model's stage API.
#include <optional>

#include "loom/pipeline/schedule.h"

namespace loom {

namespace {

// A GPTModel chunk as a PipelineStage; batches are fetched once per micro-batch and shared by chunks.
class GptStage final : public PipelineStage {
 public:
  GptStage(GPTModel& model, const PipelineStepConfig& cfg, std::vector<std::optional<GPTBatch>>& batches,
           const PipelineCallbacks& cb)
      : model_(model), cfg_(cfg), batches_(batches), cb_(cb) {}
  int slots() const override { return model_.options().activation_slots; }
  void set_slot(int slot) override { model_.set_slot(slot); }
  TensorView input() override { return model_.input(); }
  TensorView output() override { return model_.output(); }
  TensorView output_grad() override { return model_.output_grad(); }
  TensorView input_grad() override { return model_.input_grad(); }
  double forward(int64_t m) override {
    ForwardOptions fo;
    fo.training = !cfg_.forward_only;
    fo.dropout_seed = cfg_.dropout_seed;
    fo.micro_batch_index = cfg_.first_microbatch_index + uint64_t(m);
    fo.moe_aux_loss_scale = cfg_.moe_aux_loss_scale;
    const float scale = cfg_.forward_only ? 0.0f : cfg_.dloss_scale ? cfg_.dloss_scale(m) : 1.0f;
    return model_.forward(batch(m), scale, fo);
  }
  void backward(int64_t m) override { model_.backward(batch(m)); }

 private:
  const GPTBatch& batch(int64_t m) {
    std::optional<GPTBatch>& b = batches_[size_t(m)];
    if (!b) b = cb_.batch(m);
    return *b;
  }
  GPTModel& model_;
  const PipelineStepConfig& cfg_;
  std::vector<std::optional<GPTBatch>>& batches_;
  const PipelineCallbacks& cb_;
};

}  // namespace

PipelineStepResult run_pipeline_step(const std::vector<GPTModel*>& chunks, const Communicator& pp,
                                     const PipelineStepConfig& cfg, const PipelineCallbacks& cb) {
  LOOM_CHECK(cb.batch, "[pipeline] PipelineCallbacks::batch is required");
  const int64_t nmb = cfg.num_microbatches;
  LOOM_CHECK(nmb >= 1, "[pipeline] num_microbatches ", nmb, " must be >= 1");
  std::vector<std::optional<GPTBatch>> batches(static_cast<size_t>(nmb));
  std::vector<std::unique_ptr<GptStage>> stages;
  std::vector<PipelineStage*> ptrs;
  const bool pipelined = pp.size() > 1 || chunks.size() > 1;
  for (GPTModel* model : chunks) {
    LOOM_CHECK(model != nullptr, "[pipeline] null model chunk");
    if (pipelined) {  // input()/output() exist only once the micro-batch shape is fixed
      if (!batches[0]) batches[0] = cb.batch(0);
      const TensorView tokens = batches[0]->tokens;
      LOOM_CHECK(tokens.ndim() == 2, "[pipeline] tokens must be (B, T), got ", tokens.desc());
      model->prepare(tokens.size(0), tokens.size(1));
    }
    stages.push_back(std::make_unique<GptStage>(*model, cfg, batches, cb));
    ptrs.push_back(stages.back().get());
  }
  return run_pipeline_schedule(ptrs, pp, nmb, cfg.forward_only, cb);
}

}  // namespace loom
