// Checkpoint directories with atomic commits (layout and crash-safety argument in
// include/loom/ckpt/checkpoint.h). Every step that makes a checkpoint visible is a rename, and every
// rename is preceded by an fsync of what it publishes and followed by an fsync of the directory holding
// it, so the on-disk order of events is the program order even across a power loss.
#include "loom/ckpt/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "loom/core/file_io.h"

namespace loom {

namespace {

namespace fs = std::filesystem;

constexpr const char* kTrackerName = "latest_checkpointed_iteration.txt";
constexpr const char* kStagingSuffix = ".loom-staging";
constexpr const char* kOldSuffix = ".loom-old";

std::string errno_text() { return std::strerror(errno); }

std::string join(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

// <dir>/<name> via <name>.tmp + fsync + rename + fsync dir, so readers see the old file or the new one.
void write_text_atomic(const std::string& dir, const std::string& name, const std::string& text) {
  write_file_atomic(join(dir, name), text);
}

void rename_or_fail(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    user_error("renaming checkpoint directory '", from, "' to '", to, "' failed: ", errno_text());
}

void remove_all_or_fail(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) user_error("cannot remove stale checkpoint directory '", path, "': ", ec.message());
}

void check_file_name(const std::string& staging, const std::string& filename) {
  if (filename.empty() || filename == "." || filename == ".." || filename.find('/') != std::string::npos)
    user_error("checkpoint file name '", filename, "' (in '", staging, "') must be a plain file name without '/'");
}

// "iter_<at least 7 digits><suffix>" -> the "iter_<digits>" part; empty when `name` is not of that form.
std::string match_iter_with_suffix(const std::string& name, const std::string& suffix) {
  const std::string prefix = "iter_";
  if (name.size() < prefix.size() + 7 + suffix.size()) return "";
  if (name.compare(0, prefix.size(), prefix) != 0) return "";
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return "";
  const std::string base = name.substr(0, name.size() - suffix.size());
  for (size_t i = prefix.size(); i < base.size(); ++i)
    if (base[i] < '0' || base[i] > '9') return "";
  return base;
}

// Leftovers of saves that were killed part-way (see the header for what is removed and why that is safe).
void clean_up_crashed_saves(const std::string& root) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec))
    names.push_back(it->path().filename().string());
  if (ec) user_error("cannot list checkpoint directory '", root, "': ", ec.message());

  bool changed = false;
  for (const std::string& name : names) {
    const std::string path = join(root, name);
    if (!match_iter_with_suffix(name, kStagingSuffix).empty()) {
      remove_all_or_fail(path);
      changed = true;
    } else if (std::string base = match_iter_with_suffix(name, kOldSuffix); !base.empty()) {
      // A rename-aside replace was interrupted. If the new dir made it to the final name the old one is
      // garbage; otherwise the old one is the only complete copy and goes back to its name.
      const std::string final_dir = join(root, base);
      if (fs::exists(fs::symlink_status(final_dir))) remove_all_or_fail(path);
      else rename_or_fail(path, final_dir);
      changed = true;
    } else if (is_atomic_write_leftover(name, kTrackerName)) {
      remove_all_or_fail(path);
      changed = true;
    }
  }
  if (changed) fsync_dir(root);
}

