// Hugging Face model directories (layout and guarantees in include/loom/ckpt/hf_dir.h): the index, the
// shards, the reader and the writer; config.json's fields are hf_config.cpp's.
// Every value taken from the index is type- and range-checked before use. A JSON object with a repeated
// key is rejected: Python's json keeps the last value silently, and a weight_map that lists a tensor
// twice is exactly the inconsistency this reader exists to catch.
#include "loom/ckpt/hf_dir.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loom/core/file_io.h"
#include "json_no_duplicates.h"
#include "loom/ckpt/checkpoint.h"

namespace loom {

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ckpt_io::parse_json_strict;
using ckpt_io::shown;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kConfigFile = "config.json";
// config.json and the index are a few KB to a few hundred KB; anything this big is the wrong file.
constexpr int64_t kMaxJsonFileBytes = int64_t(256) << 20;

std::string join(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

std::string read_small_file(const std::string& path, const std::string& what) {
  return read_file(path, what, kMaxJsonFileBytes);
}

}  // namespace

HfIndex parse_hf_index(const std::string& json_text, const std::string& path) {
  const Json j = parse_json_strict(json_text, path);
  HfIndex idx;
  if (j.contains("metadata") && !j.at("metadata").is_null()) {
    const Json& m = j.at("metadata");
    if (!m.is_object()) user_error(path, ": field 'metadata': expected an object, got ", shown(m));
    if (m.contains("total_size") && !m.at("total_size").is_null()) {
      const Json& t = m.at("total_size");
      // Some writers store it as a float; it is informational (the shards' headers are authoritative).
      if (!t.is_number() || !(t.get<double>() >= 0.0) || !(t.get<double>() < 9.2e18))
        user_error(path, ": field 'metadata.total_size': expected a non-negative number, got ", shown(t));
      idx.total_size = t.is_number_integer() ? t.get<int64_t>() : int64_t(t.get<double>());
    }
  }
  if (!j.contains("weight_map")) user_error(path, ": missing field 'weight_map'");
  const Json& wm = j.at("weight_map");
  if (!wm.is_object()) user_error(path, ": field 'weight_map': expected an object, got ", shown(wm));
  if (wm.empty()) user_error(path, ": field 'weight_map' lists no tensors");
  for (auto it = wm.begin(); it != wm.end(); ++it) {
    if (it.key().empty()) user_error(path, ": weight_map has a tensor with an empty name");
    if (!it.value().is_string())
      user_error(path, ": weight_map: tensor '", it.key(), "': expected a file name, got ", shown(it.value()));
    const std::string file = it.value().get<std::string>();
    // Shards live next to the index; anything else could make the reader open arbitrary files.
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
        file.find('\0') != std::string::npos)
      user_error(path, ": weight_map: tensor '", it.key(), "': '", file,
                 "' is not a plain file name in the model directory");
    idx.weight_map.emplace(it.key(), file);
  }
  return idx;
}

// ---- reader -------------------------------------------------------------------------------------

