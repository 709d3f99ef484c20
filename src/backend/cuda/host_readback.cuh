// Reading a small device result back to the host, for the few ops that return a host value or must check
// device data before they start (sum_squares, has_inf_or_nan, cross_entropy's target check). Host-only
// header; definitions in host_readback.cu.
//
// Invariants: the copy goes to a pinned per-host-thread slot (a plain DMA instead of a staged pageable copy)
// and is followed by a synchronisation of ctx.compute_stream(), the only host sync these ops make. The slot
// is reused by the next read_back on the same thread, so callers copy the value out at once.
#pragma once
#include <cstddef>

#include "backend/cuda/cuda_context.cuh"

namespace loom::cuda {

// Copies `bytes` (at most 64) from device memory `dev` to the pinned slot after the work already queued on
// ctx.compute_stream(), waits for the stream, and returns the slot.
const void* read_back(const CudaContext& ctx, const void* dev, size_t bytes);

}  // namespace loom::cuda
