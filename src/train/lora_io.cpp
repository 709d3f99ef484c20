// LoRA checkpoints read whole, and adapters merged into their base (see loom/train/lora_io.h). The rows an
// adapter updates come from lora_site(), the same description the model layer places adapters with, so
// a merged model computes what base + adapters computed in training. PEFT directories are peft_io.cpp's.
#include "loom/train/lora_io.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/backend/device_context.h"
#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "train/model_io_impl.h"

namespace fs = std::filesystem;

namespace loom {

using nlohmann::json;
using model_io_detail::loom_checkpoint_dir;
using model_io_detail::model_config_from_json;
using model_io_detail::read_loom_metadata;

namespace {

std::string layer_prefix(int64_t i) { return "decoder.layers." + std::to_string(i) + "."; }

bool ends_with(const std::string& s, const std::string& x) {
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}

std::string targets_text(const std::vector<LoraTarget>& targets) {
  std::string s;
  for (LoraTarget t : targets) s += std::string(s.empty() ? "" : " ") + lora_target_name(t);
  return s;
}

// The bos/eos ids a base model carries (its HF config.json, or the converted_from record of a Loom
// checkpoint), as a converted_from-style object.
json base_token_ids(const std::string& base) {
  json ids = json::object();
  if (is_hf_model_dir(base)) {
    const HfConfig hf = HfCheckpoint::open(base).config();
    if (hf.bos_token_id) ids["bos_token_id"] = *hf.bos_token_id;
    if (!hf.eos_token_ids.empty()) ids["eos_token_ids"] = hf.eos_token_ids;
    return ids;
  }
  const json meta = read_loom_metadata(loom_checkpoint_dir(base));
  if (meta.contains("converted_from") && meta["converted_from"].is_object())
    for (const char* key : {"bos_token_id", "eos_token_ids"})
      if (meta["converted_from"].contains(key)) ids[key] = meta["converted_from"][key];
  return ids;
}

}  // namespace

bool is_lora_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (is_hf_model_dir(dir)) return false;
  if (!fs::is_regular_file(fs::path(dir) / "metadata.json", ec) && !fs::is_regular_file(checkpoint_tracker_path(dir), ec))
    return false;
  return read_loom_metadata(loom_checkpoint_dir(dir)).contains("lora");
}

LoraCheckpoint read_lora_checkpoint(const std::string& dir) {
  LoraCheckpoint out;
  out.dir = loom_checkpoint_dir(dir);
  const std::string file = out.dir + "/metadata.json";
  const json meta = read_loom_metadata(out.dir);
  if (!meta.contains("lora"))
    user_error(dir, " is a full model checkpoint (", file, " has no \"lora\" block), not LoRA adapters: the LoRA "
               "conversions (--merge-lora, --to peft:) read what `loom train --lora-rank --save` writes");
  out.model = model_config_from_json(meta["model_config"], file);
  const json& l = meta["lora"];
  const auto bad = [&](const char* key, const char* want) {
    user_error(file, ": lora.", key, " must be ", want, ", got ", l.contains(key) ? l[key].dump() : "nothing");
  };
  if (!l.is_object()) user_error(file, ": \"lora\" must be an object, got ", l.dump());
  if (!l.contains("rank") || !l["rank"].is_number_integer() || l["rank"].get<int64_t>() < 1) bad("rank", "an integer >= 1");
  if (!l.contains("alpha") || !l["alpha"].is_number() || !(l["alpha"].get<double>() > 0)) bad("alpha", "a number > 0");
  if (!l.contains("dropout") || !l["dropout"].is_number() || !(l["dropout"].get<double>() >= 0) ||
      !(l["dropout"].get<double>() < 1))
    bad("dropout", "a number in [0, 1)");
  if (!l.contains("target_modules") || !l["target_modules"].is_array() || l["target_modules"].empty())
    bad("target_modules", "a non-empty list of module names");
  std::vector<std::string> names;
  for (const json& n : l["target_modules"]) {
    if (!n.is_string()) bad("target_modules", "a non-empty list of module names");
    names.push_back(n.get<std::string>());
  }
  if (l.contains("base") && !l["base"].is_string()) bad("base", "a path");
  out.lora.config = {l["rank"].get<int64_t>(), float(l["alpha"].get<double>()), float(l["dropout"].get<double>())};
  try {
    out.lora.targets = parse_lora_targets(names, out.model);
  } catch (const UserError& e) {
    user_error(file, ": lora.target_modules: ", e.what());
  }
  out.base = l.value("base", std::string());
  return out;
}

