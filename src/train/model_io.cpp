// Model weights in and out: Loom checkpoints and Hugging Face directories (see model_io.h). Import checks
// everything (names, shapes, tied copies, implied-zero biases) before it writes a single parameter; all
// layout work is model/hf_mapping.h's exact row gathers.
// The configurations these need (Loom metadata, HF config.json) are read and written by model_config_io.cpp.
#include "loom/train/model_io.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "train/checkpoint_format.h"
#include "train/model_io_impl.h"
#include "train/training_run.h"

namespace fs = std::filesystem;

namespace loom {

using model_io_detail::kLoomFormat;
using model_io_detail::kLoomFormatVersion;
using model_io_detail::loom_checkpoint_dir;
using model_io_detail::model_config_from_json;
using model_io_detail::read_loom_metadata;
using model_io_detail::torch_dtype_name;
using model_io_detail::check_new_loom_root;
using model_io_detail::write_weights_checkpoint;

namespace {

using nlohmann::json;

constexpr const char* kWordEmbedding = "embedding.word_embeddings.weight";

using LoomTensors = std::vector<std::pair<std::string, Tensor>>;

// A checkpoint that records no checksums loads unverified: one line says so (once per load).
void note_unverified(const std::string& note, std::ostream* log) {
  if (log && !note.empty()) *log << note << "\n";
}

// The model weights of a Loom checkpoint (any layout, either format) as whole f32 tensors: every tensor
// but the optimizer state and the FP8 scaling state.
LoomTensors read_checkpoint_weights(const ShardedCheckpoint& ck) {
  LoomTensors out;
  const auto ends_with = [](const std::string& s, const std::string& x) {
    return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  for (const std::string& name : ck.tensor_names())
    if (name.rfind("optimizer.", 0) != 0 && !ends_with(name, ".fp8_state"))
      out.emplace_back(name, ck.read_full(name, DType::kF32));
  return out;
}

// The HF name prefix this directory uses: transformers' default, or none (the Hub's gpt2 files).
std::string detect_prefix(const HfCheckpoint& hf, HfFamily family) {
  const std::string emb = family == HfFamily::kGPT2 ? "wte.weight" : "embed_tokens.weight";
  const std::string dflt = hf_default_prefix(family);
  if (!hf.contains(dflt + emb) && hf.contains(emb)) return "";
  return dflt;
}

void check_hf_shape(const HfCheckpoint& hf, const std::string& name, const Shape& want, const std::string& purpose) {
  const SafetensorsInfo& info = hf.info(name);
  if (info.shape != want)
    user_error("HF tensor '", name, "' in ", hf.dir(), " has shape ", info.shape.str(), " but ", purpose, " needs ",
               want.str(), " (from config.json)");
  const bool is_float = info.dtype ? dtype_is_float(*info.dtype) : info.dtype_str == "F64";
  if (!is_float)
    user_error("HF tensor '", name, "' in ", hf.dir(), " has dtype ", info.dtype_str, "; weights must be F32, BF16, F16 or F64");
}


// Every check first, then the reads: the Loom parameters of `cfg` (f32, host) in GPTModel's order.
LoomTensors import_hf(const HfCheckpoint& hf, const GPTConfig& cfg, std::ostream* log) {
  const HfFamily family = hf_family_for(cfg);
  const std::string prefix = detect_prefix(hf, family);
  const HfLayout layout = hf_layout(cfg, prefix);
  std::set<std::string> known;
  for (const HfParamMap& m : layout.params)
    for (const HfPart& p : m.parts) known.insert(p.name);
  for (const HfAlias& a : layout.aliases) known.insert(a.name);
  for (const HfPart& z : layout.zero_tensors) known.insert(z.name);
  std::vector<std::string> skipped;
  for (const std::string& name : hf.names()) {
    if (known.count(name)) continue;
    if (hf_is_buffer(name)) {
      skipped.push_back(name);
      continue;
    }
    user_error("HF tensor '", name, "' in ", hf.dir(), " maps to no Loom parameter of this ", hf.config().model_type,
               " model (config.json: ", cfg.num_layers, " layers", cfg.untie_embeddings_and_output_weights ? "" : ", tied lm_head",
               cfg.qkv_bias() ? "" : ", no attention bias", cfg.add_bias_linear ? "" : ", no MLP bias",
               "; names are expected under '", prefix, "')");
  }
  for (const HfParamMap& m : layout.params)
    for (const HfPart& p : m.parts) {
      if (!hf.contains(p.name))
        user_error("HF directory ", hf.dir(), " has no tensor '", p.name, "', needed for Loom parameter '", m.loom_name,
                   "'");
      check_hf_shape(hf, p.name, p.shape, "Loom parameter '" + m.loom_name + "'");
    }
  for (const HfAlias& a : layout.aliases)
    if (hf.contains(a.name)) check_hf_shape(hf, a.name, hf.info(a.same_as).shape, "a tied copy of '" + a.same_as + "'");
  for (const HfPart& z : layout.zero_tensors)
    if (hf.contains(z.name)) check_hf_shape(hf, z.name, z.shape, "an all-zero bias");

  for (const HfAlias& a : layout.aliases) {
    if (!hf.contains(a.name)) continue;
    const Tensor x = hf.read(a.name, DType::kF32), y = hf.read(a.same_as, DType::kF32);
    if (std::memcmp(x.raw(), y.raw(), size_t(x.nbytes())) != 0)
      user_error("HF tensor '", a.name, "' in ", hf.dir(), " differs from '", a.same_as,
                 "' but config.json has tie_word_embeddings = true; set it to false to load a separate output layer");
  }
  for (const HfPart& z : layout.zero_tensors) {
    if (!hf.contains(z.name)) continue;
    const Tensor t = hf.read(z.name, DType::kF32);
    const float* v = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (v[i] != 0.0f)
        user_error("HF tensor '", z.name, "' in ", hf.dir(), " is not zero, but a Loom model with q/k/v biases only "
                   "(--add-qkv-bias --disable-bias-linear) has no output projection bias; with mlp_bias = true as well "
                   "the model converts with every linear bias");
  }

  LoomTensors out;
  for (const HfParamMap& m : layout.params) {
    std::vector<Tensor> parts;
    std::vector<TensorView> views;
    for (const HfPart& p : m.parts) {
      parts.push_back(hf.read(p.name, DType::kF32));
      views.push_back(parts.back());
    }
    Tensor t = Tensor::empty(m.loom_shape, DType::kF32);
    hf_to_loom(m, views, t);
    out.emplace_back(m.loom_name, std::move(t));
  }
  if (log) {
    *log << "mapping " << hf.config().model_type << " tensors of " << hf.dir() << " to Loom parameters:\n";
    for (const std::string& line : hf_mapping_summary(layout)) *log << "  " << line << "\n";
    if (!skipped.empty())
      *log << "  skipped " << skipped.size() << " non-parameter buffers (" << skipped.front()
           << (skipped.size() > 1 ? ", ..." : "") << ")\n";
  }
  return out;
}

Tensor cast_from_f32(TensorView x, DType dt) {
  if (dt == DType::kF32) {
    Tensor t = Tensor::empty(x.shape(), dt);
    std::memcpy(t.raw(), x.raw(), size_t(x.nbytes()));
    return t;
  }
  LOOM_CHECK(dt == DType::kBF16 || dt == DType::kF16, "[export_hf] unsupported dtype ", dtype_name(dt));
  Tensor t = Tensor::empty(x.shape(), dt);
  const float* s = x.data<float>();
  uint16_t* d = t.data<uint16_t>();
  for (int64_t i = 0; i < x.numel(); ++i) d[i] = dt == DType::kBF16 ? f32_to_bf16(s[i]) : f32_to_f16(s[i]);
  return t;
}

// Writes the HF directory from Loom parameters given by name (f32, host).
void export_tensors(const std::map<std::string, TensorView>& loom, const GPTConfig& cfg, const std::string& out_dir,
                    const HfExportOptions& opts, const std::string& source) {
  const HfLayout layout = hf_layout(cfg);
  std::set<std::string> mapped;
  for (const HfParamMap& m : layout.params) {
    const auto it = loom.find(m.loom_name);
    if (it == loom.end()) user_error(source, " has no parameter '", m.loom_name, "' that its model_config implies");
    if (it->second.shape() != m.loom_shape)
      user_error(source, ": parameter '", m.loom_name, "' has shape ", it->second.shape().str(), " but its model_config implies ",
                 m.loom_shape.str());
    mapped.insert(m.loom_name);
  }
  for (const auto& [name, view] : loom)
    if (!mapped.count(name)) user_error(source, " holds '", name, "', which no ", hf_family_name(layout.family), " tensor takes");
  const std::string config = hf_config_json(cfg, opts);
  std::vector<Tensor> keep;
  NamedTensors out;
  for (const HfParamMap& m : layout.params) {
    const std::vector<Tensor> parts = loom_to_hf(m, loom.at(m.loom_name));
    for (size_t p = 0; p < parts.size(); ++p) {
      keep.push_back(cast_from_f32(parts[p], opts.dtype));
      out.emplace_back(m.parts[p].name, keep.back());
    }
  }
  for (const HfPart& z : layout.zero_tensors) {
    keep.push_back(Tensor::zeros(z.shape, opts.dtype));
    out.emplace_back(z.name, keep.back());
  }
  if (opts.log) {
    *opts.log << "mapping Loom parameters to " << hf_family_name(layout.family) << " tensors:\n";
    for (const std::string& line : hf_mapping_summary(layout, /*to_hf=*/true)) *opts.log << "  " << line << "\n";
  }
  write_hf_dir(out_dir, config, out, opts.max_shard_bytes);
}

}  // namespace

namespace model_io_detail {

void token_ids_from_metadata(const json& meta, HfExportOptions& opts) {
  if (!meta.contains("converted_from") || !meta["converted_from"].is_object()) return;
  const json& src = meta["converted_from"];
  if (!opts.bos_token_id && src.contains("bos_token_id") && src["bos_token_id"].is_number_integer())
    opts.bos_token_id = src["bos_token_id"].get<int64_t>();
  if (opts.eos_token_ids.empty() && src.contains("eos_token_ids") && src["eos_token_ids"].is_array())
    for (const json& id : src["eos_token_ids"])
      if (id.is_number_integer()) opts.eos_token_ids.push_back(id.get<int64_t>());
}

void check_new_loom_root(const std::string& root) {
  std::error_code ec;
  if (fs::exists(root, ec) && !(fs::is_directory(root, ec) && fs::is_empty(root, ec)))
    user_error("--to loom:", root, " already exists and is not an empty directory; choose a new one");
}

void write_weights_checkpoint(const std::string& root, const GPTConfig& cfg,
                              const std::vector<std::pair<std::string, TensorView>>& tensors, const json& extra) {
  check_new_loom_root(root);
  std::vector<TensorPiece> pieces;  // the sharded format of a world of one: each tensor one whole piece
  for (const auto& [name, t] : tensors) {
    TensorPiece piece;
    piece.name = name;
    piece.global_shape = t.shape();
    piece.data = t;
    pieces.push_back(std::move(piece));
  }
  json meta;
  meta["format"] = kLoomFormat;
  meta["format_version"] = kLoomFormatVersion;
  meta["loom_version"] = kLoomVersion;
  meta["iteration"] = 0;
  meta["consumed_train_samples"] = 0;
  meta["consumed_valid_samples"] = 0;
  meta["consumed_tokens"] = 0;
  meta["model_config"] = model_config_json(cfg);
  meta["precision"] = "fp32";
  for (const auto& [key, value] : extra.items()) {
    LOOM_CHECK(!meta.contains(key), "[write_weights_checkpoint] metadata key ", key, " given twice");
    meta[key] = value;
  }
  save_sharded_checkpoint(root, 0, pieces, R"({"tp":1,"pp":1,"cp":1,"dp":1,"ep":1,"etp":1,"sharding":"no_shard"})",
                          meta.dump(), /*rank=*/0, /*world_size=*/1, [] {});
}

}  // namespace model_io_detail

void load_model_weights(const std::string& dir, ParameterSet& params, const HfImportOptions& opts) {
  LoomTensors values;
  std::string source;
  if (is_hf_model_dir(dir)) {
    const HfCheckpoint hf = HfCheckpoint::open(dir);
    note_unverified(hf.checksum_note(), opts.notes ? opts.notes : opts.log);
    GPTConfig cfg = gpt_config_from_hf(hf.config(), 1);
    const Parameter* wte = params.find(kWordEmbedding);
    if (!wte) user_error("the model has no ", kWordEmbedding, "; cannot load HF directory ", dir);
    if (wte->shape[0] < cfg.vocab_size)
      user_error("HF directory ", dir, " has a vocabulary of ", cfg.vocab_size, " tokens but the model's embedding has ",
                 wte->shape[0], " rows");
    cfg.padded_vocab_size = wte->shape[0];
    if (opts.rotary_interleaved) {
      if (cfg.position_embedding_type != PositionEmbeddingType::kRope)
        user_error("--rotary-interleaved needs a RoPE model; HF directory ", dir, " holds ", hf.config().model_type);
      cfg.rotary_interleaved = true;
    }
    values = import_hf(hf, cfg, opts.log);
    source = "HF directory " + dir;
  } else {
    const std::string ck = loom_checkpoint_dir(dir);
    const ShardedCheckpoint sc = ShardedCheckpoint::open(ck);
    note_unverified(sc.checksum_note(), opts.notes ? opts.notes : opts.log);
    values = read_checkpoint_weights(sc);
    source = "checkpoint " + ck;
    // The routers' expert biases: into the model's buffers, not among the parameters.
    for (auto it = values.begin(); it != values.end();) {
      if (!it->first.ends_with(".router.expert_bias")) {
        ++it;
        continue;
      }
      for (auto& [name, bias] : opts.expert_biases)
        if (name == it->first) {
          if (it->second.numel() != int64_t(bias->size()))
            user_error(source, ": '", name, "' has ", it->second.numel(), " values but the model has ", bias->size(),
                       " experts");
          const float* v = static_cast<const float*>(it->second.raw());
          bias->assign(v, v + it->second.numel());
        }
      it = values.erase(it);
    }
  }
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : values) by_name[name] = &t;
  for (const Parameter& p : params.all()) {
    const auto it = by_name.find(p.name);
    if (it == by_name.end())
      user_error(source, " has no weights for the model's parameter '", p.name,
                 "': the model's architecture differs from the one it holds");
    if (it->second->shape() != p.shape)
      user_error(source, ": parameter '", p.name, "' is ", it->second->shape().str(), " there but ", p.shape.str(),
                 " in the model");
  }
  if (by_name.size() != params.all().size())
    for (const auto& [name, t] : values)
      if (!params.find(name))
        user_error(source, " holds '", name, "', which the model does not have: the architectures differ");
  for (Parameter& p : params.all()) {
    const Tensor& src = *by_name.at(p.name);
    if (p.value.defined() && p.value.device().is_cpu()) {
      std::memcpy(p.value.raw(), src.raw(), size_t(src.nbytes()));
    } else {  // on a device, or a frozen set without f32 values (rounded into its compute copy)
      LOOM_CHECK(opts.ctx, "[load_model_weights] parameter ", p.name, " needs HfImportOptions::ctx");
      params.write_value(p, src);
    }
  }
}

void export_hf(const ParameterSet& params, const GPTConfig& cfg, const std::string& out_dir, const HfExportOptions& opts) {
  std::vector<Tensor> host;
  std::map<std::string, TensorView> loom;
  for (const Parameter& p : params.all()) {
    if (p.value.device().is_cpu()) {
      loom[p.name] = p.value;
    } else {
      LOOM_CHECK(opts.ctx, "[export_hf] parameters on ", p.value.device().str(), " need HfExportOptions::ctx");
      host.push_back(Tensor::empty(p.shape, DType::kF32));
      opts.ctx->copy(host.back(), p.value);
      loom[p.name] = host.back();
    }
  }
  if (opts.ctx) opts.ctx->synchronize();
  export_tensors(loom, cfg, out_dir, opts, "the model");
}

void convert_hf_to_loom(const std::string& hf_dir, const std::string& loom_root, const HfToLoomOptions& opts,
                        std::ostream& log) {
  check_new_loom_root(loom_root);
  const HfCheckpoint hf = HfCheckpoint::open(hf_dir);
  note_unverified(hf.checksum_note(), &log);
  GPTConfig cfg = gpt_config_from_hf(hf.config(), opts.make_vocab_size_divisible_by);
  if (opts.rotary_interleaved) {
    if (cfg.position_embedding_type != PositionEmbeddingType::kRope)
      user_error("--rotary-interleaved needs a RoPE model; ", hf_dir, " holds ", hf.config().model_type);
    cfg.rotary_interleaved = true;
  }
  log << "converting Hugging Face " << hf.config().model_type << " model " << hf_dir << " ("
      << hf.names().size() << " tensors, " << hf.total_bytes() << " bytes" << (hf.sharded() ? ", sharded" : "")
      << ") to a Loom checkpoint in " << loom_root << "\n";
  const LoomTensors values = import_hf(hf, cfg, &log);
  int64_t numel = 0;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const auto& [name, t] : values) {
    tensors.emplace_back(name, t);
    numel += t.numel();
  }
  LOOM_CHECK(numel == cfg.num_parameters(), "[convert] ", numel, " converted values, config implies ",
             cfg.num_parameters());
  json src = {{"format", "huggingface"}, {"model_type", hf.config().model_type}, {"dir", hf_dir}};
  if (hf.config().bos_token_id) src["bos_token_id"] = *hf.config().bos_token_id;
  if (!hf.config().eos_token_ids.empty()) src["eos_token_ids"] = hf.config().eos_token_ids;
  write_weights_checkpoint(loom_root, cfg, tensors, {{"converted_from", src}});
  log << "wrote " << checkpoint_dir(loom_root, 0) << ": " << values.size() << " parameters, " << numel
      << " values (vocabulary " << cfg.vocab_size << " padded to " << cfg.padded_vocab_size
      << "); train from it with `loom train --load " << loom_root << " --finetune ...`\n";
}

