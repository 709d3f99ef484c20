// `loom calc`: model size, FLOPs per iteration, memory per rank and training time of a GPT run, from the
// same configuration `loom train` reads plus a few calculator options. The arithmetic follows
// Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM" (parameters, FLOPs, training time) and Korthikanti et al. (2022), "Reducing Activation
// Recomputation in Large Transformer Models" (activation memory). docs/calc.md states every formula and
// simplification.
//
// With LoRA (--lora-rank, --lora-target-modules ...) the base is frozen (its compute copy only, whole on every
// rank, no gradients or optimizer state) and the adapters are the trainable set: the model-state figures
// are the frozen base's bytes plus the adapters' usual master/copy/grads/optimizer bytes (ZeRO-sharded as
// for full training), and the FLOPs are the hardware FLOPs of the work a LoRA step executes, not Megatron's
// 3 x forward model FLOPs (docs/calc.md, "LoRA fine-tuning").
//
// Mixture of experts (--num-experts): parameters are counted exactly (total and active: top-k routed experts
// per token), FLOPs count the top-k experts and the shared experts (Megatron's convention; the time
// estimates use the active parameters), and memory per rank splits the routed experts over EP and ETP (each
// rank E/EP experts, each expert's FFN / ETP) while the rest follows TP/PP; ZeRO shards the experts'
// states over the expert-data-parallel group (n / (ETP x EP x PP) ranks), the rest over DP x CP. A MoE
// layer's activations replace the dense MLP's by its routed rows (tokens x top-k, balanced routing assumed),
// the router's maps and the shared experts' buffers (docs/calc.md, "Mixture of experts").
//
// Three steps, so that tests check numbers directly and the CLI stays thin:
//   make_calc_input(TrainConfig, CalcOptions) -> CalcInput   validation, vocabulary (may read tokenizer files)
//   compute_calc(CalcInput) -> CalcReport                    pure arithmetic
//   format_calc_report(CalcReport) -> text                   stable labels, one figure per line
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/model/gpt.h"
#include "loom/optim/distributed_optimizer.h"
#include "loom/train/config.h"

namespace loom {

// Dense (no 2:4 sparsity) tensor-core peaks per GPU in TFLOP/s, from NVIDIA's datasheets (docs/calc.md).
struct GpuSpec {
  std::string name;         // the --gpu value: "A100", "H100", "H200", "B200"
  std::string description;  // "H100 SXM"
  double tf32_tflops = 0;   // peak used for FP32 runs (tensor-core TF32 matmuls)
  double bf16_tflops = 0;   // BF16 and FP16
  std::optional<double> fp8_tflops;  // none on A100
};
const std::vector<GpuSpec>& gpu_specs();
// Case-insensitive lookup; UserError naming --gpu and the valid names.
const GpuSpec& find_gpu(const std::string& name);

// `loom calc`'s own options (the flags `loom train` does not have).
struct CalcOptions {
  std::optional<int64_t> num_gpus;      // --num-gpus (default TP x PP x CP: data-parallel size 1)
  std::optional<double> train_tokens;   // --train-tokens (default --train-iters x global batch x sequence)
  std::optional<std::string> gpu;       // --gpu A100|H100|H200|B200 (default H100)
  std::optional<double> mfu;            // --mfu: achieved fraction of the GPU's dense peak (default 0.4)
  std::optional<double> gpu_tflops;     // --gpu-tflops: achieved TFLOP/s per GPU (replaces --mfu)
  bool sequence_parallel = false;       // --sequence-parallel: Megatron's SP, for the activation estimate
};


// Everything compute_calc() needs, already validated and resolved.
struct CalcInput {
  GPTConfig model;  // vocab_size and padded_vocab_size (padded for the TP size) filled in
  int64_t seq_length = 0;         // s
  int64_t micro_batch_size = 1;   // b
  int64_t global_batch_size = 1;  // B (sequences per iteration)
  ParallelConfig parallel;
  bool sequence_parallel = false;
  int64_t num_gpus = 1;           // n = TP x PP x CP x DP
  PrecisionConfig precision;
  RecomputeConfig recompute;      // granularity "" | selective | full (full with method and num_layers)
  std::optional<double> train_tokens;  // T
  GpuSpec gpu;                    // peak table row (the --gpu choice)
  double mfu = 0.4;               // used when gpu_tflops is not set
  std::optional<double> gpu_tflops;  // achieved TFLOP/s per GPU, counting every executed FLOP
  ShardingStrategy sharding = ShardingStrategy::kNone;  // resolved as the trainer resolves it
  int64_t ddp_bucket_size = 0;    // --ddp-bucket-size in elements; 0: max(40,000,000, 1,000,000 * d)
  // Optimizer state per parameter in FP32 bytes: 8 for Adam (m, v), 4 for SGD with momentum, 0 without;
  // its description in the report.
  int optimizer_state_bytes = 8;
  std::string optimizer_state_what = "Adam m and v";
  // LoRA fine-tuning (--lora-rank > 0): rank, alpha, dropout and the targets, resolved as the trainer
  // resolves them (parse_lora_targets; the default targets when --lora-target-modules is not given).
  std::optional<LoraOptions> lora;
  std::vector<std::string> notes;    // assumptions made while resolving (defaults filled in), printed first