HfCheckpoint HfCheckpoint::open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) user_error("HF model directory '", dir, "' does not exist or is not a directory");
  HfCheckpoint ck;
  ck.dir_ = dir;
  const std::string config_path = join(dir, kConfigFile);
  ck.config_ = parse_hf_config(read_small_file(config_path, "HF config"), config_path);

  const std::string single = join(dir, kSingleFile), index_path = join(dir, kIndexFile);
  if (fs::exists(single, ec)) {
    ck.files_.push_back(SafetensorsFile::open(single));
    for (const std::string& n : ck.files_[0].names()) ck.where_.emplace(n, 0);
  } else if (fs::exists(index_path, ec)) {
    ck.sharded_ = true;
    const HfIndex idx = parse_hf_index(read_small_file(index_path, "HF index"), index_path);
    std::map<std::string, size_t> file_slot;  // shard name -> index into files_
    std::vector<std::string> shard_names;
    for (const auto& [tensor, file] : idx.weight_map) {
      if (file_slot.count(file)) continue;
      const std::string shard_path = join(dir, file);
      if (!fs::is_regular_file(shard_path, ec))
        user_error(index_path, ": weight_map puts tensor '", tensor, "' in '", file,
                   "', which does not exist in the model directory");
      file_slot.emplace(file, ck.files_.size());
      shard_names.push_back(file);
      ck.files_.push_back(SafetensorsFile::open(shard_path));
    }
    // Where each tensor really is, across all shards.
    std::map<std::string, size_t> stored;
    for (size_t s = 0; s < ck.files_.size(); ++s)
      for (const std::string& n : ck.files_[s].names()) {
        auto [it, fresh] = stored.emplace(n, s);
        if (!fresh)
          user_error(index_path, ": tensor '", n, "' is stored twice, in '", shard_names[it->second], "' and in '",
                     shard_names[s], "'");
      }
    for (const auto& [tensor, file] : idx.weight_map) {
      const size_t want = file_slot.at(file);
      auto it = stored.find(tensor);
      if (it == stored.end())
        user_error(index_path, ": weight_map puts tensor '", tensor, "' in '", file,
                   "' but none of the shards the index names holds it");
      if (it->second != want)
        user_error(index_path, ": weight_map puts tensor '", tensor, "' in '", file, "' but it is in '",
                   shard_names[it->second], "'");
    }
    for (const auto& [tensor, s] : stored)
      if (!idx.weight_map.count(tensor))
        user_error(index_path, ": shard '", shard_names[s], "' holds tensor '", tensor,
                   "', which weight_map does not list");
    ck.where_ = std::move(stored);
  } else {
    user_error("HF model directory '", dir, "' has neither ", kSingleFile, " nor ", kIndexFile,
               " (pytorch_model.bin checkpoints are not read: convert them to safetensors)");
  }
  for (const auto& [name, s] : ck.where_) ck.total_bytes_ += ck.files_[s].info(name).nbytes();
  return ck;
}

std::vector<std::string> HfCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, s] : where_) out.push_back(name);
  return out;
}

const SafetensorsFile& HfCheckpoint::file(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    std::string some;
    size_t k = 0;
    for (auto w = where_.begin(); w != where_.end() && k < 5; ++w, ++k) some += (k ? ", " : "") + w->first;
    if (where_.size() > 5) some += ", ...";
    user_error("HF model directory '", dir_, "': no tensor named '", name, "' (", where_.size(), " tensors: ", some,
               ")");
  }
  return files_[it->second];
}

const SafetensorsInfo& HfCheckpoint::info(const std::string& name) const { return file(name).info(name); }
const std::string& HfCheckpoint::file_of(const std::string& name) const { return file(name).path(); }

Tensor HfCheckpoint::read(const std::string& name, DType as) const {
  try {
    return file(name).read(name, as);
  } catch (const ChecksumError& e) {
    damaged(e);
  }
}

void HfCheckpoint::read_into(const std::string& name, TensorView dst) const {
  try {
    file(name).read_into(name, dst);
  } catch (const ChecksumError& e) {
    damaged(e);
  }
}

void HfCheckpoint::damaged(const ChecksumError& e) const {
  throw ChecksumError(detail::concat("Hugging Face model directory ", dir_, " is damaged: ", e.what(),
                                     "; convert or download it again"),
                      e.path(), e.tensor());
}

std::string HfCheckpoint::checksum_note() const {
  std::vector<std::string> unchecked;
  for (const SafetensorsFile& f : files_)
    if (!f.has_checksums()) unchecked.push_back(fs::path(f.path()).filename().string());
  if (unchecked.empty()) return "";
  const std::string which = unchecked.size() == files_.size() && files_.size() > 1
                                ? "its " + std::to_string(files_.size()) + " safetensors files record"
                                : unchecked.front() + (unchecked.size() > 1 ? " and " + std::to_string(unchecked.size() - 1) +
                                                       " more files record" : " records");
  return "note: " + dir_ + ": " + which + " no checksums (written by another tool, or by Loom before it recorded "
         "them), so its tensors cannot be verified as they load";
}

// ---- writer -------------------------------------------------------------------------------------

