// Megatron's named timers (megatron/core/timers.py): each timer has a log level and is active only when
// its level is <= --timing-log-level, so inactive timers cost nothing. Elapsed times accumulate
// between logs; log() prints Megatron's "(min, max) time across ranks (ms):" block, normalised per
// iteration, and resets what it printed. With one process min == max; the layout stays Megatron's so
// log parsers keep working when ranks come.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "loom/dist/communicator.h"

namespace loom {

// --timing-log-option: how log() shows a timer across ranks (Megatron's timers.log): "max time across
// ranks (ms):" with the maximum, "(min, max) time across ranks (ms):" (Megatron's default), or "times
// across ranks (ms):" with one line per rank.
enum class TimingLogOption { kMax, kMinMax, kAll };
TimingLogOption parse_timing_log_option(const std::string& s);  // UserError naming --timing-log-option

class Timers {
 public:
  explicit Timers(int log_level, TimingLogOption option = TimingLogOption::kMinMax)
      : log_level_(log_level), option_(option) {}
  // Starts (or, for stop, stops) the named timer if level <= the run's --timing-log-level.
  void start(const std::string& name, int level);
  void stop(const std::string& name);
  // Accumulated seconds of `name` since the last reset (0 for an unknown or inactive timer).
  double elapsed(const std::string& name) const;
  void reset(const std::string& name);
  // The block Megatron prints after a log line, for the active timers among `names` (in that order),
  // each divided by `normalizer` (iterations in the interval), in ms. Resets those timers. Empty when
  // none is active.
  // With `group` (collective: every rank calls it with the same names), min and max (or every rank's
  // value, kAll) are taken over its ranks (a timer absent on some ranks, e.g. pipeline receives on the
  // first stage, counts where present and is left out where absent); without it, this process's value.
  std::string log(const std::vector<std::string>& names, double normalizer, const Communicator* group = nullptr);
  // (name, ms per iteration) of the active timers among `names`, without resetting (for TensorBoard).
  std::vector<std::pair<std::string, double>> values_ms(const std::vector<std::string>& names,
                                                        double normalizer) const;
  int log_level() const { return log_level_; }

  // Device hooks of a GPU run. sync waits for the device before an active timer reads the clock, so a
  // timer covers the device work enqueued inside it (Megatron's timers synchronise CUDA likewise);
  // push/pop open and close a profiler range (NVTX) named after every timer started, active or not, while
  // set (the trainer sets them for the --profile window only).
  struct Hooks {
    std::function<void()> sync;
    std::function<void(const std::string&)> push;
    std::function<void()> pop;
  };
  void set_hooks(Hooks h) { hooks_ = std::move(h); }
  const Hooks& hooks() const { return hooks_; }

 private:
  struct Timer {
    std::string name;
    bool running = false;
    std::chrono::steady_clock::time_point started;
    double elapsed_s = 0;
  };
  Timer* find(const std::string& name);
  const Timer* find(const std::string& name) const;
  int log_level_;
  TimingLogOption option_;
  std::vector<Timer> timers_;
  Hooks hooks_;
  std::vector<std::string> open_ranges_;  // timers whose range is open (pop only what was pushed)
};

// RAII start/stop of one timer.
class ScopedTimer {
 public:
  ScopedTimer(Timers& t, std::string name, int level) : t_(t), name_(std::move(name)) { t_.start(name_, level); }
  ~ScopedTimer() { t_.stop(name_); }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  Timers& t_;
  std::string name_;
};

}  // namespace loom