  int64_t data_parallel_size() const {
    return num_gpus / (int64_t(parallel.tensor_model_parallel_size) * parallel.pipeline_model_parallel_size *
                       parallel.context_parallel_size);
  }
  // d: the group ZeRO shards over (the trainer's dp_cp group, DP x CP ranks).
  int64_t zero_group_size() const { return data_parallel_size() * parallel.context_parallel_size; }
};

// Bytes per parameter of one kind of model state: `full` bytes every rank of the ZeRO group holds for each
// parameter, plus `sharded` bytes held once per group (each rank has ceil(P/d) of them).
struct StateBytesPerParam {
  int full = 0;
  int sharded = 0;
  // full*P + sharded*ceil(P/d)
  int64_t bytes(int64_t P, int64_t d) const { return full * P + sharded * ((P + d - 1) / d); }
};

// One LoRA adapter of a transformer layer (every layer has the same ones), global shapes: A (rank, in),
// B (out, rank). `layer_out` is the adapted layer's whole output width, which the up GEMM spans (a slice
// adapter's B is spread over the fused layer's rows; see loom/nn/lora.h).
struct LoraAdapterShape {
  LoraTarget target;
  bool column_parallel = true;  // linear_qkv / linear_fc1 and their slices: A whole, B split by TP
  int64_t in = 0, out = 0, layer_out = 0;
  // Parameters on one of t TP ranks: column-parallel A whole + B's out/t rows; row-parallel A's in/t
  // columns + B whole.
  int64_t params_per_rank(int64_t rank, int t) const {
    return column_parallel ? rank * in + out / t * rank : rank * (in / t) + out * rank;
  }
  // Executed matmul FLOPs per token, summed over the t ranks of a TP group. Column-parallel: every rank
  // runs the down GEMM on the whole input (A is replicated), the up GEMM on its rows of the layer.
  // Row-parallel: the down GEMM is split, the up GEMM runs on TP rank 0 in forward (its h·B^T is added
  // once) and on every rank in backward (dh and dB from the replicated output gradient).
  //   forward:  down 2·in·r, up 2·r·layer_out;
  //   backward: h recomputed (down again), dB and dh (2 x up), dA and the input gradient (2 x down).
  double forward_flops_per_token(int64_t rank, int t) const;
  double backward_flops_per_token(int64_t rank, int t) const;
};

// One way of keeping activations, as bytes on one rank of the first pipeline stage.
struct ActivationEstimate {
  std::string label;         // "none", "selective", "full"
  std::string formula;       // per-layer formula, e.g. "s*b*h*(34 + 5*a*s/h)"
  double per_layer = 0;      // one layer, one micro-batch
  double layers_total = 0;   // all layers of the stage, all micro-batches in flight
  double extra = 0;          // embedding dropout mask, and with PP 1 the output layer (paper's section 4.4)
  double total() const { return layers_total + extra; }
};

struct CalcReport {
  CalcInput input;

  // Parameters.
  int64_t params = 0;          // exact, GPTConfig::num_parameters() with the padded vocabulary
  double params_formula = 0;   // 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), V padded, s position embeddings
  int64_t params_first_stage = 0;  // on one TP rank of the first pipeline stage
  int64_t params_last_stage = 0;   // on one TP rank of the last one (== first with PP 1)

  // LoRA (input.lora): the trainable adapters. They sit in the layers only, so every stage holds the same
  // number of them.
  std::vector<LoraAdapterShape> lora_adapters;  // one layer's, in target order
  int64_t lora_params = 0;              // the whole model's (global shapes)
  int64_t lora_layer_params = 0;        // one layer's on one TP rank
  int64_t lora_params_stage = 0;        // on one TP rank of a pipeline stage