std::map<std::string, Tensor> read_lora_adapters(const LoraCheckpoint& ck) {
  const ShardedCheckpoint sc = ShardedCheckpoint::open(ck.dir);
  std::map<std::string, Shape> expected;
  for (int64_t i = 0; i < ck.model.num_layers; ++i)
    for (LoraTarget t : ck.lora.targets) {
      const LoraSite s = lora_site(ck.model, t);
      expected[layer_prefix(i) + s.module + ".lora_A.weight"] = Shape{ck.lora.config.rank, s.in};
      expected[layer_prefix(i) + s.module + ".lora_B.weight"] = Shape{s.out, ck.lora.config.rank};
    }
  for (const std::string& name : sc.tensor_names()) {
    if (name.rfind("optimizer.", 0) == 0 || ends_with(name, ".fp8_state")) continue;
    if (!expected.count(name))
      user_error("LoRA checkpoint ", ck.dir, " holds '", name, "', which is no adapter of its lora block (targets ",
                 targets_text(ck.lora.targets), ")");
  }
  std::map<std::string, Tensor> out;
  for (const auto& [name, shape] : expected) {
    if (!sc.contains(name))
      user_error("LoRA checkpoint ", ck.dir, " has no tensor '", name, "', which its lora block (targets ",
                 targets_text(ck.lora.targets), ", rank ", ck.lora.config.rank, ") implies");
    if (sc.global_shape(name) != shape)
      user_error("LoRA checkpoint ", ck.dir, ": tensor '", name, "' is ", sc.global_shape(name).str(), " but its lora "
                 "block and model_config imply ", shape.str());
  }
  for (const auto& [name, shape] : expected) out.emplace(name, sc.read_full(name, DType::kF32));
  return out;
}

void merge_lora(const GPTConfig& cfg, const LoraOptions& lora, const std::map<std::string, Tensor>& adapters,
                const std::map<std::string, TensorView>& weights) {
  const double scale = double(lora.config.scale());  // the float the adapters' forward scales by
  const int64_t R = lora.config.rank;
  for (int64_t i = 0; i < cfg.num_layers; ++i)
    for (LoraTarget t : lora.targets) {
      const LoraSite s = lora_site(cfg, t);
      const std::string L = layer_prefix(i), wname = L + s.layer + ".weight";
      const auto w = weights.find(wname);
      LOOM_CHECK(w != weights.end(), "[merge_lora] no weight ", wname);
      const TensorView W = w->second;
      const Tensor& A = adapters.at(L + s.module + ".lora_A.weight");
      const Tensor& B = adapters.at(L + s.module + ".lora_B.weight");
      LOOM_CHECK(W.dtype() == DType::kF32 && W.device().is_cpu() && W.shape().ndim() == 2 && W.shape()[1] == s.in,
                 "[merge_lora] ", wname, ": expected f32 host (*, ", s.in, "), got ", W.desc());
      LOOM_CHECK(A.shape() == Shape({R, s.in}) && B.shape() == Shape({s.out, R}), "[merge_lora] ", s.module,
                 " adapters ", A.shape().str(), " / ", B.shape().str());
      std::vector<int64_t> rows;  // the weight's row of each of B's rows
      if (s.rows.empty())
        for (int64_t r = 0; r < s.out; ++r) rows.push_back(r);
      for (const ShardRange& rg : s.rows)
        for (int64_t r = 0; r < rg.size; ++r) rows.push_back(rg.start + r);
      LOOM_CHECK(int64_t(rows.size()) == s.out && rows.back() < W.shape()[0], "[merge_lora] ", s.module, " rows");
      const float* a = A.data<float>();
      const float* b = B.data<float>();
      float* wd = W.data<float>();
      const int64_t in = s.in, out = s.out;
#pragma omp parallel for schedule(static)
      for (int64_t k = 0; k < out; ++k) {
        float* row = wd + rows[size_t(k)] * in;
        for (int64_t c = 0; c < in; ++c) {
          double d = 0;
          for (int64_t j = 0; j < R; ++j) d += double(b[k * R + j]) * double(a[j * in + c]);
          row[c] = float(double(row[c]) + scale * d);
        }
      }
    }
}

