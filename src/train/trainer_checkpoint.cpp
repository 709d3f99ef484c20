// Trainer checkpoints: --save/--load/--save-interval/--no-save-optim/--no-save-rng/--no-load-optim/
// --no-load-rng/--finetune in Megatron's directory layout (ckpt/checkpoint.h), with no pickles:
//   iter_0000100/metadata.json        format, Loom version, iteration, consumed samples/tokens, the model
//                                      config, precision, scheduler, loss-scaler and RNG state
//   iter_0000100/model.safetensors     FP32 master weights under Megatron's parameter names
//   iter_0000100/optimizer.safetensors Adam exp_avg / exp_avg_sq per parameter ("<name>.exp_avg", ...)
// Resume is bit-exact: the master weights, Adam moments and step, the scheduler's sample count, the
// loss scaler, the data position (consumed samples: the loader is a pure function of it) and the dropout
// RNG (Philox keyed by seed and micro-batch counter) are all restored, and the compute copy of the
// weights is re-derived from the masters by the same rounding.
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/ckpt/checkpoint.h"
#include "loom/train/model_io.h"
#include "train/checkpoint_format.h"
#include "train/trainer_impl.h"

namespace loom {

namespace {

using nlohmann::json;
constexpr const char* kFormat = kCheckpointFormat;
constexpr int kFormatVersion = kCheckpointFormatVersion;


// The checkpoint must hold the same architecture; the first difference names the flag that sets it.
// Checkpoints written before a field existed lack it and were GPT-2 models: a missing architecture field
// reads as the GPT-2 default. The RoPE frequencies and the attention window change no shapes and may be
// changed on purpose when fine-tuning (e.g. a larger --rotary-base for a longer context), so --finetune
// does not check them.
void check_model_config(const json& saved, const GPTConfig& m, const std::string& file, bool finetune) {
  struct Field {
    const char* key;
    const char* flag;
    bool required;  // in every Loom checkpoint (older ones included)
    bool shapes;    // checked with --finetune too
  };
  const Field fields[] = {
      {"num_layers", "--num-layers", true, true},
      {"hidden_size", "--hidden-size", true, true},
      {"num_attention_heads", "--num-attention-heads", true, true},
      {"max_position_embeddings", "--max-position-embeddings", true, true},
      {"padded_vocab_size", "the padded vocabulary size (tokenizer / --vocab-size / --make-vocab-size-divisible-by)",
       true, true},
      {"ffn_hidden_size", "--ffn-hidden-size", true, true},
      {"normalization", "--normalization", false, true},
      {"activation", "--swiglu (the MLP activation)", false, true},
      {"kv_channels", "--kv-channels", false, true},
      {"num_query_groups", "--group-query-attention --num-query-groups (key/value heads)", false, true},
      {"add_bias_linear", "--disable-bias-linear", false, true},
      {"add_qkv_bias", "--add-qkv-bias", false, true},
      {"untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", false, true},
      {"position_embedding_type", "--position-embedding-type", false, true},
      {"qk_layernorm", "--qk-layernorm", false, true},
      {"rotary_base", "--rotary-base", false, false},
      {"rotary_percent", "--rotary-percent", false, true},
      {"rotary_interleaved", "--rotary-interleaved", false, false},
      {"use_rope_scaling", "--use-rope-scaling", false, false},
      {"rope_scaling_factor", "--rope-scaling-factor", false, false},
      {"window_size", "--window-size", false, false},
  };
  GPTConfig gpt2 = m;  // the architecture fields at their defaults, shapes from this run
  const GPTConfig defaults;
  gpt2.normalization = defaults.normalization;
  gpt2.activation = defaults.activation;
  gpt2.kv_channels = defaults.kv_channels;
  gpt2.group_query_attention = defaults.group_query_attention;
  gpt2.add_bias_linear = defaults.add_bias_linear;
  gpt2.add_qkv_bias = defaults.add_qkv_bias;
  gpt2.untie_embeddings_and_output_weights = defaults.untie_embeddings_and_output_weights;
  gpt2.position_embedding_type = defaults.position_embedding_type;
  gpt2.rotary_base = defaults.rotary_base;
  gpt2.rotary_percent = defaults.rotary_percent;
  gpt2.rotary_interleaved = defaults.rotary_interleaved;
  gpt2.use_rope_scaling = defaults.use_rope_scaling;
  gpt2.rope_scaling_factor = defaults.rope_scaling_factor;
  gpt2.window_size_left = defaults.window_size_left;
  gpt2.qk_layernorm = defaults.qk_layernorm;
  const json now = model_config_json(m), old = model_config_json(gpt2);
  for (const Field& f : fields) {
    if (finetune && !f.shapes) continue;
    if (!saved.contains(f.key) && f.required) user_error(file, ": model_config has no ", f.key);
    const json& was = saved.contains(f.key) ? saved[f.key] : old[f.key];
    if (was != now[f.key])
      user_error("checkpoint ", file, " was saved with ", f.key, " = ", was.dump(), " but this run has ", f.flag,
                 " = ", now[f.key].dump(), "; the architecture must match to load it");
  }
}

template <typename T>
T get_field(const json& j, const char* key, const std::string& file) {
  if (!j.contains(key)) user_error("checkpoint metadata ", file, " has no \"", key, "\"");
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    user_error("checkpoint metadata ", file, ": \"", key, "\" has the wrong type: ", j.at(key).dump());
  }
}

NamedTensors model_tensors(ParameterSet& ps) {
  NamedTensors out;
  for (const Parameter& p : ps.all()) out.emplace_back(p.name, p.value);
  return out;
}

NamedTensors optimizer_tensors(ParameterSet& ps, AdamW& adam) {
  NamedTensors out;
  for (const Parameter& p : ps.all()) {
    out.emplace_back(p.name + ".exp_avg", adam.exp_avg_mut().slice_flat(p.offset, p.shape));
    out.emplace_back(p.name + ".exp_avg_sq", adam.exp_avg_sq_mut().slice_flat(p.offset, p.shape));
  }
  return out;
}

// Checkpoint files are written from and read into host memory: device-resident tensors go through host
// copies (holder keeps them alive). Host tensors are used in place.
NamedTensors host_views(const DeviceContext& ctx, const NamedTensors& tensors, std::vector<Tensor>& holder,
                        bool fill) {
  NamedTensors out;
  holder.clear();
  holder.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (t.device().is_cpu()) {
      out.emplace_back(name, t);
      continue;
    }
    holder.push_back(Tensor::empty(t.shape(), t.dtype()));
    if (fill) ctx.copy(holder.back(), t);
    out.emplace_back(name, holder.back());
  }
  return out;
}

