// Refuses, before any data or model is built, a run whose model cannot fit the device (training_run.h).
//
// Two estimates, cheapest first. A lower bound in double precision (every layer's Q and output projections
// and one 16-bit activation of the residual stream per layer, nothing else) catches absurd shapes
// (--num-layers 4294967298, --hidden-size 10^9) without any per-layer work or int64 overflow. Then `loom
// calc`'s memory plan for this exact layout (Loom's own buffer plan on one process; the Megatron-paper
// estimate of states + transient buffers + activations otherwise) gives the figure quoted in the error.
// Configurations calc does not model are left to the allocator's out-of-memory message.
#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <string>

#include "loom/core/check.h"
#include "loom/train/calc.h"
#include "train/training_run.h"

namespace loom {

namespace {

// Processes of this job sharing the node (and so its host memory).
int64_t local_processes() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"})
    if (const char* v = std::getenv(var); v && *v) {
      const long n = std::strtol(v, nullptr, 10);  // SLURM may write "4(x2)": the leading count
      if (n >= 1) return n;
    }
  return 1;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(int64_t(1) << 30));
  return buf;
}

}  // namespace

void check_model_fits(const TrainingRun& run) {
  const TrainConfig& cfg = run.cfg;
  const bool cpu = run.ctx->device().is_cpu();
  const int64_t sharing = cpu ? local_processes() : 1;
  const double capacity = double(run.ctx->memory_capacity()) / double(sharing);
  const std::string device = cpu ? std::string("this machine's memory") : run.ctx->device().str() + "'s memory";
  const std::string where = sharing > 1 ? device + ", " + gib(double(run.ctx->memory_capacity())) + " shared by " +
                                              std::to_string(sharing) + " processes"
                                        : device;
  const std::string advice =
      "; check with `loom calc` and the same flags, and use fewer or smaller layers, more parallelism "
      "(--tensor-model-parallel-size, --pipeline-model-parallel-size, --use-distributed-optimizer), "
      "--recompute-granularity, or a smaller --micro-batch-size";

  const GPTConfig& m = cfg.model;
  const double model_split = double(cfg.parallel.tensor_model_parallel_size) * cfg.parallel.pipeline_model_parallel_size;
  const double h = double(m.hidden_size), L = double(m.num_layers);
  const double vocab = double(cfg.data.vocab_size.value_or(1));
  const double lower = (L * 2.0 * h * h + vocab * h) / model_split * 2.0 +
                       L * double(cfg.batch.micro_batch_size) * double(cfg.batch.seq_length) * h * 2.0 /
                           (model_split * cfg.parallel.context_parallel_size);
  if (lower > capacity)
    user_error("the model cannot fit: each process needs more than ", gib(lower), " (", m.num_layers, " layers of hidden "
               "size ", m.hidden_size, ", counting only part of their weights and activations) but has ", gib(capacity),
               " (", where, ")", advice);

  CalcOptions opts;
  opts.num_gpus = run.ps->world_size();
  opts.sequence_parallel = cfg.dist.sequence_parallel;
  CalcReport r;
  try {
    r = compute_calc(make_calc_input(cfg, opts));
  } catch (const UserError&) {
    return;  // a layout calc does not model: the allocator reports an out-of-memory with its figures
  }
  double need = 0;
  std::string parts;
  if (r.loom_plan) {
    const CalcReport::LoomPlan& p = *r.loom_plan;
    need = double(p.total());
    parts = "parameters and gradients " + gib(double(p.parameter_bytes)) + ", optimizer state " +
            gib(double(p.optimizer_bytes + p.main_grad_bytes)) + ", activations " +
            gib(double(p.activation_bytes + p.adapter_scratch_bytes + p.moe_bytes));
  } else {
    const double states = double(std::max(r.states_bytes(), r.last_states_bytes()));
    const double acts = r.activations.empty() ? 0.0 : r.activations[r.run_row].total();
    need = states + double(r.transient_bytes) + acts;
    parts = "model and optimizer states " + gib(states) + ", transient buffers " + gib(double(r.transient_bytes)) +
            ", activations " + gib(acts);
  }
  if (need > capacity)
    user_error("the model cannot fit: each process needs about ", gib(need), " (", parts, ") but has ", gib(capacity),
               " (", where, ")", advice);
}

}  // namespace loom
