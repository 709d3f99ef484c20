// SIGTERM and SIGINT, received by one dedicated thread instead of interrupting the thread that computes.
//
// Why: a signal handler runs on the stack of whichever thread the kernel picks, and the kernel first
// pushes a signal frame (several KB with the AVX-512 state) below that thread's stack pointer. oneDNN
// 2.6's f32 GEMM kernels (jit_avx512_common_gemm_f32, jit_avx_gemm_f32), for a reduction longer than their
// stack buffer, point the stack pointer into a heap workspace while they run; a frame pushed there
// overwrites the heap below it. --exit-signal-handler runs (fp16 or fp32 GEMMs, SIGTERM mid-step) then
// aborted in glibc ("corrupted size vs. prev_size") in 5 of 40 tries with one thread.
//
// route_exit_signals() blocks both signals in the calling thread, which every thread created later
// inherits, and starts the thread that waits for them with sigwait(): no computing thread is ever
// interrupted by them. Outside an ExitSignalScope a signal then ends the process as its default action
// would (killed by that signal); inside one it is only recorded, for exit_signal() to report.
#pragma once

namespace loom {

// Call first in main(), before any other thread exists (threads created earlier keep receiving the
// signals). Idempotent.
void route_exit_signals();

// While one is alive, SIGTERM and SIGINT are recorded instead of ending the process (Megatron's
// --exit-signal-handler: the training loop saves and exits after the iteration). Without
// route_exit_signals() it falls back to a handler that records them (which runs on an interrupted thread).
// Creating one clears a previously recorded signal.
class ExitSignalScope {
 public:
  ExitSignalScope();
  ~ExitSignalScope();
  ExitSignalScope(const ExitSignalScope&) = delete;
  ExitSignalScope& operator=(const ExitSignalScope&) = delete;

 private:
  bool fallback_handler_ = false;
};

// The signal recorded since the current ExitSignalScope began (SIGTERM or SIGINT), or 0.
int exit_signal();

}  // namespace loom
