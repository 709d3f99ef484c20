// Checkpoints of a training run (see checkpoint_manager.h).
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loom/ckpt/checkpoint.h"
#include "loom/train/model_io.h"
#include "train/checkpoint_format.h"
#include "train/checkpoint_manager.h"
#include "train/checkpoint_pieces.h"

namespace loom {

namespace {

using nlohmann::json;
constexpr const char* kFormat = kCheckpointFormat;
constexpr int kFormatVersion = kCheckpointFormatVersion;

// metadata.json "optimizer.type": what the saved state is (Megatron's adam is AdamW).
const char* checkpoint_optimizer_type(OptimizerKind k) { return k == OptimizerKind::kSGD ? "sgd" : "adamw"; }

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
      // Mixture of experts: absent in checkpoints written before Loom saved them (see below).
      {"num_experts", "--num-experts", false, true},
      {"moe_ffn_hidden_size", "--moe-ffn-hidden-size", false, true},
      {"moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", false, true},
      {"moe_shared_expert_gate", "--moe-shared-expert-gate", false, true},
      {"moe_layer_pattern", "--moe-layer-freq (as a 0/1 list per layer)", false, true},
      {"moe_router_topk", "--moe-router-topk", false, false},
      {"moe_router_score_function", "--moe-router-score-function", false, false},
      {"moe_router_pre_softmax", "--moe-router-pre-softmax", false, false},
      {"moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", false, false},
      {"moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", false, false},
      {"moe_router_load_balancing_type", "--moe-router-load-balancing-type", false, false},
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
  gpt2.moe = defaults.moe;
  const json now = model_config_json(m), old = model_config_json(gpt2);
  // A checkpoint without "num_experts" predates the MoE fields: it was written either by a dense run or by a
  // MoE run of the first MoE builds, so its MoE fields are not checked (the parameter names and shapes still
  // are, when its tensors are read).
  const bool has_moe_fields = saved.contains("num_experts");
  // --ffn-hidden-size shapes only dense MLPs: a model with a MoE block in every layer has none.
  const auto all_moe = [](const json& j) {
    if (!j.contains("moe_layer_pattern") || !j["moe_layer_pattern"].is_array()) return false;
    for (const json& v : j["moe_layer_pattern"])
      if (v != 1) return false;
    return true;
  };
  const bool no_dense_mlp = all_moe(saved) && all_moe(now);
  for (const Field& f : fields) {
    if (finetune && !f.shapes) continue;
    const std::string key = f.key;
    if (!has_moe_fields && (key == "num_experts" || key.rfind("moe_", 0) == 0)) continue;
    if (key == "ffn_hidden_size" && no_dense_mlp) continue;
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

// A Loom checkpoint directory opened once: its reader (any layout, either format; every shard's index read)
// and its parsed metadata, checked to be Loom's format before anything else reads it.
struct OpenedCheckpoint {
  ShardedCheckpoint ck;
  json meta;
  std::string meta_path;
};
// A checkpoint without checksums gets one note per directory (a LoRA run may open its base twice).
OpenedCheckpoint open_checkpoint(const std::string& dir, std::ostream& log, std::set<std::string>& noted) {
  OpenedCheckpoint o{ShardedCheckpoint::open(dir), json(), dir + "/metadata.json"};
  if (const std::string note = o.ck.checksum_note(); !note.empty() && noted.insert(dir).second)
    log << " > " << note << "\n";
  try {
    o.meta = json::parse(o.ck.metadata_json());
  } catch (const json::exception& e) {
    user_error("checkpoint metadata ", o.meta_path, " is not valid JSON: ", e.what());
  }
  if (get_field<std::string>(o.meta, "format", o.meta_path) != kFormat)
    user_error(o.meta_path, " is not a Loom checkpoint (format ", o.meta["format"].dump(), ")");
  return o;
}

// The checkpoint --load names: the tracker's, or with --ckpt-step N the directory of iteration N.
std::optional<LatestCheckpoint> checkpoint_to_load(const CheckpointConfig& c) {
  if (!c.ckpt_step) return read_latest_checkpoint(c.load);
  LatestCheckpoint ck;
  ck.iteration = *c.ckpt_step;
  ck.dir = checkpoint_dir(c.load, ck.iteration);
  if (!std::filesystem::is_directory(ck.dir)) {
    std::string have;
    for (int64_t it : list_checkpoint_iterations(c.load)) have += (have.empty() ? "" : ", ") + std::to_string(it);
    user_error("--ckpt-step ", ck.iteration, ": there is no checkpoint directory ", ck.dir, " (",
               have.empty() ? "--load " + c.load + " holds no iter_XXXXXXX directory" : "its iterations: " + have, ")");
  }
  return ck;
}

std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", ms);
  return b;
}

// Checkpoint pieces are written from and read into host memory: a device-resident piece is replaced by a
// host tensor (kept alive by `holder`), filled from the device when `fill` (saving).
std::vector<size_t> stage_on_host(const DeviceContext& ctx, std::vector<TensorPiece>& pieces,
                                  std::vector<Tensor>& holder, std::vector<TensorView>& device, bool fill) {
  std::vector<size_t> staged;
  for (size_t i = 0; i < pieces.size(); ++i) {
    TensorPiece& t = pieces[i];
    if (!t.data.defined() || t.data.device().is_cpu()) continue;
    holder.push_back(Tensor::empty(t.data.shape(), t.data.dtype()));
    if (fill) ctx.copy(holder.back(), t.data);
    device.push_back(t.data);
    t.data = holder.back();
    staged.push_back(i);
  }
  if (fill && !staged.empty()) ctx.synchronize();
  return staged;
}

}  // namespace

CheckpointManager::CheckpointManager(TrainingRun& run, std::ostream& log) : run_(run), log_(log) {}

NamedTensors CheckpointManager::fp8_state_tensors(std::vector<Tensor>& holder) const {
  NamedTensors out;
  holder.clear();
  for (GPTModel* m : run_.models())
    for (int s = 0; s < m->fp8_num_sites(); ++s) holder.push_back(m->fp8_state(s));
  size_t k = 0;
  for (GPTModel* m : run_.models())
    for (int s = 0; s < m->fp8_num_sites(); ++s) out.emplace_back(m->fp8_state_name(s), holder[k++]);
  return out;
}

std::string CheckpointManager::metadata_json() const {
  const TrainConfig& cfg = run_.cfg;
  json j;
  j["format"] = kFormat;
  j["format_version"] = kFormatVersion;
  j["loom_version"] = kLoomVersion;
  j["iteration"] = run_.progress.iteration;
  j["consumed_train_samples"] = run_.progress.consumed_train;
  j["consumed_valid_samples"] = run_.progress.consumed_valid;
  j["consumed_tokens"] = run_.progress.consumed_train * run_.T;
  j["global_batch_size"] = run_.gbs;
  j["seq_length"] = run_.T;
  j["model_config"] = model_config_json(cfg.model);
  j["precision"] = cfg.precision.bf16 ? "bf16" : cfg.precision.fp16 ? "fp16" : "fp32";
  if (!cfg.checkpoint.no_save_optim) {
    j["optimizer"] = {{"type", checkpoint_optimizer_type(run_.dopt->kind())}, {"step", run_.dopt->num_steps()}};
    if (run_.dopt->kind() == OptimizerKind::kSGD) j["optimizer"]["momentum"] = cfg.optim.sgd_momentum;
    j["opt_param_scheduler"] = json::parse(run_.sched->state().to_json());
    if (run_.scaler) j["grad_scaler"] = json::parse(run_.scaler->state().to_json());
  }
  if (!cfg.checkpoint.no_save_rng)
    j["rng"] = {{"generator", "philox4x32-10"}, {"dropout_seed", run_.progress.dropout_seed}, {"micro_batches", run_.progress.micro_batches_done}};
  if (const std::optional<Fp8Recipe> r = cfg.precision.fp8_recipe())
    j["fp8"] = {{"format", fp8_format_name(r->format)}, {"amax_history_len", r->amax_history_len}};
  if (const std::optional<LoraOptions>& lo = run_.chunks.front()->options().lora) {
    json targets = json::array();
    for (LoraTarget t : lo->targets) targets.push_back(lora_target_name(t));
    j["lora"] = {{"rank", lo->config.rank}, {"alpha", lo->config.alpha}, {"dropout", lo->config.dropout},
                 {"target_modules", targets}, {"base", lora_base_}};
  }
  return j.dump(2) + "\n";
}

void CheckpointManager::save() {
  const TrainConfig& cfg = run_.cfg;
  if (cfg.checkpoint.save.empty()) {
    log_ << " > no --save directory: not saving a checkpoint at iteration " << run_.progress.iteration << "\n";
    return;
  }
  run_.check_device_inputs();  // never write weights that a bad batch has made NaN
  const auto t0 = std::chrono::steady_clock::now();
  const std::string& root = cfg.checkpoint.save;
  log_ << "saving checkpoint at iteration " << std::setw(7) << run_.progress.iteration << " to " << root << " ("
       << run_.ps->world_size() << (run_.ps->world_size() == 1 ? " rank)\n" : " ranks)\n") << std::flush;
  // Weights (ZeRO: from the masters each rank owns) and optimizer state, each element by one rank
  // (owners in checkpoint_pieces.h; LoRA: the adapters only).
  std::vector<const ParameterSet*> trainable;
  for (const auto& m : run_.chunks) trainable.push_back(&m->trainable());
  std::vector<TensorPiece> pieces =
      checkpoint_save_pieces(*run_.ps, *run_.dopt, trainable, !cfg.checkpoint.no_save_optim);
  // FP8 scaling state: identical on the TP and DP x CP replicas after the amax reduction; one rank of
  // them saves it, under per-layer names (any layout reads it back).
  std::vector<Tensor> fp8_holder;
  if (run_.ps->tp_rank() == 0 && run_.ps->dp_rank() == 0 && run_.ps->cp_rank() == 0)
    for (const auto& [name, view] : fp8_state_tensors(fp8_holder)) {
      TensorPiece t;
      t.name = name;
      t.global_shape = view.shape();
      t.data = view;
      pieces.push_back(std::move(t));
    }
  // The routers' expert biases (--moe-router-enable-expert-bias): buffers, not parameters, identical on
  // every rank of a pipeline stage after the data-parallel update; saved like the FP8 state.
  std::vector<Tensor> bias_holder;
  if (run_.ps->tp_rank() == 0 && run_.ps->dp_rank() == 0 && run_.ps->cp_rank() == 0)
    for (GPTModel* m : run_.models())
      for (const auto& [name, bias] : m->expert_biases()) {
        bias_holder.push_back(Tensor::empty({int64_t(bias->size())}, DType::kF32));
        std::copy(bias->begin(), bias->end(), static_cast<float*>(bias_holder.back().raw()));
        TensorPiece t;
        t.name = name;
        t.global_shape = bias_holder.back().shape();
        t.data = bias_holder.back();
        pieces.push_back(std::move(t));
      }
  std::vector<Tensor> host;
  std::vector<TensorView> device;
  stage_on_host(*run_.ctx, pieces, host, device, /*fill=*/true);
  save_sharded_checkpoint(root, run_.progress.iteration, pieces, checkpoint_layout_json(*run_.ps, run_.sharding()),
                          metadata_json(), run_.ps->world());
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  log_ << "  successfully saved checkpoint from iteration " << std::setw(7) << run_.progress.iteration << " to " << root
       << " [ t " << fmt_ms(ms) << " ms ]\n" << std::flush;
}

void CheckpointManager::load_pieces(const ShardedCheckpoint& ck, bool load_optim) {
  // Weights: every trained parameter value this rank has (ZeRO-3: none; LoRA: the adapters), and the
  // master shards; by name and global box, so a rank holding some experts only reads those.
  std::vector<const ParameterSet*> trainable;
  for (const auto& m : run_.chunks) trainable.push_back(&m->trainable());
  std::vector<TensorPiece> targets = checkpoint_load_targets(*run_.dopt, trainable, load_optim);
  std::vector<Tensor> host;
  std::vector<TensorView> device;
  const std::vector<size_t> staged = stage_on_host(*run_.ctx, targets, host, device, /*fill=*/false);
  ck.read(targets);
  for (size_t k = 0; k < staged.size(); ++k) run_.ctx->copy(device[k], targets[staged[k]].data);
  for (GPTModel* m : run_.models())
    for (int s = 0; s < m->fp8_num_sites(); ++s)
      if (ck.contains(m->fp8_state_name(s))) m->fp8_set_state(s, ck.read_full(m->fp8_state_name(s), DType::kF32));
  for (GPTModel* m : run_.models())
    for (const auto& [name, bias] : m->expert_biases()) {
      if (!ck.contains(name)) {  // a checkpoint of a run without expert bias: the biases start at zero
        log_ << " > note: checkpoint has no " << name << "; the expert bias starts at zero\n";
        continue;
      }
      const Tensor t = ck.read_full(name, DType::kF32);
      LOOM_CHECK(t.numel() == int64_t(bias->size()), "checkpoint ", name, " has ", t.numel(), " values, the model ",
                 bias->size(), " experts");
      const float* v = static_cast<const float*>(t.raw());
      bias->assign(v, v + t.numel());
    }
  run_.dopt->sync_params_from_masters();
  for (const auto& m : run_.chunks)
    if (m->trainable().storage() == ParamStorage::kFull) m->sync_compute();
}

// The optimizer state in a checkpoint is only meaningful to the same optimizer: Adam's moments are no
// SGD momentum buffer (and a momentum-less SGD run saved none).
void CheckpointManager::check_optimizer_matches(const json& saved, const std::string& meta_path,
                                                const std::string& dir) const {
  const TrainConfig& cfg = run_.cfg;
  const std::string type = saved.contains("type") ? get_field<std::string>(saved, "type", meta_path) : "adamw";
  const std::string ours = checkpoint_optimizer_type(cfg.optim.optimizer);
  if (type != ours)
    user_error("checkpoint ", dir, " holds ", type, " optimizer state; this run trains with --optimizer ",
               optimizer_kind_name(cfg.optim.optimizer), ": use the checkpoint's optimizer, or pass --no-load-optim "
               "to start a fresh one from the saved weights");
  if (type == "sgd") {
    const double saved_momentum = saved.contains("momentum") ? get_field<double>(saved, "momentum", meta_path) : 0.0;
    if ((saved_momentum == 0.0) != (cfg.optim.sgd_momentum == 0.0f))
      user_error("checkpoint ", dir, " was trained with --sgd-momentum ", saved_momentum, " and ",
                 saved_momentum == 0.0 ? "holds no" : "holds a", " momentum buffer; this run has --sgd-momentum ",
                 cfg.optim.sgd_momentum, ": use a momentum that is ", saved_momentum == 0.0 ? "0" : "non-zero",
                 ", or --no-load-optim");
  }
}

void CheckpointManager::check_load_flags(const TrainConfig& cfg) {
  if (cfg.checkpoint.ckpt_step && cfg.checkpoint.load.empty())
    user_error("--ckpt-step ", *cfg.checkpoint.ckpt_step, " needs --load DIR (the directory of the checkpoints)");
  if (cfg.checkpoint.ckpt_step && *cfg.checkpoint.ckpt_step < 0)
    user_error("--ckpt-step must be a non-negative iteration, got ", *cfg.checkpoint.ckpt_step);
  if (cfg.checkpoint.ckpt_step && is_hf_model_dir(cfg.checkpoint.load))
    user_error("--ckpt-step picks an iteration of a Loom checkpoint directory, but --load ", cfg.checkpoint.load,
               " is a Hugging Face model directory");
  if (!cfg.checkpoint.load.empty() && is_hf_model_dir(cfg.checkpoint.load) && !cfg.checkpoint.finetune &&
      !cfg.lora.enabled())
    user_error("--load ", cfg.checkpoint.load, " is a Hugging Face model directory (config.json), which holds "
               "weights only; add --finetune to start from them at iteration 0 (or --lora-rank to adapt it)");
}

void CheckpointManager::check_save_dir(const TrainConfig& cfg) {
  const std::string& dir = cfg.checkpoint.save;
  if (dir.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir))  // another rank may have created it first: only a missing directory counts
    user_error("--save ", dir, ": cannot create the checkpoint directory (",
               ec ? ec.message() : std::string("a file of that name exists"), "); give a writable directory");
  // Every rank writes its own shards, so every rank probes, each with its own file name.
  const fs::path probe = fs::path(dir) / (".loom-write-probe-" + std::to_string(::getpid()) + "-" +
                                          std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  const bool ok = f != nullptr && std::fputc('x', f) != EOF;
  const int err = errno;
  if (f != nullptr && std::fclose(f) != 0 && ok) user_error("--save ", dir, ": cannot write there (", std::strerror(errno), ")");
  fs::remove(probe, ec);
  if (!ok)
    user_error("--save ", dir, ": the checkpoint directory is not writable (", std::strerror(err),
               "); found at start-up, before any training");
}

void CheckpointManager::load_hf_weights(const std::string& dir) {
  const TrainConfig& cfg = run_.cfg;
  if (run_.chunks.size() != 1 || run_.distributed)
    user_error(dir, ": Hugging Face weights load into a single process; convert them first (loom convert --from hf:",
               dir, " --to loom:OUT), then pass OUT, which loads into any parallel layout");
  log_ << " loading Hugging Face model from " << dir << "\n";
  const GPTConfig hf = read_model_config(dir, cfg.data.make_vocab_size_divisible_by * run_.ps->tp_size());
  check_model_config(model_config_json(hf), cfg.model, dir + "/config.json", /*finetune=*/true);
  HfImportOptions opts;
  opts.rotary_interleaved = cfg.model.rotary_interleaved;
  opts.log = &log_;
  opts.ctx = run_.ctx.get();
  GPTModel& model = *run_.chunks.front();
  load_model_weights(dir, model.params(), opts);
  if (model.lora())
    model.sync_compute();
  else
    run_.dopt->sync_params_from_masters();
}

std::string CheckpointManager::load_model_only(const std::string& path, const char* flag) {
  const TrainConfig& cfg = run_.cfg;
  const bool lora = run_.chunks.front()->lora();
  const std::string abs = std::filesystem::absolute(path).lexically_normal().string();
  if (is_hf_model_dir(path)) {
    load_hf_weights(path);
  } else {
    const std::optional<LatestCheckpoint> latest =
        path == cfg.checkpoint.load ? checkpoint_to_load(cfg.checkpoint) : read_latest_checkpoint(path);
    if (!latest)
      user_error(flag, " ", path, " holds no checkpoint (no ", checkpoint_tracker_path(path),
                 ") and is no Hugging Face model directory (no config.json)");
    const OpenedCheckpoint opened = open_checkpoint(latest->dir, log_, checksum_noted_);
    const ShardedCheckpoint& ck = opened.ck;
    const json& meta = opened.meta;
    const std::string& meta_path = opened.meta_path;
    if (meta.contains("lora"))
      user_error(flag, " ", path, " is a LoRA checkpoint (adapters only), not a full model: give the model it adapts, "
                 "or merge the adapters into it first (loom convert --merge-lora)");
    check_model_config(get_field<json>(meta, "model_config", meta_path), cfg.model, meta_path, /*finetune=*/true);
    log_ << " loading model weights from " << path << " (iteration " << latest->iteration << ")\n";
    if (!lora) {
      load_pieces(ck, /*load_optim=*/false);
    } else {
      // The frozen base: every chunk's parameters (any saved layout reshards into this one), read in f32
      // batches of ~256 MiB on the host and written into the model (rounded into its 16-bit copy).
      for (const auto& m : run_.chunks) {
        std::deque<Parameter>& ps = m->params().all();
        for (size_t b = 0; b < ps.size();) {
          std::vector<TensorPiece> targets;
          std::vector<Tensor> host;
          int64_t bytes = 0;
          size_t e = b;
          for (; e < ps.size() && (e == b || bytes < (int64_t(256) << 20)); ++e) {
            host.push_back(Tensor::empty(ps[e].shape, DType::kF32));
            bytes += host.back().nbytes();
            TensorPiece t = param_box(ps[e], ps[e].name);
            t.data = host.back();
            targets.push_back(std::move(t));
          }
          ck.read(targets);
          for (size_t k = b; k < e; ++k) m->params().write_value(ps[k], host[k - b]);
          b = e;
        }
        m->sync_compute();
      }
    }
  }
  log_ << " > " << (lora ? "LoRA base (frozen)" : "fine-tuning from the weights of") << " " << abs << "\n";
  return abs;
}

void CheckpointManager::initialize_frozen_base() {
  for (const auto& m : run_.chunks) m->params().initialize(run_.cfg.seed);
}

void CheckpointManager::load() {
  const TrainConfig& cfg = run_.cfg;
  const bool lora = run_.chunks.front()->lora();
  const std::string& pretrained = cfg.checkpoint.pretrained_checkpoint;
  const char* fresh = lora ? "; the LoRA adapters start fresh at iteration 0\n" : "; starting at iteration 0\n";
  if (cfg.checkpoint.load.empty()) {
    if (!pretrained.empty()) {
      lora_base_ = load_model_only(pretrained, "--pretrained-checkpoint");
      log_ << " > --pretrained-checkpoint: weights only" << fresh;
    } else if (lora) {
      log_ << " > WARNING: LoRA without --load or --pretrained-checkpoint: the frozen base is randomly initialised\n";
      initialize_frozen_base();
    }
    return;
  }
  check_load_flags(cfg);
  if (is_hf_model_dir(cfg.checkpoint.load)) {  // weights only: --finetune, or the base of a LoRA run
    lora_base_ = load_model_only(cfg.checkpoint.load, "--load");
    log_ << " > " << (lora ? "LoRA" : "--finetune") << ": loaded the weights only" << fresh
         << "  successfully loaded Hugging Face model from " << cfg.checkpoint.load << " at iteration 0\n";
    return;
  }
  const std::optional<LatestCheckpoint> latest = checkpoint_to_load(cfg.checkpoint);
  if (!latest) {
    log_ << " > WARNING: could not find the metadata file " << checkpoint_tracker_path(cfg.checkpoint.load)
         << "\n    will not load any checkpoints";
    if (!pretrained.empty()) {
      log_ << "; loading --pretrained-checkpoint instead\n";
      lora_base_ = load_model_only(pretrained, "--pretrained-checkpoint");
      log_ << " > --pretrained-checkpoint: weights only" << fresh;
    } else {
      log_ << " and will start from random\n";
      if (lora) initialize_frozen_base();
    }
    return;
  }
  const std::string dir = latest->dir;
  // One reader of the checkpoint, read before anything is changed.
  const OpenedCheckpoint opened = open_checkpoint(dir, log_, checksum_noted_);
  const ShardedCheckpoint& ck = opened.ck;
  const json& meta = opened.meta;
  const std::string& meta_path = opened.meta_path;
  const int version = get_field<int>(meta, "format_version", meta_path);
  if (version > kFormatVersion)
    user_error(meta_path, " has format_version ", version, "; this Loom reads up to ", kFormatVersion);
  if (lora && !meta.contains("lora")) {  // a full model: the base to adapt
    lora_base_ = load_model_only(cfg.checkpoint.load, "--load");
    log_ << " > LoRA: loaded the base weights only" << fresh << "  successfully loaded checkpoint from "
         << cfg.checkpoint.load << " at iteration 0\n";
    return;
  }
  if (!lora && meta.contains("lora"))
    user_error("checkpoint ", dir, " holds LoRA adapters (rank ", meta["lora"].value("rank", json()).dump(),
               ") and no base model: resume it with the same --lora-rank, --lora-alpha and --lora-target-modules, "
               "or merge the adapters into their base (loom convert --merge-lora) and --load that");
  if (lora) {
    const json& saved = meta["lora"];
    const LoraOptions& lo = *run_.chunks.front()->options().lora;
    json targets = json::array();
    for (LoraTarget t : lo.targets) targets.push_back(lora_target_name(t));
    if (get_field<int64_t>(saved, "rank", meta_path) != lo.config.rank)
      user_error("checkpoint ", dir, " holds LoRA adapters of rank ", saved["rank"].dump(), "; this run has --lora-rank ",
                 lo.config.rank, ": use the same rank");
    if (get_field<json>(saved, "target_modules", meta_path) != targets)
      user_error("checkpoint ", dir, " holds LoRA adapters on ", saved["target_modules"].dump(), "; this run has "
                 "--lora-target-modules ", targets.dump(), ": use the same modules");
    if (get_field<double>(saved, "alpha", meta_path) != double(lo.config.alpha))
      user_error("checkpoint ", dir, " was trained with --lora-alpha ", saved["alpha"].dump(), "; this run has ",
                 lo.config.alpha, ": the scale of the adapters must stay the same");
    const std::string base = pretrained.empty() ? get_field<std::string>(saved, "base", meta_path) : pretrained;
    if (base.empty())
      user_error("checkpoint ", dir, " was trained on a randomly initialised base (no \"base\" in its lora block); "
                 "pass the base model with --pretrained-checkpoint");
    lora_base_ = load_model_only(base, pretrained.empty() ? "the LoRA checkpoint's base" : "--pretrained-checkpoint");
  }
  log_ << " loading checkpoint from " << cfg.checkpoint.load << " at iteration " << latest->iteration << "\n";
  check_model_config(get_field<json>(meta, "model_config", meta_path), cfg.model, meta_path, cfg.checkpoint.finetune);
  if (run_.models().front()->fp8() != meta.contains("fp8"))
    log_ << " > note: checkpoint " << dir << (meta.contains("fp8") ? " holds FP8 scaling state, which this run (no "
            "--fp8-format) does not use" : " has no FP8 scaling state: the FP8 scales start at 1") << "\n";
  if (meta.contains("fp8") && run_.models().front()->fp8()) {
    const int64_t saved = get_field<int64_t>(meta["fp8"], "amax_history_len", meta_path);
    if (saved != cfg.precision.fp8_recipe()->amax_history_len)
      user_error("checkpoint ", dir, " keeps ", saved, " steps of FP8 amax history; this run has "
                 "--fp8-amax-history-len ", cfg.precision.fp8_recipe()->amax_history_len, ": use the same length");
  }
  const bool load_optim = !cfg.checkpoint.finetune && !cfg.checkpoint.no_load_optim;
  if (load_optim && !meta.contains("optimizer"))
    user_error("checkpoint ", dir, " holds no optimizer state (saved with --no-save-optim); pass --no-load-optim "
               "to resume with a fresh optimizer, or --finetune");
  if (load_optim) check_optimizer_matches(meta["optimizer"], meta_path, dir);
  // Every Loom checkpoint (any layout, or the single-file format of Loom 0.1.0) through the resharding
  // reader: weights, the FP8 state, and the optimizer state when load_optim.
  load_pieces(ck, load_optim);

  if (cfg.checkpoint.finetune) {
    log_ << " > --finetune: loaded the weights only; starting at iteration 0\n"
         << "  successfully loaded checkpoint from " << cfg.checkpoint.load << " at iteration 0\n";
    return;
  }
  run_.progress.iteration = get_field<int64_t>(meta, "iteration", meta_path);
  run_.progress.consumed_train = get_field<int64_t>(meta, "consumed_train_samples", meta_path);
  run_.progress.consumed_valid = get_field<int64_t>(meta, "consumed_valid_samples", meta_path);
  if (load_optim) {
    run_.dopt->set_num_steps(get_field<int64_t>(meta["optimizer"], "step", meta_path));
    for (const std::string& line :
         run_.sched->load_state(SchedulerState::from_json(get_field<json>(meta, "opt_param_scheduler", meta_path).dump(),
                                                      meta_path)))
      log_ << line << "\n";
    if (run_.scaler && meta.contains("grad_scaler"))
      run_.scaler->load_state(GradScalerState::from_json(meta["grad_scaler"].dump(), meta_path));
    else if (run_.scaler)
      log_ << " > WARNING: checkpoint " << dir << " has no loss-scaler state (not an FP16 run); the scaler starts "
           << "from --initial-loss-scale\n";
  }
  if (!cfg.checkpoint.no_load_rng && !meta.contains("rng"))
    user_error("checkpoint ", dir, " holds no RNG state (saved with --no-save-rng); pass --no-load-rng or --finetune");
  if (!cfg.checkpoint.no_load_rng) {
    run_.progress.dropout_seed = get_field<uint64_t>(meta["rng"], "dropout_seed", meta_path);
    run_.progress.micro_batches_done = get_field<uint64_t>(meta["rng"], "micro_batches", meta_path);
  }
  log_ << "  successfully loaded checkpoint from " << cfg.checkpoint.load << " at iteration " << run_.progress.iteration << "\n"
       << std::flush;
}

}  // namespace loom