void commit_impl(const std::string& root, int64_t iteration, bool allow_exchange) {
  const std::string staging = checkpoint_staging_dir(root, iteration);
  const std::string final_dir = checkpoint_dir(root, iteration);
  std::error_code ec;
  if (!fs::is_directory(staging, ec))
    user_error("cannot commit checkpoint of iteration ", iteration, ": its staging directory '", staging,
               "' does not exist (begin_checkpoint was not called, or the directory was removed)");
  fsync_dir(staging);

  if (!fs::exists(fs::symlink_status(final_dir))) {
    rename_or_fail(staging, final_dir);
  } else {
    bool swapped = false;
    if (allow_exchange) {
      if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0)
        swapped = true;
      else if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
        user_error("swapping checkpoint directory '", staging, "' with '", final_dir, "' failed: ", errno_text());
    }
    if (swapped) {
      // The old checkpoint now sits at the staging name; make the swap durable before deleting it.
      fsync_dir(root);
      remove_all_or_fail(staging);
    } else {
      const std::string old = final_dir + kOldSuffix;
      remove_all_or_fail(old);  // the final dir exists, so an old one from an earlier crash is garbage
      rename_or_fail(final_dir, old);
      rename_or_fail(staging, final_dir);
      fsync_dir(root);
      remove_all_or_fail(old);
    }
  }
  fsync_dir(root);
  // Last: only now does anyone loading from root see the new checkpoint.
  write_text_atomic(root, kTrackerName, std::to_string(iteration));
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (int i = 0; i < s.ndim(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string stored_dtype_str(const SafetensorsInfo& info) {
  return info.dtype ? dtype_name(*info.dtype) : info.dtype_str;
}

}  // namespace

std::string checkpoint_dir(const std::string& root, int64_t iteration) {
  LOOM_CHECK(iteration >= 0, "[ckpt] iteration must be non-negative, got ", iteration);
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  return join(root, name);
}

std::string checkpoint_staging_dir(const std::string& root, int64_t iteration) {
  return checkpoint_dir(root, iteration) + kStagingSuffix;
}

std::string checkpoint_tracker_path(const std::string& root) { return join(root, kTrackerName); }

std::string begin_checkpoint(const std::string& root, int64_t iteration) {
  const std::string staging = checkpoint_staging_dir(root, iteration);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec || !fs::is_directory(root))
    user_error("cannot create checkpoint directory '", root, "' (--save): ",
               ec ? ec.message() : "it exists and is not a directory");
  clean_up_crashed_saves(root);  // removes a stale staging dir of this iteration too
  if (!fs::create_directory(staging, ec) || ec)
    user_error("cannot create checkpoint staging directory '", staging, "': ",
               ec ? ec.message() : "it already exists");
  fsync_dir(root);
  return staging;
}

void write_checkpoint_tensors(const std::string& staging, const std::string& filename, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata) {
  check_file_name(staging, filename);
  write_safetensors(join(staging, filename), tensors, metadata);  // tmp + fsync + rename + fsync dir
}

void write_checkpoint_text(const std::string& staging, const std::string& filename, const std::string& text) {
  check_file_name(staging, filename);
  write_text_atomic(staging, filename, text);
}

void commit_checkpoint(const std::string& root, int64_t iteration) { commit_impl(root, iteration, true); }

void detail::commit_checkpoint_without_exchange(const std::string& root, int64_t iteration) {
  commit_impl(root, iteration, false);
}

std::optional<LatestCheckpoint> read_latest_checkpoint(const std::string& root) {
  const std::string tracker = checkpoint_tracker_path(root);
  std::error_code ec;
  const fs::file_status st = fs::status(tracker, ec);
  // Only a tracker that is really absent means a fresh start; one we cannot look at (permissions, I/O)
  // must not silently restart training from scratch.
  if (st.type() == fs::file_type::none)
    user_error("cannot access checkpoint tracker '", tracker, "': ", ec.message());
  if (!fs::exists(st)) return std::nullopt;
  if (!fs::is_regular_file(st)) user_error("checkpoint tracker '", tracker, "' is not a regular file");
  std::string text = read_file(tracker, "checkpoint tracker");
  const char* space = " \t\r\n\v\f";
  const size_t first = text.find_first_not_of(space);
  text = first == std::string::npos ? "" : text.substr(first, text.find_last_not_of(space) - first + 1);

  if (text.empty())
    user_error("checkpoint tracker '", tracker, "' is empty; it must hold the iteration number of the latest "
               "checkpoint or 'release' (delete it to start from scratch)");
  LatestCheckpoint latest;
  if (text == "release") {
    latest.release = true;
    latest.dir = join(root, "release");
  } else {
    int64_t it = -1;
    const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), it);
    const bool digits_only = text.find_first_not_of("0123456789") == std::string::npos;
    if (!digits_only || err != std::errc() || end != text.data() + text.size()) {
      const std::string shown = text.size() > 64 ? text.substr(0, 64) + "..." : text;
      user_error("checkpoint tracker '", tracker, "' must hold a non-negative iteration number or 'release', got '",
                 shown, "'");
    }
    latest.iteration = it;
    latest.dir = checkpoint_dir(root, it);
  }
  if (!fs::is_directory(latest.dir, ec)) {
    // An interrupted rename-aside replace (see the header): the old copy is complete and still valid.
    if (fs::is_directory(latest.dir + kOldSuffix, ec)) {
      latest.dir += kOldSuffix;
    } else {
      user_error("checkpoint tracker '", tracker, "' names ", latest.release ? "'release'" : "iteration " + text,
                 " but the directory '", latest.dir, "' does not exist");
    }
  }
  return latest;
}