void save_tensors(const DeviceContext& ctx, const std::string& staging, const std::string& file,
                  const NamedTensors& tensors) {
  std::vector<Tensor> holder;
  write_checkpoint_tensors(staging, file, host_views(ctx, tensors, holder, /*fill=*/true), {{"format", "pt"}});
}

void load_tensors(const DeviceContext& ctx, const SafetensorsFile& f, const NamedTensors& into) {
  std::vector<Tensor> holder;
  const NamedTensors host = host_views(ctx, into, holder, /*fill=*/false);
  load_tensors_checked(f, host);
  for (size_t i = 0; i < into.size(); ++i)
    if (!into[i].second.device().is_cpu()) ctx.copy(into[i].second, host[i].second);
}

}  // namespace

std::string Trainer::metadata_json() const {
  json j;
  j["format"] = kFormat;
  j["format_version"] = kFormatVersion;
  j["loom_version"] = kLoomVersion;
  j["iteration"] = iteration_;
  j["consumed_train_samples"] = consumed_train_;
  j["consumed_valid_samples"] = consumed_valid_;
  j["consumed_tokens"] = consumed_train_ * T_;
  j["global_batch_size"] = gbs_;
  j["seq_length"] = T_;
  j["model_config"] = model_config_json(cfg_.model);
  j["precision"] = cfg_.precision.bf16 ? "bf16" : cfg_.precision.fp16 ? "fp16" : "fp32";
  if (!distributed_) j["files"] = {{"model", "model.safetensors"}};
  if (!cfg_.checkpoint.no_save_optim) {
    if (!distributed_) j["files"]["optimizer"] = "optimizer.safetensors";
    j["optimizer"] = {{"type", "adamw"}, {"step", distributed_ ? dopt_->num_steps() : adamw_->num_steps()}};
    j["opt_param_scheduler"] = json::parse(sched_->state().to_json());
    if (scaler_) j["grad_scaler"] = json::parse(scaler_->state().to_json());
  }
  if (!cfg_.checkpoint.no_save_rng)
    j["rng"] = {{"generator", "philox4x32-10"}, {"dropout_seed", dropout_seed_}, {"micro_batches", micro_batches_done_}};
  if (const std::optional<Fp8Recipe> r = cfg_.precision.fp8_recipe()) {
    j["fp8"] = {{"format", fp8_format_name(r->format)}, {"amax_history_len", r->amax_history_len}};
    if (!distributed_) j["files"]["fp8"] = "fp8_state.safetensors";
  }
  return j.dump(2) + "\n";
}