std::string load_merged_lora(const LoraCheckpoint& ck, const std::string& base_override, const char* base_flag,
                             ParameterSet& params, std::ostream* log) {
  const std::string base = base_override.empty() ? ck.base : base_override;
  const std::string which = base_override.empty() ? "the LoRA checkpoint's base" : base_flag;
  if (base.empty())
    user_error("LoRA checkpoint ", ck.dir, " was trained on a randomly initialised base (no \"base\" in its lora "
               "block); pass the base model with ", base_flag);
  std::error_code ec;
  if (!fs::is_directory(base, ec))
    user_error(which, " ", base, " is not a directory (a Loom checkpoint or a Hugging Face model directory); pass the "
               "model the adapters were trained on with ", base_flag);
  if (is_lora_checkpoint(base))
    user_error(which, " ", base, " is a LoRA checkpoint (adapters only), not a full model");
  const std::map<std::string, Tensor> adapters = read_lora_adapters(ck);  // every check before the load
  HfImportOptions io;
  io.rotary_interleaved = ck.model.rotary_interleaved;  // as the training run loaded an HF base
  try {
    load_model_weights(base, params, io);
  } catch (const UserError& e) {
    user_error(which, " ", base, " does not fit LoRA checkpoint ", ck.dir, ": ", e.what());
  }
  std::map<std::string, TensorView> weights;
  for (Parameter& p : params.all()) {
    LOOM_CHECK(p.value.device().is_cpu() && p.value.dtype() == DType::kF32, "[load_merged_lora] ", p.name,
               " must be an f32 host master, got ", p.value.desc());
    weights[p.name] = p.value;
  }
  merge_lora(ck.model, ck.lora, adapters, weights);
  const std::string abs = fs::absolute(base).lexically_normal().string();
  if (log)
    *log << "merged LoRA adapters of " << ck.dir << " (rank " << ck.lora.config.rank << ", alpha "
         << ck.lora.config.alpha << ", " << targets_text(ck.lora.targets) << ") into the base " << abs << "\n";
  return abs;
}

void convert_merge_lora(const std::string& lora_dir, const std::string& base_override, const std::string& out_dir,
                        bool to_hf, const HfExportOptions& opts_in, std::ostream& log) {
  const LoraCheckpoint ck = read_lora_checkpoint(lora_dir);
  if (to_hf) hf_family_for(ck.model);  // an architecture HF has no counterpart for fails before any work
  else model_io_detail::check_new_loom_root(out_dir);
  const std::unique_ptr<DeviceContext> ctx = make_cpu_context();
  ModelOptions mo;
  mo.with_grads = false;
  GPTModel model(ck.model, *ctx, mo);
  const std::string base = load_merged_lora(ck, base_override, "--base", model.params(), &log);
  const json ids = base_token_ids(base);
  if (to_hf) {
    HfExportOptions opts = opts_in;
    opts.log = &log;
    model_io_detail::token_ids_from_metadata({{"converted_from", ids}}, opts);
    export_hf(model.params(), ck.model, out_dir, opts);
    log << "wrote " << out_dir << "\n";
    return;
  }
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const Parameter& p : model.params().all()) tensors.emplace_back(p.name, p.value);
  json src = {{"format", "loom-lora-merged"}, {"lora", ck.dir}, {"base", base}};
  src.update(ids);
  model_io_detail::write_weights_checkpoint(out_dir, ck.model, tensors, {{"converted_from", src}});
  log << "wrote " << checkpoint_dir(out_dir, 0) << ": the base with the adapters merged (" << tensors.size()
      << " parameters); train from it with `loom train --load " << out_dir << " --finetune ...`\n";
}

}  // namespace loom