std::vector<int64_t> list_checkpoint_iterations(const std::string& root) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (match_iter_with_suffix(name, "").empty() || !it->is_directory(ec)) continue;
    int64_t v = 0;
    const auto [p, err] = std::from_chars(name.data() + 5, name.data() + name.size(), v);
    if (err == std::errc() && p == name.data() + name.size()) out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string other_checkpoints_hint(const std::string& dir) {
  fs::path d = fs::path(dir).lexically_normal();
  if (d.filename().empty()) d = d.parent_path();  // a trailing '/'
  const std::string root = d.parent_path().empty() ? "." : d.parent_path().string();
  const std::string base = match_iter_with_suffix(d.filename().string(), kOldSuffix);
  const std::string self = base.empty() ? d.filename().string() : base;
  std::vector<int64_t> others;
  for (int64_t it : list_checkpoint_iterations(root))
    if (fs::path(checkpoint_dir(root, it)).filename() != self) others.push_back(it);
  if (others.empty()) return "there is no other checkpoint in " + root + " to fall back to";
  std::string list;
  const size_t shown = 12;  // the most recent ones: those a user falls back to
  const size_t from = others.size() > shown ? others.size() - shown : 0;
  if (from > 0) list = "... ";
  for (size_t i = from; i < others.size(); ++i) list += (i > from ? ", " : "") + std::to_string(others[i]);
  return detail::concat("other checkpoints in ", root, ": iteration", others.size() > 1 ? "s " : " ", list,
                        " (resume from one with loom train --load ", root, " --ckpt-step N; loom generate and loom "
                        "convert take its directory, e.g. ", checkpoint_dir(root, others.back()), ")");
}

void load_tensors_checked(const SafetensorsFile& file, const NamedTensors& into, bool allow_extra) {
  const std::string& path = file.path();
  std::set<std::string> wanted;
  for (const auto& [name, dst] : into) {
    LOOM_CHECK(wanted.insert(name).second, "[ckpt] tensor '", name, "' is listed twice for loading from ", path);
    LOOM_CHECK(dst.device().is_cpu(), "[ckpt] tensor '", name, "' must be loaded into host memory, got ", dst.desc());
    LOOM_CHECK(dst.defined() || dst.nbytes() == 0, "[ckpt] tensor '", name, "' has no destination memory");
    const std::string expected = shape_str(dst.shape()) + " " + dtype_name(dst.dtype());
    if (!file.contains(name)) {
      std::string some;
      const auto& names = file.names();
      for (size_t i = 0; i < names.size() && i < 3; ++i) some += (i ? ", " : "") + names[i];
      if (names.size() > 3) some += ", ...";
      user_error("checkpoint file ", path, " has no tensor ", name, " (this model expects ", expected, "); the file has ",
                 names.size(), " tensors", names.empty() ? "" : ": " + some);
    }
    const SafetensorsInfo& info = file.info(name);
    if (info.dtype != dst.dtype() || info.shape != dst.shape())
      user_error("checkpoint tensor ", name, " in ", path, " has shape ", shape_str(info.shape), " ",
                 stored_dtype_str(info), "; this model expects ", expected);
  }
  if (!allow_extra) {
    std::vector<std::string> extra;
    for (const std::string& n : file.names())
      if (!wanted.count(n)) extra.push_back(n);
    if (!extra.empty())
      user_error("checkpoint file ", path, " has tensor ", extra.front(), " (", shape_str(file.info(extra.front()).shape),
                 " ", stored_dtype_str(file.info(extra.front())), ") that this model does not have",
                 extra.size() > 1 ? " (and " + std::to_string(extra.size() - 1) + " more)" : std::string(),
                 "; was it saved with a different model configuration?");
  }
  for (const auto& [name, dst] : into) file.read_into(name, dst);
}

}  // namespace loom