  // FLOPs per iteration (global batch B).
  double flops_model = 0;      // 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)): forward + backward
  // Without LoRA the two rows below add to flops_model; with LoRA to flops_lora.
  double flops_selective = 0;  // + attention-core forward again: 4*B*s^2*h*l
  double flops_full = 0;       // 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)): every layer's forward twice
  double flops_run = 0;        // the one this run's recomputation settings execute
  // LoRA: the hardware FLOPs a step executes without recomputation: the base forward, the base backward
  // for input gradients only (frozen weights: no weight-gradient GEMMs; the attention core's backward as
  // usual, 2 x its forward; no embedding backward) and the adapters:
  //   2*(l*linears + logits) + 3*l*attention core + flops_adapters.
  // flops_model stays Megatron's full-training figure, for reference.
  double flops_lora = 0;
  double flops_adapters = 0;   // every adapter's forward and backward (h recomputed), B*s tokens, all ranks
  double flops_adapters_forward_layer = 0;  // one layer's adapters' forward (what full recomputation repeats)
  int64_t recomputed_layers = 0;  // layers run forward twice (full granularity)

  // Memory per rank (first pipeline stage, one TP/CP rank), bytes, under input.sharding over d ranks.
  int64_t zero_group = 1;                   // d (DP x CP)
  StateBytesPerParam weight_per_param;      // FP32 master (or its shard) + 16-bit compute copy (or its shard)
  StateBytesPerParam grad_per_param;        // main grads (FP32 whenever num_gpus > 1)
  StateBytesPerParam optimizer_per_param;   // Adam m and v (FP32)
  // The trained parameters: params_first_stage, or with LoRA the adapters (lora_params_stage).
  int64_t weight_bytes = 0;     // weight_per_param.bytes(trained params, d)
  int64_t grad_bytes = 0;       // grad_per_param.bytes(...)
  int64_t optimizer_bytes = 0;  // optimizer_per_param.bytes(...)
  // LoRA's frozen base: its compute copy only (2 B/param with --bf16/--fp16, 4 in FP32, where the values are
  // the compute copy), whole on every rank of the ZeRO group; 0 without LoRA.
  int frozen_per_param = 0;
  int64_t frozen_bytes = 0;     // frozen_per_param * params_first_stage
  int64_t states_bytes() const { return frozen_bytes + weight_bytes + grad_bytes + optimizer_bytes; }
  // The same for the last pipeline stage (== first with PP 1).
  int64_t last_frozen_bytes = 0, last_weight_bytes = 0, last_grad_bytes = 0, last_optimizer_bytes = 0;
  int64_t last_states_bytes() const {
    return last_frozen_bytes + last_weight_bytes + last_grad_bytes + last_optimizer_bytes;
  }
  // Buffers that live only part of a step, on top of the model states (first stage):
  //   optim_grads:        FP32 gradients of up to 2 buckets (one written by backward, one being
  //                       reduce-scattered): 4*min(P, 2*bucket_size)
  //   optim_grads_params: the gathered parameters (compute dtype) and FP32 gradients of about two layers
  //                       (one in use, one being gathered or reduce-scattered): 2*layer_params*(cb + 4)
  int64_t transient_bytes = 0;
  int64_t bucket_size = 0;   // elements per gradient bucket (optim_grads)
  int64_t layer_params = 0;  // trained parameters of one layer on one TP rank (with LoRA: its adapters)
  int64_t micro_batches = 0;           // per iteration per data-parallel rank
  int64_t micro_batches_in_flight = 0;  // on the first stage under 1F1B: min(PP, micro-batches)
  // Rows none / selective / full (full: the run's method and layers when it is full, else every layer).
  std::vector<ActivationEstimate> activations;
  size_t run_row = 0;  // index of this run's row in `activations`

