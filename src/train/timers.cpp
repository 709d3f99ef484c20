#include "loom/train/timers.h"

#include <cmath>
#include <cstdio>

#include "loom/core/check.h"

namespace loom {

Timers::Timer* Timers::find(const std::string& name) {
  for (Timer& t : timers_)
    if (t.name == name) return &t;
  return nullptr;
}

const Timers::Timer* Timers::find(const std::string& name) const {
  for (const Timer& t : timers_)
    if (t.name == name) return &t;
  return nullptr;
}

void Timers::start(const std::string& name, int level) {
  if (hooks_.push) {
    hooks_.push(name);
    open_ranges_.push_back(name);
  }
  if (level > log_level_) return;
  Timer* t = find(name);
  if (!t) {
    timers_.push_back({name, false, {}, 0.0});
    t = &timers_.back();
  }
  LOOM_CHECK(!t->running, "[Timers] timer ", name, " started twice");
  if (hooks_.sync) hooks_.sync();
  t->running = true;
  t->started = std::chrono::steady_clock::now();
}

void Timers::stop(const std::string& name) {
  if (Timer* t = find(name); t && t->running) {
    if (hooks_.sync) hooks_.sync();
    t->elapsed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t->started).count();
    t->running = false;
  } else if (t) {
    LOOM_CHECK(t->running, "[Timers] timer ", name, " stopped without start");
  }
  // Ranges nest like the timers; one opened before the hooks were set is not popped.
  if (!open_ranges_.empty() && open_ranges_.back() == name) {
    open_ranges_.pop_back();
    if (hooks_.pop) hooks_.pop();
  }
}

double Timers::elapsed(const std::string& name) const {
  const Timer* t = find(name);
  return t ? t->elapsed_s : 0.0;
}

void Timers::reset(const std::string& name) {
  if (Timer* t = find(name)) t->elapsed_s = 0;
}

std::vector<std::pair<std::string, double>> Timers::values_ms(const std::vector<std::string>& names,
                                                              double normalizer) const {
  std::vector<std::pair<std::string, double>> out;
  for (const std::string& n : names)
    if (const Timer* t = find(n)) out.emplace_back(n, t->elapsed_s * 1000.0 / normalizer);
  return out;
}

TimingLogOption parse_timing_log_option(const std::string& s) {
  if (s == "max") return TimingLogOption::kMax;
  if (s == "minmax") return TimingLogOption::kMinMax;
  if (s == "all") return TimingLogOption::kAll;
  user_error("--timing-log-option: unknown option '", s, "' (valid: max, minmax, all)");
}

std::string Timers::log(const std::vector<std::string>& names, double normalizer, const Communicator* group) {
  std::string s;
  char buf[96];
  for (const std::string& name : names) {
    const Timer* t = find(name);
    const double mine = t ? t->elapsed_s * 1000.0 / normalizer : -INFINITY;
    if (t) reset(name);
    std::string label = name + " ";
    if (label.size() < 48) label.append(48 - label.size(), '.');
    if (option_ == TimingLogOption::kAll) {
      // Rank r's value reaches every rank as the max over {r's value, -inf elsewhere}: any backend's
      // scalar reduction, one per rank (log intervals only).
      const int n = group ? group->size() : 1;
      std::string lines;
      for (int r = 0; r < n; ++r) {
        const double v = group ? group->all_reduce_scalar(group->rank() == r ? mine : -INFINITY, ReduceOp::kMax) : mine;
        if (!(v >= 0)) continue;  // absent on that rank
        std::snprintf(buf, sizeof buf, "\n     rank %2d: %.2f", r, v);
        lines += buf;
      }
      if (!lines.empty()) s += "\n    " + name + lines;
      continue;
    }
    double lo = t ? mine : INFINITY, hi = mine;
    if (group) {  // every rank reduces every name, present or not, so the collectives match
      lo = group->all_reduce_scalar(lo, ReduceOp::kMin);
      hi = group->all_reduce_scalar(hi, ReduceOp::kMax);
    }
    if (!(hi >= 0)) continue;  // on no rank
    if (option_ == TimingLogOption::kMax)
      std::snprintf(buf, sizeof buf, ": %.2f", hi);
    else
      std::snprintf(buf, sizeof buf, ": (%.2f, %.2f)", lo, hi);
    s += "\n    " + label + buf;
  }
  if (s.empty()) return s;
  switch (option_) {
    case TimingLogOption::kMax: return "max time across ranks (ms):" + s;
    case TimingLogOption::kAll: return "times across ranks (ms):" + s;
    case TimingLogOption::kMinMax: break;
  }
  return "(min, max) time across ranks (ms):" + s;
}

}  // namespace loom