void convert_loom_to_hf(const std::string& loom_dir, const std::string& hf_dir, const HfExportOptions& opts_in,
                        std::ostream& log) {
  const std::string ck = loom_checkpoint_dir(loom_dir);
  const json meta = read_loom_metadata(ck);
  const GPTConfig cfg = model_config_from_json(meta["model_config"], ck + "/metadata.json");
  HfExportOptions opts = opts_in;
  opts.log = &log;
  // Token ids of a model that came from HF go back into its config.json.
  model_io_detail::token_ids_from_metadata(meta, opts);
  const std::string type = hf_model_type(cfg);  // refuses an architecture with no HF counterpart, before any work
  const std::string file = ck + "/metadata.json";
  const ShardedCheckpoint sc = ShardedCheckpoint::open(ck);
  note_unverified(sc.checksum_note(), &log);
  const LoomTensors tensors = read_checkpoint_weights(sc);
  std::map<std::string, TensorView> loom;
  for (const auto& [name, t] : tensors) loom[name] = t;
  log << "converting Loom checkpoint " << ck << " (" << loom.size() << " parameters) to a Hugging Face "
      << type
      << " model in " << hf_dir << " (" << torch_dtype_name(opts.dtype) << ")\n";
  export_tensors(loom, cfg, hf_dir, opts, file);
  log << "wrote " << hf_dir << "\n";
}

}  // namespace loom