namespace {

std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// transformers' split: in order; a tensor that would push the open shard past the limit starts a new one;
// a tensor bigger than the limit on its own gets a shard to itself (the open shard stays open).
std::vector<NamedTensors> plan_shards(const NamedTensors& tensors, int64_t max_bytes) {
  std::vector<NamedTensors> shards;
  NamedTensors cur;
  int64_t cur_bytes = 0;
  for (const auto& nt : tensors) {
    const int64_t b = nt.second.nbytes();
    if (b > max_bytes) {
      shards.push_back({nt});
      continue;
    }
    if (cur_bytes + b > max_bytes && !cur.empty()) {
      shards.push_back(std::move(cur));
      cur = {};
      cur_bytes = 0;
    }
    cur.push_back(nt);
    cur_bytes += b;
  }
  if (!cur.empty() || shards.empty()) shards.push_back(std::move(cur));
  return shards;
}

}  // namespace

void write_hf_dir(const std::string& dir_in, const std::string& config_json, const NamedTensors& tensors,
                  int64_t max_shard_bytes, const std::map<std::string, std::string>& extra_files) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty()) user_error("write_hf_dir: empty output directory name");
  parse_hf_config(config_json, "config.json to be written to '" + dir + "'");
  if (max_shard_bytes < 1) user_error("HF max shard size must be at least 1 byte, got ", max_shard_bytes);
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors)
    if (!seen.insert(name).second) user_error("writing HF model directory '", dir, "': tensor '", name, "' given twice");
  for (const auto& [name, bytes] : extra_files)
    if (name == kConfigFile || name == kIndexFile || name == kSingleFile ||
        (name.rfind("model-", 0) == 0 && name.size() > 12 && name.ends_with(".safetensors")))
      user_error("writing HF model directory '", dir, "': extra file '", name, "' would replace a file Loom writes");

  write_dir_atomically(dir, "HF output directory", [&](const std::string& staging) {
    const std::vector<NamedTensors> shards = plan_shards(tensors, max_shard_bytes);
    const std::map<std::string, std::string> meta = {{"format", "pt"}};
    if (shards.size() == 1) {
      write_checkpoint_tensors(staging, kSingleFile, shards[0], meta);
    } else {
      nlohmann::json index;  // std::map-backed: keys sorted, as transformers writes them
      int64_t total = 0;
      for (size_t i = 0; i < shards.size(); ++i) {
        const std::string name = shard_name(i, shards.size());
        write_checkpoint_tensors(staging, name, shards[i], meta);
        for (const auto& [tensor, t] : shards[i]) {
          index["weight_map"][tensor] = name;
          total += t.nbytes();
        }
      }
      index["metadata"]["total_size"] = total;
      write_checkpoint_text(staging, kIndexFile, index.dump(2) + "\n");
    }
    write_checkpoint_text(staging, kConfigFile, config_json);
    for (const auto& [name, bytes] : extra_files) write_checkpoint_text(staging, name, bytes);
  });
}

void write_dir_atomically(const std::string& dir_in, const std::string& what,
                          const std::function<void(const std::string& staging)>& fill) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty()) user_error(what, ": empty directory name");
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec))) {
    if (!fs::is_directory(dir, ec) || !fs::is_empty(dir, ec))
      user_error(what, " '", dir, "' already exists and is not an empty directory; remove it or choose another");
  }
  const fs::path parent = fs::path(dir).parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) user_error("cannot create '", parent.string(), "': ", ec.message());
  }
  const std::string staging = dir + ".loom-staging";
  fs::remove_all(staging, ec);  // left by a crashed write of this same directory
  if (!fs::create_directory(staging, ec))
    user_error("cannot create staging directory '", staging, "': ", ec ? ec.message() : "it exists");
  try {
    fill(staging);
    fsync_dir(staging);
    // rename(2) replaces an empty directory atomically and fails on a non-empty one, so a directory
    // that appeared since the check above is never clobbered.
    if (::rename(staging.c_str(), dir.c_str()) != 0)
      user_error("renaming '", staging, "' to '", dir, "' failed: ", std::strerror(errno));
    fsync_dir(parent.empty() ? "." : parent.string());
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
}

}  // namespace loom
