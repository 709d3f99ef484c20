// Hugging Face PEFT adapter directories in and out (see loom/train/lora_io.h): adapter_config.json plus
// adapter_model.safetensors, mapped by model/hf_mapping.h's hf_lora_layout. Import checks everything (the
// config's settings, every key, shape and rank, the base's fit) before it writes anything.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/hf_dir.h"
#include "loom/ckpt/safetensors.h"
#include "loom/train/lora_io.h"
#include "train/checkpoint_format.h"
#include "train/model_io_impl.h"

namespace fs = std::filesystem;

namespace loom {

using nlohmann::json;
using model_io_detail::tidy_float;

namespace {

constexpr const char* kAdapterConfig = "adapter_config.json";
constexpr const char* kAdapterWeights = "adapter_model.safetensors";
// safetensors metadata key with Loom's canonical targets (comma-separated), so whole layers round-trip.
constexpr const char* kLoomTargetsKey = "loom_lora_target_modules";
// The modules of a Llama-family model that Loom places LoRA on, by PEFT's (and transformers') names.
const std::vector<std::string> kPeftModules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"};

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

std::vector<std::string> target_names(const std::vector<LoraTarget>& targets) {
  std::vector<std::string> out;
  for (LoraTarget t : targets) out.push_back(lora_target_name(t));
  return out;
}

bool same_bytes(TensorView a, TensorView b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0;
}

// lora_alpha as PEFT users write it: an integer when it is one.
json alpha_json(float alpha) {
  if (alpha == float(int64_t(alpha)) && std::abs(alpha) < 1e9f) return int64_t(alpha);
  return tidy_float(alpha);
}

// The adapter_config.json settings that change what the tensors mean; Loom's LoRA has none of them.
void check_peft_settings(const json& c, const std::string& path) {
  const auto value = [&](const char* key) { return c.contains(key) ? c[key] : json(); };
  const auto refuse = [&](const char* key, const std::string& why) {
    user_error(path, ": \"", key, "\": ", value(key).dump(), " ", why);
  };
  const json type = value("peft_type");
  if (type != "LORA") refuse("peft_type", "is not a LoRA adapter (peft_type \"LORA\")");
  const json task = value("task_type");
  if (!task.is_null() && task != "CAUSAL_LM")
    refuse("task_type", "is not a causal language model adapter (task_type \"CAUSAL_LM\")");
  if (value("use_dora") == true) refuse("use_dora", "(DoRA) has no Loom equivalent: Loom trains plain LoRA");
  if (value("use_rslora") == true)
    refuse("use_rslora", "scales by lora_alpha / sqrt(r); Loom's LoRA scales by alpha / r (--lora-alpha)");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (!value(key).is_null() && !(value(key).is_object() && value(key).empty()))
      refuse(key, "gives some modules their own rank or alpha; Loom uses one --lora-rank and --lora-alpha");
  if (!value("bias").is_null() && value("bias") != "none")
    refuse("bias", "trains biases alongside the adapters; Loom's LoRA trains no bias (bias \"none\")");
  if (!value("modules_to_save").is_null() && !(value("modules_to_save").is_array() && value("modules_to_save").empty()))
    refuse("modules_to_save", "saves fully trained modules, which a Loom LoRA checkpoint cannot hold");
  if (!value("layers_to_transform").is_null())
    refuse("layers_to_transform", "adapts some layers only; Loom adapts every layer");
  if (!value("layer_replication").is_null()) refuse("layer_replication", "has no Loom equivalent");
  if (value("fan_in_fan_out") == true)
    refuse("fan_in_fan_out", "is for GPT-2's Conv1D layers; Loom maps Llama-family adapters (nn.Linear) only");
}

template <typename T>
T number(const json& c, const char* key, const std::string& path, const char* want) {
  if (!c.contains(key) || !(std::is_integral_v<T> ? c[key].is_number_integer() : c[key].is_number()))
    user_error(path, ": \"", key, "\" must be ", want, ", got ", c.contains(key) ? c[key].dump() : "nothing");
  return c[key].get<T>();
}

// The whole-layer targets a Loom export recorded, when the file is still exactly what they give: the
// same tensor names, and each repeated A the same bytes. Empty otherwise.
std::vector<LoraTarget> recorded_whole_targets(const SafetensorsFile& f, const GPTConfig& model, int64_t rank,
                                               const std::vector<LoraTarget>& slices,
                                               const std::vector<std::string>& modules, std::ostream& log) {
  const auto it = f.metadata().find(kLoomTargetsKey);
  if (it == f.metadata().end()) return {};
  std::vector<std::string> names;
  for (size_t b = 0, e; b <= it->second.size(); b = e + 1) {
    e = it->second.find(',', b);
    if (e == std::string::npos) e = it->second.size();
    if (e > b) names.push_back(it->second.substr(b, e - b));
  }
  std::vector<LoraTarget> whole;
  try {
    whole = parse_lora_targets(names, model);
  } catch (const UserError&) {
    return {};
  }
  if (whole == slices) return {};
  std::set<std::string> want, want_modules;
  bool same = true;
  for (const HfLoraMap& m : hf_lora_layout(model, whole, rank)) {
    want_modules.insert(m.hf_modules.begin(), m.hf_modules.end());
    for (const std::string& a : m.hf_a) want.insert(a);
    for (const HfPart& p : m.b.parts) want.insert(p.name);
    for (const std::string& a : m.hf_a) same = same && f.contains(a) && f.contains(m.hf_a[0]);
    if (!same) break;
    const Tensor first = f.read(m.hf_a[0]);
    for (size_t k = 1; k < m.hf_a.size() && same; ++k) same = same_bytes(first, f.read(m.hf_a[k]));
  }
  same = same && std::set<std::string>(f.names().begin(), f.names().end()) == want &&
         std::set<std::string>(modules.begin(), modules.end()) == want_modules;
  if (!same) {
    log << "note: " << f.path() << " records Loom targets " << it->second << " but its tensors no longer repeat "
        << "their A; importing the PEFT modules as slice targets (the same rows, separate A)\n";
    return {};
  }
  return whole;
}

}  // namespace

void convert_loom_to_peft(const std::string& lora_dir, const std::string& out_dir, const std::string& base_name,
                          std::ostream& log) {
  const LoraCheckpoint ck = read_lora_checkpoint(lora_dir);
  const int64_t R = ck.lora.config.rank;
  const std::vector<HfLoraMap> layout = hf_lora_layout(ck.model, ck.lora.targets, R);  // refuses GPT-2
  const std::map<std::string, Tensor> adapters = read_lora_adapters(ck);
  log << "converting LoRA checkpoint " << ck.dir << " (rank " << R << ", alpha " << ck.lora.config.alpha
      << ", targets " << join(target_names(ck.lora.targets), " ") << ") to a Hugging Face PEFT adapter in " << out_dir
      << "\n";
  std::vector<Tensor> keep;
  NamedTensors tensors;
  std::set<std::string> modules;
  HfLayout summary;  // for the mapping lines
  summary.family = HfFamily::kLlama;
  for (const HfLoraMap& m : layout) {
    for (const std::string& a : m.hf_a) tensors.emplace_back(a, adapters.at(m.loom_a));
    std::vector<Tensor> parts = loom_to_hf(m.b, adapters.at(m.b.loom_name));
    for (size_t p = 0; p < parts.size(); ++p) {
      keep.push_back(std::move(parts[p]));
      tensors.emplace_back(m.b.parts[p].name, keep.back());
    }
    modules.insert(m.hf_modules.begin(), m.hf_modules.end());
    summary.params.push_back(m.b);
  }
  std::string base = base_name.empty() ? ck.base : base_name;
  // PEFT's LoraConfig.to_dict(), as save_pretrained writes it (json.dumps(indent=2, sort_keys=True)).
  json c;
  c["alpha_pattern"] = json::object();
  c["auto_mapping"] = nullptr;
  c["base_model_name_or_path"] = base.empty() ? json() : json(base);
  c["bias"] = "none";
  c["fan_in_fan_out"] = false;
  c["inference_mode"] = true;
  c["init_lora_weights"] = true;
  c["layer_replication"] = nullptr;
  c["layers_pattern"] = nullptr;
  c["layers_to_transform"] = nullptr;
  c["loftq_config"] = json::object();
  c["lora_alpha"] = alpha_json(ck.lora.config.alpha);
  c["lora_dropout"] = tidy_float(ck.lora.config.dropout);
  c["megatron_config"] = nullptr;
  c["megatron_core"] = "megatron.core";
  c["modules_to_save"] = nullptr;
  c["peft_type"] = "LORA";
  c["r"] = R;
  c["rank_pattern"] = json::object();
  c["revision"] = nullptr;
  c["target_modules"] = std::vector<std::string>(modules.begin(), modules.end());
  c["task_type"] = "CAUSAL_LM";
  c["use_dora"] = false;
  c["use_rslora"] = false;
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {kLoomTargetsKey, join(target_names(ck.lora.targets), ",")}};
  write_dir_atomically(out_dir, "PEFT output directory", [&](const std::string& staging) {
    write_checkpoint_tensors(staging, kAdapterWeights, tensors, meta);
    write_checkpoint_text(staging, kAdapterConfig, c.dump(2));
  });
  log << "mapping Loom adapters to PEFT modules:\n";
  for (const std::string& line : hf_mapping_summary(summary, /*to_hf=*/true)) log << "  " << line << "\n";
  log << "wrote " << out_dir << ": " << tensors.size() << " tensors, target_modules "
      << join(std::vector<std::string>(modules.begin(), modules.end()), " ") << "\n";
  if (!base.empty() && !is_hf_model_dir(base))
    log << "note: base_model_name_or_path " << base << " is no Hugging Face model directory; PEFT needs the HF "
        << "model: convert it with `loom convert --from loom:" << base << " --to hf:DIR` and export with --base DIR\n";
}

