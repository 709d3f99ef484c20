// Host-buffer collectives staged through the device (see host_collectives.h).
#include "loom/parallel/host_collectives.h"

namespace loom {

namespace {

TensorView host_view(const void* p, DType dt, int64_t n) { return TensorView(const_cast<void*>(p), dt, {n}); }

}  // namespace

void all_reduce_host(const DeviceContext& ctx, const Communicator& g, float* v, int64_t n) {
  if (g.size() == 1 || n == 0) return;
  Tensor t = ctx.empty({n}, DType::kF32);
  ctx.copy(t, host_view(v, DType::kF32, n));
  g.all_reduce(t);
  ctx.copy(host_view(v, DType::kF32, n), t);
  ctx.synchronize();
}

void all_gather_host(const DeviceContext& ctx, const Communicator& g, void* out, const void* in, int64_t n, DType dt) {
  const int64_t total = int64_t(g.size()) * n;
  Tensor a = ctx.empty({n}, dt), b = ctx.empty({total}, dt);
  ctx.copy(a, host_view(in, dt, n));
  g.all_gather(b, a);
  ctx.copy(host_view(out, dt, total), b);
  ctx.synchronize();
}

void all_to_all_host(const DeviceContext& ctx, const Communicator& g, void* out, const void* in, int64_t n, DType dt) {
  Tensor a = ctx.empty({n}, dt), b = ctx.empty({n}, dt);
  ctx.copy(a, host_view(in, dt, n));
  g.all_to_all(b, a);
  ctx.copy(host_view(out, dt, n), b);
  ctx.synchronize();
}

}  // namespace loom