  // Loom's own buffers for this configuration, as the allocator will count them (single-process runs:
  // TP = PP = CP = 1; absent otherwise): the model's exact plan (GPTModel::memory_plan) plus AdamW's
  // state and the FP32 copy of FP16 gradients the optimizer steps from. A run's "max allocated" is this
  // plus the data loader's few batch buffers.
  struct LoomPlan {
    int64_t parameter_bytes = 0;   // FP32 master weights, compute copy (bf16/fp16), gradient buffer
                                   // (LoRA: the frozen base's compute copy and the adapters' buffers)
    int64_t optimizer_bytes = 0;   // Adam m and v (FP32) of the trained parameters
    int64_t main_grad_bytes = 0;   // FP32 main-grad copy when the gradient buffer is FP16
    int64_t activation_bytes = 0;  // every activation buffer of one micro-batch (B = micro batch size)
    // LoRA: the largest transient scratch one adapter allocates (its dropped input, h, the up GEMM's
    // output, a slice adapter's spread B; in backward dh and the input gradient), see lora_scratch_bytes.
    int64_t adapter_scratch_bytes = 0;
    // MoE: the MoE layers' own buffers, which they allocate per call (sized by the routing; the model's
    // plan leaves them out): Moe::loom_layers x Moe::layer_bytes, balanced routing.
    int64_t moe_bytes = 0;
    int64_t total() const {
      return parameter_bytes + optimizer_bytes + main_grad_bytes + activation_bytes + adapter_scratch_bytes +
             moe_bytes;
    }
  };
  std::optional<LoomPlan> loom_plan;

  // Mixture of experts (model.is_moe()): the figures above include these.
  struct Moe {
    int64_t active_params = 0;   // GPTConfig::num_active_parameters(): each MoE layer's top-k routed experts
    int64_t expert_params = 0;   // every routed expert of every MoE layer (global shapes)
    int ep = 1, etp = 1;         // --expert-model-parallel-size, --expert-tensor-parallel-size (default TP)
    int64_t expert_dp = 1;       // d_e = n / (ETP x EP x PP): the ranks holding the same experts, over which
                                 // their gradients are reduced and ZeRO shards their states
    int64_t layers_first_stage = 0, layers_last_stage = 0;  // MoE layers on the first / last pipeline stage
    int64_t layer_shared_per_rank = 0;   // one MoE layer's router, shared experts and gate on one TP rank
    int64_t layer_experts_per_rank = 0;  // its E/EP routed experts on one rank (each expert's FFN / ETP)
    int64_t experts_first_stage = 0, experts_last_stage = 0;  // routed-expert params on one rank of the stage
    int64_t tokens = 0;          // n: tokens one rank routes per micro-batch (s*b/CP, / TP with SP)
    int64_t rows = 0;            // M: expert rows those give (k*n; capacity and padding applied), balanced
    bool rows_move = false;      // EP > 1 or ETP-split experts: the rows are sent to other ranks and back
    double layer_bytes = 0;      // one MoE layer's own buffers per micro-batch (routed rows, router, shared)
    double dense_mlp_bytes = 0;  // what they replace of the paper's layer: its MLP's 16*s*b*h/t (x2 in FP32)
    int64_t loom_layers = 0;     // single process: MoE layers whose buffers live at once (recomputation)
  };
  std::optional<Moe> moe;

  // Throughput and time.
  double peak_tflops = 0;      // the GPU's dense peak for this run's compute dtype
  double achieved_tflops = 0;  // X: per GPU, counting every executed FLOP (recomputation included)
  double seconds_per_iteration = 0;  // flops_run / (n * X)
  double iterations = 0;       // T / (B * s), when train_tokens is set
  double seconds_6tp = 0;      // 6*T*P/(n*X): no recomputation (MoE: P the active parameters)
  double seconds_8tp = 0;      // 8*T*P/(n*X): full recomputation
  // LoRA's counterparts (P the frozen base; adapters and attention dropped): 4*T*P/(n*X) (forward + input
  // gradients) and 6*T*P/(n*X) (full recomputation adds a forward).
  double seconds_lora_4tp = 0, seconds_lora_6tp = 0;
  double seconds_run = 0;      // iterations * flops_run / (n*X)
};

// Validates the fields calc uses (model shape, sequence, batch, parallel sizes, precision, recomputation
// and LoRA flags) and resolves the vocabulary: --tokenizer-type (built with make_tokenizer, which
// may read --vocab-file etc.), else --vocab-size, else GPT-2's 50257 with a note. --train-iters and the
// data flags are not required. Resolves the data-parallel sharding as the trainer does
// (--data-parallel-sharding-strategy wins; --use-distributed-optimizer alone is optim; the two together
// with no_shard are refused). Throws UserError naming the flag.
CalcInput make_calc_input(const TrainConfig& cfg, const CalcOptions& opts);

CalcReport compute_calc(const CalcInput& in);
std::string format_calc_report(const CalcReport& r);

// A token count: "300e9", "300000000000", "300B", "1.5T", "50M", "20k" (k/K, M, B/G, T suffixes).
// UserError naming `flag` for anything else or a value < 1.
double parse_token_count(const std::string& flag, const std::string& v);

}  // namespace loom
