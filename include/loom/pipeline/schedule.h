// Pipeline-parallel schedules (Megatron's forward_backward_func): run every micro-batch of one step
// forward and backward over this rank's model chunks, exchanging activations and their gradients with
// the neighbouring stages over the pipeline group.
//   PP = 1            no pipelining: forward, backward per micro-batch (gradient accumulation)
//   PP > 1, 1 chunk   1F1B: warm-up (PP − stage − 1 forwards), steady state (one forward, one backward),
//                     cool-down (the remaining backwards); at most PP micro-batches in flight on stage 0
//   PP > 1, V chunks  interleaved 1F1B (--num-layers-per-virtual-pipeline-stage): chunk v of stage s holds
//                     model chunk v·PP + s; needs num_microbatches % PP == 0 (as Megatron); activations
//                     leave chunk v of the last stage for chunk v + 1 of stage 0 (a ring over the group)
// Activations travel as (B, T_local, C) tensors in the compute dtype (GPTModel::input()/output()); each
// in-flight micro-batch uses its own activation slot of the chunk (slot = micro-batch % slots).
//
// Communication: a rank posts send_async of a result as soon as its compute finished and receives
// (blocking) right before the compute that needs the message; a slot's output buffer is only rewritten
// after its previous send completed. Every stage runs the same global order of (chunk, micro-batch), so
// between any two ranks messages are received in the order they were sent (the schedule checks this),
// and the schedules' dependency order has no cycle: no rank waits forever.
//
// The schedules are written against PipelineStage (one model chunk as the schedule sees it);
// run_pipeline_step adapts GPTModel chunks, tests drive fake stages through run_pipeline_schedule.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/model/gpt.h"

namespace loom {

struct PipelineStepConfig {
  int64_t num_microbatches = 1;
  // Gradient of the loss each micro-batch's forward prepares (GPTModel::forward's dloss_scale), e.g.
  // loss_scale / (num_microbatches · unmasked tokens). Empty: 1. Ignored when forward_only.
  std::function<float(int64_t m)> dloss_scale;
  bool forward_only = false;        // evaluation: no backward, no dropout (ForwardOptions::training false)
  uint64_t dropout_seed = 0;        // ForwardOptions::dropout_seed
  float moe_aux_loss_scale = std::numeric_limits<float>::quiet_NaN();  // ForwardOptions::moe_aux_loss_scale
  uint64_t first_microbatch_index = 0;  // micro-batch m uses ForwardOptions::micro_batch_index = this + m
};

struct PipelineCallbacks {
  // The m-th micro-batch of this step (every stage gets it: the first stage reads tokens, the last
  // targets and mask; all use positions and segments). Called once per m; the views must stay valid
  // until run_pipeline_step returns (backward reads the batch forward saw).
  std::function<GPTBatch(int64_t m)> batch;
  // Called before the backward of micro-batch m on chunk c (optional): data-parallel code learns whether
  // this is the chunk's last micro-batch (then gradients are final and their reduction may start).
  std::function<void(int chunk, int64_t m, bool last)> before_backward;
  // Called on the last stage right after the forward of micro-batch m on its last chunk (optional), while
  // that chunk's per-token losses (GPTModel::losses()) are m's: evaluation reads per-sequence losses here.
  std::function<void(int64_t m)> after_loss;
  // Optional timers hooks: phase names "forward-compute", "backward-compute", "forward-recv",
  // "forward-send", "backward-recv", "backward-send" (send: posting it, and waiting for an earlier send
  // of the same buffer to complete).
  std::function<void(const char* phase, bool start)> timer;
};

struct PipelineStepResult {
  double loss_sum = 0;      // sum over micro-batches of their mean losses (last stage; 0 elsewhere)
  int64_t microbatches = 0; // number of losses summed (last stage; 0 elsewhere)
};

// chunks: this rank's model chunks in virtual-stage order (one unless interleaved). pp: the pipeline
// group (size 1 for no pipelining). Collective over the pipeline group. Each chunk needs
// options().activation_slots >= pipeline_activation_slots(pp.size(), chunks.size(), num_microbatches).
PipelineStepResult run_pipeline_step(const std::vector<GPTModel*>& chunks, const Communicator& pp,
                                     const PipelineStepConfig& cfg, const PipelineCallbacks& cb);

// Slots a chunk needs for the schedule (GPTModel's ModelOptions::activation_slots): the most micro-batches
// any chunk of any stage holds between their forward and backward. 1 for PP = 1; min(PP, nmb) for 1F1B.
int pipeline_activation_slots(int pp_size, int num_chunks, int64_t num_microbatches);

// ---- the schedule core ------------------------------------------------------------------------------

// One compute step of a rank's schedule.
struct PipelineOp {
  bool backward = false;
  int chunk = 0;           // this rank's chunk (virtual stage index)
  int64_t microbatch = 0;
  bool operator==(const PipelineOp&) const = default;
};

// The order in which rank `pp_rank` runs forwards and backwards (Megatron's schedules; see the top).
// UserError when num_chunks > 1 with pp_size 1 or with num_microbatches % pp_size != 0.
std::vector<PipelineOp> pipeline_schedule_order(int pp_size, int pp_rank, int num_chunks, int64_t num_microbatches,
                                                bool forward_only);

// One model chunk as the schedules drive it. Buffers are those of the current slot; the views of a slot
// must stay the same between set_slot calls (the schedule sends and receives into them).
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  virtual int slots() const = 0;        // activation slots the chunk has
  virtual void set_slot(int slot) = 0;
  virtual TensorView input() = 0;       // received before forward (not on the first stage's first chunk)
  virtual TensorView output() = 0;      // sent after forward (not on the last stage's last chunk)
  virtual TensorView output_grad() = 0; // received before backward (not on the last chunk of the last stage)
  virtual TensorView input_grad() = 0;  // sent after backward (not on the first chunk of the first stage)
  // Forward of micro-batch m in the current slot; returns its mean loss on the last chunk of the last
  // stage (0 elsewhere).
  virtual double forward(int64_t m) = 0;
  virtual void backward(int64_t m) = 0;
};

// Runs one step's schedule over this rank's chunks (before_backward and timer of cb are used; batch is
// the stages' business).
PipelineStepResult run_pipeline_schedule(const std::vector<PipelineStage*>& chunks, const Communicator& pp,
                                         int64_t num_microbatches, bool forward_only, const PipelineCallbacks& cb);

// ---- layers per stage -------------------------------------------------------------------------------

struct StageLayers {
  int64_t first_layer = 0;
  int64_t num_layers = 0;
};

// The decoder layers of every (stage, chunk): result[stage][chunk]. num_chunks > 1: virtual stages
// (--num-layers-per-virtual-pipeline-stage), chunk v of stage s holds model chunk v·PP + s of
// num_layers / (PP · num_chunks) layers. first_stage_layers / last_stage_layers (0: unset) are Megatron's
// --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: those stages get that many and
// the other stages share the rest evenly. UserError naming the flags when the layers do not divide.
std::vector<std::vector<StageLayers>> pipeline_layer_split(int64_t num_layers, int pp_size, int num_chunks,
                                                           int64_t first_stage_layers, int64_t last_stage_layers);

}  // namespace loom