void Trainer::save_checkpoint() {
  if (cfg_.checkpoint.save.empty()) {
    log_ << " > no --save directory: not saving a checkpoint at iteration " << iteration_ << "\n";
    return;
  }
  check_device_inputs();  // never write weights that a bad batch has made NaN
  if (distributed_) {
    save_checkpoint_sharded();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string& root = cfg_.checkpoint.save;
  log_ << "saving checkpoint at iteration " << std::setw(7) << iteration_ << " to " << root << "\n" << std::flush;
  ParameterSet& ps = model_->params();
  const std::string staging = begin_checkpoint(root, iteration_);
  save_tensors(*ctx_, staging, "model.safetensors", model_tensors(ps));
  if (!cfg_.checkpoint.no_save_optim)
    save_tensors(*ctx_, staging, "optimizer.safetensors", optimizer_tensors(ps, *adamw_));
  if (model_->fp8()) {
    std::vector<Tensor> holder;
    write_checkpoint_tensors(staging, "fp8_state.safetensors", fp8_state_tensors(holder), {{"format", "pt"}});
  }
  write_checkpoint_text(staging, "metadata.json", metadata_json());
  commit_checkpoint(root, iteration_);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  log_ << "  successfully saved checkpoint from iteration " << std::setw(7) << iteration_ << " to " << root
       << " [ t " << std::fixed << std::setprecision(1) << ms << " ms ]\n"
       << std::defaultfloat << std::flush;
}

void Trainer::load_checkpoint() {
  if (cfg_.checkpoint.load.empty()) return;
  if (is_hf_model_dir(cfg_.checkpoint.load)) {  // a Hugging Face model directory: weights only
    const std::string& dir = cfg_.checkpoint.load;
    if (!cfg_.checkpoint.finetune)
      user_error("--load ", dir, " is a Hugging Face model directory (config.json), which holds weights only; add "
                 "--finetune to start from them at iteration 0");
    if (distributed_)
      user_error("--load ", dir, ": Hugging Face weights load into a single process; run `loom train --finetune` "
                 "with one process and --save, then launch the distributed run with --load on that checkpoint");
    log_ << " loading Hugging Face model from " << dir << "\n";
    const GPTConfig hf = read_model_config(dir, cfg_.data.make_vocab_size_divisible_by * ps_->tp_size());
    check_model_config(model_config_json(hf), cfg_.model, dir + "/config.json", /*finetune=*/true);
    HfImportOptions opts;
    opts.rotary_interleaved = cfg_.model.rotary_interleaved;
    opts.log = &log_;
    opts.ctx = ctx_.get();
    load_model_weights(dir, model_->params(), opts);
    model_->sync_compute();
    log_ << " > --finetune: loaded the weights only; starting at iteration 0\n"
         << "  successfully loaded Hugging Face model from " << dir << " at iteration 0\n";
    return;
  }
  const std::optional<LatestCheckpoint> latest = read_latest_checkpoint(cfg_.checkpoint.load);
  if (!latest) {
    log_ << " > WARNING: could not find the metadata file " << checkpoint_tracker_path(cfg_.checkpoint.load)
         << "\n    will not load any checkpoints and will start from random\n";
    return;
  }
  const std::string dir = latest->dir;
  log_ << " loading checkpoint from " << cfg_.checkpoint.load << " at iteration " << latest->iteration << "\n";
  const std::string meta_path = dir + "/metadata.json";
  const json meta = read_json_file(meta_path, "checkpoint metadata");
  if (get_field<std::string>(meta, "format", meta_path) != kFormat)
    user_error(meta_path, " is not a Loom checkpoint (format ", meta["format"].dump(), ")");
  const int version = get_field<int>(meta, "format_version", meta_path);
  if (version > kFormatVersion)
    user_error(meta_path, " has format_version ", version, "; this Loom reads up to ", kFormatVersion);
  check_model_config(get_field<json>(meta, "model_config", meta_path), cfg_.model, meta_path, cfg_.checkpoint.finetune);
  // Distributed checkpoints (one shard file per rank, any layout) load through the resharding reader,
  // into any layout (a single process included); a distributed run cannot read the single-file format
  // (convert it with a single-process run first).
  const bool sharded = meta.contains("sharded_checkpoint");
  if (distributed_ && !sharded)
    user_error("checkpoint ", dir, " was saved by a single process (model.safetensors); a distributed run loads "
               "sharded checkpoints only: resume it once with one process and --save, or use --finetune after "
               "`loom convert` to Hugging Face");
  if (models().front()->fp8() != meta.contains("fp8"))
    log_ << " > note: checkpoint " << dir << (meta.contains("fp8") ? " holds FP8 scaling state, which this run (no "
            "--fp8-format) does not use" : " has no FP8 scaling state: the FP8 scales start at 1") << "\n";
  if (meta.contains("fp8") && models().front()->fp8()) {
    const int64_t saved = get_field<int64_t>(meta["fp8"], "amax_history_len", meta_path);
    if (saved != cfg_.precision.fp8_recipe()->amax_history_len)
      user_error("checkpoint ", dir, " keeps ", saved, " steps of FP8 amax history; this run has "
                 "--fp8-amax-history-len ", cfg_.precision.fp8_recipe()->amax_history_len, ": use the same length");
  }
  const bool load_optim = !cfg_.checkpoint.finetune && !cfg_.checkpoint.no_load_optim;
  if (load_optim && !meta.contains("optimizer"))
    user_error("checkpoint ", dir, " holds no optimizer state (saved with --no-save-optim); pass --no-load-optim "
               "to resume with a fresh optimizer, or --finetune");
  if (sharded) {
    load_checkpoint_sharded(dir);  // weights, and the Adam state when load_optim
  } else {
    ParameterSet& ps = model_->params();
    const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
    load_tensors(*ctx_, f, model_tensors(ps));
    ps.sync_compute(*ctx_);
    if (model_->fp8() && meta.contains("fp8")) {
      std::vector<Tensor> holder;
      const NamedTensors st = fp8_state_tensors(holder);
      load_tensors_checked(SafetensorsFile::open(dir + "/fp8_state.safetensors"), st);
      for (int s = 0; s < model_->fp8_num_sites(); ++s) model_->fp8_set_state(s, holder[size_t(s)]);
    }
  }

  if (cfg_.checkpoint.finetune) {
    log_ << " > --finetune: loaded the weights only; starting at iteration 0\n"
         << "  successfully loaded checkpoint from " << cfg_.checkpoint.load << " at iteration 0\n";
    return;
  }
  iteration_ = get_field<int64_t>(meta, "iteration", meta_path);
  consumed_train_ = get_field<int64_t>(meta, "consumed_train_samples", meta_path);
  consumed_valid_ = get_field<int64_t>(meta, "consumed_valid_samples", meta_path);
  if (load_optim) {
    const int64_t steps = get_field<int64_t>(meta["optimizer"], "step", meta_path);
    if (!sharded) {
      const SafetensorsFile f = SafetensorsFile::open(dir + "/optimizer.safetensors");
      load_tensors(*ctx_, f, optimizer_tensors(model_->params(), *adamw_));
    }
    if (distributed_)
      dopt_->set_num_steps(steps);
    else
      adamw_->set_num_steps(steps);
    for (const std::string& line :
         sched_->load_state(SchedulerState::from_json(get_field<json>(meta, "opt_param_scheduler", meta_path).dump(),
                                                      meta_path)))
      log_ << line << "\n";
    if (scaler_ && meta.contains("grad_scaler"))
      scaler_->load_state(GradScalerState::from_json(meta["grad_scaler"].dump(), meta_path));
    else if (scaler_)
      log_ << " > WARNING: checkpoint " << dir << " has no loss-scaler state (not an FP16 run); the scaler starts "
           << "from --initial-loss-scale\n";
  }
  if (!cfg_.checkpoint.no_load_rng && !meta.contains("rng"))
    user_error("checkpoint ", dir, " holds no RNG state (saved with --no-save-rng); pass --no-load-rng or --finetune");
  if (!cfg_.checkpoint.no_load_rng) {
    dropout_seed_ = get_field<uint64_t>(meta["rng"], "dropout_seed", meta_path);
    micro_batches_done_ = get_field<uint64_t>(meta["rng"], "micro_batches", meta_path);
  }
  log_ << "  successfully loaded checkpoint from " << cfg_.checkpoint.load << " at iteration " << iteration_ << "\n"
       << std::flush;
}

}  // namespace loom
