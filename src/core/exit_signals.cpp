#include "loom/core/exit_signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "loom/core/check.h"

namespace loom {

namespace {

std::atomic<int> g_recorded{0};   // the signal recorded inside a scope
std::atomic<int> g_scopes{0};     // live ExitSignalScopes
std::atomic<bool> g_routed{false};
std::once_flag g_route_once;

sigset_t exit_set() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGTERM);
  sigaddset(&s, SIGINT);
  return s;
}

// The default action, from this thread: the only one in which the signal is not blocked once unblocked here.
[[noreturn]] void die_by(int sig) {
  signal(sig, SIG_DFL);
  const sigset_t s = exit_set();
  pthread_sigmask(SIG_UNBLOCK, &s, nullptr);
  raise(sig);
  _exit(128 + sig);  // not reached: the default action of both signals ends the process
}

void wait_for_signals() {
  const sigset_t s = exit_set();
  for (;;) {
    int sig = 0;
    if (sigwait(&s, &sig) != 0) continue;
    if (g_scopes.load() > 0)
      g_recorded.store(sig);
    else
      die_by(sig);
  }
}

extern "C" void record_exit_signal(int sig) { g_recorded.store(sig); }

// The dispositions the fallback handler replaced (one fallback scope at a time: a process runs one trainer).
struct sigaction g_old_term {}, g_old_int {};

}  // namespace

void route_exit_signals() {
  std::call_once(g_route_once, [] {
    const sigset_t s = exit_set();
    const int rc = pthread_sigmask(SIG_BLOCK, &s, nullptr);
    LOOM_CHECK(rc == 0, "[exit_signals] pthread_sigmask failed: ", std::strerror(rc));
    std::thread(wait_for_signals).detach();
    g_routed.store(true);
  });
}

ExitSignalScope::ExitSignalScope() {
  g_recorded.store(0);
  if (g_routed.load()) {
    g_scopes.fetch_add(1);
    return;
  }
  // Not routed (a library caller): record from a handler, as before. SA_RESTART: a log write blocked on a
  // full pipe must resume, not fail with EINTR (which would put std::cout into a failed state).
  fallback_handler_ = true;
  struct sigaction sa {};
  sa.sa_handler = record_exit_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
}

ExitSignalScope::~ExitSignalScope() {
  if (fallback_handler_) {
    sigaction(SIGTERM, &g_old_term, nullptr);
    sigaction(SIGINT, &g_old_int, nullptr);
    return;
  }
  g_scopes.fetch_sub(1);
}

int exit_signal() { return g_recorded.load(); }

}  // namespace loom
