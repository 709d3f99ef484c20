// Timers' device hooks (GPU runs): sync runs before an active timer reads the clock, at start and at stop;
// push/pop bracket every started timer, active or not (profiler ranges), nested like the timers; a range
// opened before the hooks were set is never popped; without hooks nothing is called.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "loom/train/timers.h"

using namespace loom;

TEST(Timers, DeviceHooksSyncActiveTimersAndBracketRanges) {
  Timers t(1);  // level-2 timers are inactive
  std::vector<std::string> events;
  t.start("before-hooks", 1);
  t.set_hooks({[&] { events.push_back("sync"); }, [&](const std::string& n) { events.push_back("push " + n); },
               [&] { events.push_back("pop"); }});
  t.start("forward-backward", 1);
  t.start("batch-generator", 2);  // inactive: a range, no sync
  t.stop("batch-generator");
  t.stop("forward-backward");
  t.stop("before-hooks");  // started before the hooks: synced (active), but no range to pop
  const std::vector<std::string> want = {"push forward-backward", "sync", "push batch-generator", "pop",
                                         "sync", "pop", "sync"};
  EXPECT_EQ(events, want);
  EXPECT_GT(t.elapsed("forward-backward"), 0.0);
  EXPECT_EQ(t.elapsed("batch-generator"), 0.0);

  events.clear();
  t.set_hooks({});
  t.start("optimizer", 1);
  t.stop("optimizer");
  EXPECT_TRUE(events.empty());
  EXPECT_THROW(t.stop("optimizer"), Error);  // stopped without start, hooks or not
}
