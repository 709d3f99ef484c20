#include "loom/train/timers.h"

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
  if (level > log_level_) return;
  Timer* t = find(name);
  if (!t) {
    timers_.push_back({name, false, {}, 0.0});
    t = &timers_.back();
  }
  LOOM_CHECK(!t->running, "[Timers] timer ", name, " started twice");
  t->running = true;
  t->started = std::chrono::steady_clock::now();
}

void Timers::stop(const std::string& name) {
  Timer* t = find(name);
  if (!t) return;  // inactive at this log level
  LOOM_CHECK(t->running, "[Timers] timer ", name, " stopped without start");
  t->elapsed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t->started).count();
  t->running = false;
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

std::string Timers::log(const std::vector<std::string>& names, double normalizer) {
  const auto values = values_ms(names, normalizer);
  if (values.empty()) return "";
  std::string s = "(min, max) time across ranks (ms):";
  for (const auto& [name, ms] : values) {
    std::string label = name + " ";
    if (label.size() < 48) label.append(48 - label.size(), '.');
    char buf[96];
    std::snprintf(buf, sizeof buf, ": (%.2f, %.2f)", ms, ms);
    s += "\n    " + label + buf;
    reset(name);
  }
  return s;
}

}  // namespace loom
