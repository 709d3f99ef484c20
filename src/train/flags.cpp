#include "loom/train/flags.h"

#include <algorithm>
#include <charconv>
#include <sstream>

#include "loom/core/check.h"

namespace loom {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

int64_t parse_int_flag(const std::string& flag, const std::string& v) {
  int64_t out = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), out);
  if (r.ec != std::errc() || r.ptr != v.data() + v.size()) user_error(flag, ": expected an integer, got '", v, "'");
  return out;
}

int64_t parse_positive_flag(const std::string& flag, const std::string& v, int64_t max) {
  const int64_t n = parse_int_flag(flag, v);
  if (n < 1) user_error(flag, " must be >= 1, got ", v);
  if (n > max) user_error(flag, " ", v, " is too large (at most ", max, ")");
  return n;
}

double parse_float_flag(const std::string& flag, const std::string& v) {
  try {
    size_t pos = 0;
    const double d = std::stod(v, &pos);
    if (pos == v.size()) return d;
  } catch (const std::exception&) {
  }
  user_error(flag, ": expected a number, got '", v, "'");
}

namespace {

size_t lookup(const std::vector<FlagInfo>& table, const std::string& name, const std::vector<std::string>& unsupported,
              const std::string& tool) {
  for (size_t i = 0; i < table.size(); ++i)
    if (table[i].name == name) return i;
  for (const std::string& u : unsupported)
    if (u == name) user_error(name, " (a flag of ", tool, ") is not supported by Loom yet");
  std::vector<size_t> prefixed;  // argparse's allow_abbrev: a unique prefix names the flag
  for (size_t i = 0; i < table.size(); ++i)
    if (table[i].name.rfind(name, 0) == 0) prefixed.push_back(i);
  if (prefixed.size() == 1 && name.size() > 2) return prefixed[0];
  if (prefixed.size() > 1 && name.size() > 2) {
    std::string list;
    for (size_t i : prefixed) list += (list.empty() ? "" : ", ") + table[i].name;
    user_error("ambiguous flag ", name, " (could be ", list, ")");
  }
  size_t best = 0, best_d = ~size_t(0);
  for (size_t i = 0; i < table.size(); ++i)
    if (const size_t d = edit_distance(name, table[i].name); d < best_d) {
      best_d = d;
      best = i;
    }
  user_error("unknown flag ", name, table.empty() ? std::string() : " (did you mean " + table[best].name + "?)");
}

}  // namespace

std::vector<ParsedFlag> parse_flags(const std::vector<FlagInfo>& table, const std::vector<std::string>& args,
                                    const std::vector<std::string>& unsupported, const std::string& tool) {
  std::vector<ParsedFlag> out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], inline_value;
    bool has_inline = false;
    if (name.rfind("--", 0) != 0) user_error("unexpected argument '", name, "' (flags start with --)");
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline = true;
    }
    std::replace(name.begin() + 2, name.end(), '_', '-');
    const size_t idx = lookup(table, name, unsupported, tool);
    const FlagInfo& f = table[idx];
    ParsedFlag p{idx, {}};
    if (f.arity == Arity::kSwitch) {
      if (has_inline) user_error(f.name, " takes no value");
    } else if (has_inline) {
      p.values.push_back(inline_value);
    } else {
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        p.values.push_back(args[++i]);
        if (f.arity == Arity::kOne) break;
      }
      if (p.values.empty())
        user_error(f.name, f.arity == Arity::kOne ? " needs a value (" : " needs at least one value (", f.metavar, ")");
    }
    // argparse stores a repeated flag's values again: the last occurrence wins, also for multi-value
    // flags (--data-path a --data-path b means [b], not [a, b]).
    std::erase_if(out, [&](const ParsedFlag& q) { return q.index == idx && f.arity == Arity::kOneOrMore; });
    out.push_back(std::move(p));
  }
  return out;
}

std::string flags_help(const std::string& usage, const std::vector<FlagInfo>& table) {
  std::ostringstream os;
  os << usage << "\n\n";
  for (const FlagInfo& f : table) {
    std::string lhs = "  " + f.name + (f.metavar.empty() ? "" : " " + f.metavar);
    if (lhs.size() < 40) lhs.resize(40, ' ');
    os << lhs << " " << f.help << "\n";
  }
  return os.str();
}

}  // namespace loom
