// YAML config files spliced into the command line (rules in include/loom/train/config_file.h).
// Scalars are passed on as the text the file spells them with, never re-formatted through a number type,
// so what the flag parser sees is what the user wrote. Single values use "--key=value" so that a value
// can never be mistaken for a flag and a value given to a switch is reported as such.
#include "loom/train/config_file.h"

// yaml-cpp 0.7's node headers trip GCC 12's -Wdangling-pointer (a false positive inside the library).
#pragma GCC diagnostic push
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic ignored "-Wdangling-pointer"
#endif
#include <yaml-cpp/yaml.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cctype>
#include <sstream>

#include "loom/core/file_io.h"

namespace loom {

namespace {

std::string normalize_flag(const std::string& raw) {
  std::string name = raw.rfind("--", 0) == 0 ? raw.substr(2) : raw;
  std::replace(name.begin(), name.end(), '_', '-');
  return "--" + name;
}

bool is_true_literal(const std::string& s) { return s == "true" || s == "True" || s == "TRUE"; }
bool is_false_literal(const std::string& s) { return s == "false" || s == "False" || s == "FALSE"; }

// A plain (unquoted) scalar; quoted ones carry the "!" tag in yaml-cpp.
bool is_plain(const YAML::Node& n) { return n.Tag() == "?"; }

int64_t line_of(const YAML::Node& n) { return int64_t(n.Mark().line) + 1; }

[[noreturn]] void fail_at(const std::string& path, int64_t line, const std::string& what) {
  user_error("config file '", path, "', line ", line, ": ", what);
}



// The file's tokens, except for flags in `overridden`; appends one ConfigFileKey per key.
std::vector<std::string> config_tokens(const std::string& path, const std::set<std::string>& overridden,
                                       std::vector<ConfigFileKey>& keys) {
  YAML::Node root;
  try {
    root = YAML::Load(read_file(path, "--config: config file"));
  } catch (const YAML::Exception& e) {  // ParserException and the rest carry the position
    user_error("config file '", path, "', line ", e.mark.line + 1, ", column ", e.mark.column + 1,
               ": invalid YAML: ", e.msg);
  }
  if (root.IsNull()) return {};  // empty, or only comments
  if (!root.IsMap())
    fail_at(path, line_of(root), "the top level must be a mapping of flag names to values (num-layers: 12)");

  std::vector<std::string> tokens;
  std::set<std::string> seen;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const YAML::Node& k = it->first;
    const YAML::Node& v = it->second;
    const int64_t line = line_of(k);
    if (!k.IsScalar() || k.Scalar().empty()) fail_at(path, line, "a key must be a flag name");
    const std::string raw = k.Scalar();
    if (raw.find_first_of(" \t=") != std::string::npos || raw == "--" || raw.rfind("---", 0) == 0 ||
        (raw[0] == '-' && raw.rfind("--", 0) != 0))
      fail_at(path, line, "'" + raw + "' is not a flag name (write it as in num-layers: 12)");
    const std::string flag = normalize_flag(raw);
    if (flag == "--config") fail_at(path, line, "a config file cannot include another (--config)");
    if (!seen.insert(flag).second) fail_at(path, line, flag + " is set twice in this file");
    keys.push_back({flag, line, overridden.count(flag) != 0});

    if (keys.back().overridden) continue;
    if (v.IsNull()) continue;  // "key:" / "key: null": the flag's default
    if (v.IsScalar()) {
      const std::string s = v.Scalar();
      if (is_plain(v) && is_true_literal(s)) tokens.push_back(flag);
      else if (is_plain(v) && is_false_literal(s)) continue;
      else tokens.push_back(flag + "=" + s);
      continue;
    }
    if (v.IsSequence()) {
      if (v.size() == 0) fail_at(path, line, flag + ": an empty list gives the flag no values; leave the key out");
      tokens.push_back(flag);
      for (const YAML::Node& item : v) {
        if (!item.IsScalar())
          fail_at(path, line_of(item), flag + ": list items must be plain values, not lists, mappings or null");
        if (item.Scalar().rfind("--", 0) == 0)
          fail_at(path, line_of(item), flag + ": list item '" + item.Scalar() + "' would be read as a flag");
        tokens.push_back(item.Scalar());
      }
      continue;
    }
    fail_at(path, line, flag + ": the value must be a scalar or a list of scalars, not a mapping");
  }
  return tokens;
}

// Position of `flag` in `msg` as a whole flag name (not a prefix of a longer one), or npos.
size_t find_flag(const std::string& msg, const std::string& flag) {
  for (size_t pos = msg.find(flag); pos != std::string::npos; pos = msg.find(flag, pos + 1)) {
    const size_t end = pos + flag.size();
    const bool whole = end == msg.size() || !(std::isalnum(static_cast<unsigned char>(msg[end])) || msg[end] == '-' ||
                                              msg[end] == '_');
    if (whole) return pos;
  }
  return std::string::npos;
}

}  // namespace

ConfigFileExpansion expand_config_file_traced(const std::vector<std::string>& args) {
  ConfigFileExpansion ex;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    std::string file;
    if (a == "--config") {
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) user_error("--config needs a value (FILE)");
      file = args[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      file = a.substr(9);
      if (file.empty()) user_error("--config needs a value (FILE)");
    } else {
      rest.push_back(a);
      if (a.rfind("--", 0) == 0) ex.command_line_flags.insert(normalize_flag(a.substr(0, a.find('='))));
      continue;
    }
    if (!ex.path.empty()) user_error("--config given twice ('", ex.path, "' and '", file, "'); give one file");
    ex.path = file;
  }
  if (ex.path.empty()) {
    ex.args = args;
    return ex;
  }
  ex.args = config_tokens(ex.path, ex.command_line_flags, ex.keys);
  ex.args.insert(ex.args.end(), rest.begin(), rest.end());
  return ex;
}

std::vector<std::string> expand_config_file(const std::vector<std::string>& args) {
  return expand_config_file_traced(args).args;
}

std::string annotate_config_error(const std::string& message, const ConfigFileExpansion& ex) {
  if (ex.path.empty()) return message;
  const ConfigFileKey* first = nullptr;
  size_t first_pos = std::string::npos;
  for (const ConfigFileKey& k : ex.keys)
    if (const size_t pos = find_flag(message, k.flag); !k.overridden && pos < first_pos) {
      first_pos = pos;
      first = &k;
    }
  if (!first) return message;
  return detail::concat(message, " (", first->flag, " is set in config file '", ex.path, "', line ", first->line, ")");
}

}  // namespace loom