void convert_peft_to_loom(const std::string& peft_dir, const std::string& loom_root, const PeftImportOptions& opts,
                          std::ostream& log) {
  model_io_detail::check_new_loom_root(loom_root);
  std::error_code ec;
  if (!fs::is_directory(peft_dir, ec))
    user_error("--from peft:", peft_dir, " is not a directory (a PEFT adapter directory holds ", kAdapterConfig,
               " and ", kAdapterWeights, ")");
  const std::string cfg_path = (fs::path(peft_dir) / kAdapterConfig).string();
  const std::string st_path = (fs::path(peft_dir) / kAdapterWeights).string();
  if (!fs::is_regular_file(cfg_path, ec))
    user_error("PEFT directory ", peft_dir, " has no ", kAdapterConfig, " (a PEFT adapter directory holds ",
               kAdapterConfig, " and ", kAdapterWeights, ", as PeftModel.save_pretrained writes them)");
  const json c = read_json_file(cfg_path, "PEFT adapter config");
  if (!c.is_object()) user_error(cfg_path, " must hold a JSON object (PEFT's LoraConfig)");
  check_peft_settings(c, cfg_path);
  const int64_t r = number<int64_t>(c, "r", cfg_path, "an integer >= 1");
  if (r < 1) user_error(cfg_path, ": \"r\" must be >= 1, got ", r);
  const double alpha = number<double>(c, "lora_alpha", cfg_path, "a number > 0");
  if (!(alpha > 0) || !std::isfinite(float(alpha))) user_error(cfg_path, ": \"lora_alpha\" must be > 0, got ", alpha);
  const double dropout = c.contains("lora_dropout") ? number<double>(c, "lora_dropout", cfg_path, "a number in [0, 1)") : 0.0;
  if (!(dropout >= 0 && dropout < 1)) user_error(cfg_path, ": \"lora_dropout\" must be in [0, 1), got ", dropout);
  if (!c.contains("target_modules") || !c["target_modules"].is_array() || c["target_modules"].empty())
    user_error(cfg_path, ": \"target_modules\" must be a list of module names (", join(kPeftModules, ", "), "), got ",
               c.contains("target_modules") ? c["target_modules"].dump() : "nothing",
               c.contains("target_modules") && c["target_modules"].is_string() ? " (a regular expression, which Loom "
               "does not match: list the modules)" : "");
  std::vector<std::string> names;
  for (const json& n : c["target_modules"]) {
    const std::string name = n.is_string() ? n.get<std::string>() : n.dump();
    if (std::find(kPeftModules.begin(), kPeftModules.end(), name) == kPeftModules.end())
      user_error(cfg_path, ": target module '", name, "' has no LoRA place in Loom, which adapts ",
                 join(kPeftModules, ", "), " of a Llama-family model");
    names.push_back(name);
  }

  // The base: the architecture, and where the adapters' checkpoint will find the frozen weights.
  std::string base = opts.base;
  if (base.empty()) {
    const json b = c.contains("base_model_name_or_path") ? c["base_model_name_or_path"] : json();
    if (b.is_string() && fs::is_directory(b.get<std::string>(), ec)) base = b.get<std::string>();
    else
      user_error("--from peft:", peft_dir, " needs --base DIR: the model the adapters belong to (a Hugging Face model "
                 "directory or a Loom checkpoint); base_model_name_or_path ", b.dump(), " is no local directory");
  }
  const bool hf_base = is_hf_model_dir(base);
  if (!hf_base && is_lora_checkpoint(base))
    user_error("--base ", base, " is a LoRA checkpoint (adapters only), not the full model the adapters belong to");
  if (!hf_base && (opts.rotary_interleaved || opts.make_vocab_size_divisible_by))
    user_error(opts.rotary_interleaved ? "--rotary-interleaved" : "--make-vocab-size-divisible-by",
               " applies to a Hugging Face base; --base ", base, " is a Loom checkpoint, whose model_config says it");
  GPTConfig model = read_model_config(base, opts.make_vocab_size_divisible_by.value_or(128));
  if (opts.rotary_interleaved) {
    if (model.position_embedding_type != PositionEmbeddingType::kRope)
      user_error("--rotary-interleaved needs a RoPE model; --base ", base, " has none");
    model.rotary_interleaved = true;
  }
  std::vector<LoraTarget> targets;
  try {
    targets = parse_lora_targets(names, model);
  } catch (const UserError& e) {
    user_error(cfg_path, ": target_modules ", c["target_modules"].dump(), " on --base ", base, ": ", e.what());
  }

  if (!fs::is_regular_file(st_path, ec)) {
    if (fs::exists(fs::path(peft_dir) / "adapter_model.bin", ec))
      user_error("PEFT directory ", peft_dir, " holds adapter_model.bin (a PyTorch pickle), which Loom does not read; "
                 "save the adapter with safe_serialization=True (adapter_model.safetensors)");
    user_error("PEFT directory ", peft_dir, " has no ", kAdapterWeights);
  }
  const SafetensorsFile f = SafetensorsFile::open(st_path);
  const std::vector<LoraTarget> whole = recorded_whole_targets(f, model, r, targets, names, log);
  if (!whole.empty()) targets = whole;
  const std::vector<HfLoraMap> layout = hf_lora_layout(model, targets, r);

  // Every key, shape, rank and dtype, before anything is read.
  struct Expected {
    Shape shape;
    bool is_a;  // lora_A (r, in), else lora_B (out, r)
  };
  std::map<std::string, Expected> expected;
  for (const HfLoraMap& m : layout) {
    for (const std::string& a : m.hf_a) expected[a] = {m.a_shape, true};
    for (const HfPart& p : m.b.parts) expected[p.name] = {p.shape, false};
  }
  for (const std::string& name : f.names())
    if (!expected.count(name))
      user_error(st_path, ": unknown key '", name, "': with target_modules ", join(names, ", "), " Loom expects ",
                 kPeftPrefix, "model.layers.N.{self_attn,mlp}.<module>.lora_{A,B}.weight for layers 0..",
                 model.num_layers - 1, name.find(".default.") != std::string::npos ? " (PEFT saves keys without the "
                 "adapter name '.default')" : "");
  for (const auto& [name, want] : expected) {
    if (!f.contains(name))
      user_error(st_path, " has no tensor '", name, "', which target_modules ", join(names, ", "), " implies for a ",
                 model.num_layers, "-layer base");
    const SafetensorsInfo& info = f.info(name);
    if ((!info.dtype || !dtype_is_float(*info.dtype)) && info.dtype_str != "F64")
      user_error(st_path, ": tensor '", name, "' has dtype ", info.dtype_str, "; adapters must be F32, BF16, F16 or F64");
    const int rank_dim = want.is_a ? 0 : 1;
    if (info.shape.ndim() == 2 && info.shape[rank_dim] != r)
      user_error(st_path, ": tensor '", name, "' has rank ", info.shape[rank_dim], " (shape ", info.shape.str(),
                 ") but ", kAdapterConfig, " has r = ", r);
    if (info.shape != want.shape)
      user_error(st_path, ": tensor '", name, "' has shape ", info.shape.str(), " but the base ", base, " needs ",
                 want.shape.str(), " for its ", want.is_a ? "lora_A (r, in)" : "lora_B (out, r)");
  }

  std::vector<Tensor> keep;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const HfLoraMap& m : layout) {
    keep.push_back(f.read(m.hf_a[0], DType::kF32));
    tensors.emplace_back(m.loom_a, keep.back());
    std::vector<Tensor> parts;
    std::vector<TensorView> views;
    for (const HfPart& p : m.b.parts) {
      parts.push_back(f.read(p.name, DType::kF32));
      views.push_back(parts.back());
    }
    keep.push_back(Tensor::empty(m.b.loom_shape, DType::kF32));
    hf_to_loom(m.b, views, keep.back());
    tensors.emplace_back(m.b.loom_name, keep.back());
  }
  const std::string abs_base = fs::absolute(base).lexically_normal().string();
  const json lora = {{"rank", r},
                     {"alpha", float(alpha)},
                     {"dropout", float(dropout)},
                     {"target_modules", target_names(targets)},
                     {"base", abs_base}};
  model_io_detail::write_weights_checkpoint(
      loom_root, model, tensors, {{"lora", lora}, {"converted_from", {{"format", "peft"}, {"dir", peft_dir}}}});
  log << "converted PEFT adapter " << peft_dir << " (r " << r << ", lora_alpha " << alpha << ", target_modules "
      << join(names, " ") << ") for the base " << abs_base << " to a Loom LoRA checkpoint: "
      << checkpoint_dir(loom_root, 0) << " (" << tensors.size() << " adapter tensors, targets "
      << join(target_names(targets), " ") << ")\n"
      << "train on from it with `loom train <the base's model flags> --lora-rank " << r << " --lora-alpha "
      << tidy_float(float(alpha)) << " --lora-target-modules " << join(target_names(targets), " ") << " --load "
      << loom_root << " --finetune ...`\n";
}

}  // namespace loom
