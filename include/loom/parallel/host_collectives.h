// Collectives over small host buffers (routing counts, router logits, statistics), staged through a device
// tensor of `ctx` because a communicator may need device memory (NCCL); with MPI on the CPU the staging
// is a host copy. Blocking: the results are on the host when they return. Element counts are per rank.
#pragma once
#include <cstdint>

#include "loom/backend/device_context.h"
#include "loom/dist/communicator.h"

namespace loom {

// v[0, n) = the sum over g of every rank's v (f32).
void all_reduce_host(const DeviceContext& ctx, const Communicator& g, float* v, int64_t n);
// out[0, g.size() · n) = every rank's in[0, n), in rank order.
void all_gather_host(const DeviceContext& ctx, const Communicator& g, void* out, const void* in, int64_t n, DType dt);
// in[0, n) is g.size() equal chunks, chunk p for rank p; out[0, n) chunk p came from rank p.
void all_to_all_host(const DeviceContext& ctx, const Communicator& g, void* out, const void* in, int64_t n, DType dt);

}  // namespace loom
