// Expert-parallel token dispatch (Megatron-Core's MoE token dispatchers): moves each rank's expert-grouped
// token rows (moe_permute's output: rows for expert 0, then expert 1, ... of ALL experts) to the ranks that
// hold those experts, as one expert-major buffer of this rank's local experts for the grouped MLP, and the
// experts' outputs back (combine). Forward and backward are exact adjoints; with EP = ETP = 1 every step is
// the identity (no copy).
//
//   alltoall   all-to-all(v) over the expert-parallel (EP) group (each row goes to its expert's owner),
//              then, with the experts split over ETP ranks, an all-gather over the ETP group; combine is
//              the reverse (reduce-scatter over ETP sums the experts' partial outputs, all-to-all back);
//   allgather  an all-gather over the ETP x EP group of every rank's rows; each rank keeps the rows of its
//              local experts; combine reduce-scatters the outputs (zeros elsewhere) back over the group.
// Received rows arrive in chunks (source rank, local expert); a row permutation (moe_permute with an
// (rows, 1) map) sorts them expert-major, sources in group order within an expert, and back.
// Tokens replicated over the ETP group (tensor parallelism without sequence parallelism, EP = 1): nothing
// is gathered; the experts' partial outputs are all-reduced over ETP, and so are the input gradients.
// Variable-size gathers pad every rank's rows to the group maximum (counts exchanged first).
#pragma once
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/dist/communicator.h"

namespace loom {

// --moe-token-dispatcher-type (equal results, different communication).
enum class MoeDispatcher { kAllGather, kAllToAll };
MoeDispatcher parse_moe_dispatcher(std::string_view s);  // UserError naming the flag
const char* moe_dispatcher_name(MoeDispatcher d);

struct ExpertParallel {
  MoeDispatcher kind = MoeDispatcher::kAllGather;
  const Communicator* ep = nullptr;      // expert-model-parallel group (null: EP = 1)
  const Communicator* etp = nullptr;     // expert-tensor-parallel group (null: ETP = 1)
  const Communicator* etp_ep = nullptr;  // their product (rank = etp + ETP · ep), for allgather
  bool etp_replicated = false;           // the ETP ranks hold the same tokens (TP without SP, EP = 1)
  int ep_size() const { return ep ? ep->size() : 1; }
  int ep_rank() const { return ep ? ep->rank() : 0; }
  int etp_size() const { return etp ? etp->size() : 1; }
  int etp_rank() const { return etp ? etp->rank() : 0; }
};

class TokenDispatcher {
 public:
  // What backward needs of one dispatch (host metadata and the sort map).
  struct Saved {
    int64_t rows_in = 0;        // this rank's permuted rows (M_l)
    int64_t rows_recv = 0;      // alltoall: rows after the all-to-all (before the ETP gather)
    std::vector<int64_t> send_counts, recv_counts;  // alltoall: rows to / from each EP rank
    int64_t gather_pad = 0;     // rows per rank in the padded gather (0: no gather)
    int64_t gather_rows = 0;    // this rank's rows in the gather (rows_recv or rows_in)
    Tensor sort_map;            // (gathered rows, 1) i32: the expert-major row of each row, -1 for none
    bool sorted = false;        // false: the rows already are expert-major (nothing to permute)
    std::vector<int64_t> group_sizes;  // (local experts) rows per local expert, what the grouped MLP reads
    int64_t rows_out = 0;       // Σ group_sizes
  };
  TokenDispatcher(int64_t num_experts, const ExpertParallel& ep);
  int64_t num_local_experts() const { return E_local_; }
  int64_t first_local_expert() const { return first_; }

  // xp (M_l, C): this rank's rows, expert-major over all experts, counts (E) rows per expert. Returns the
  // local experts' rows (rows_out, C). overlap (may be empty) runs while the first exchange is in flight.
  // With EP = 1 and no split ETP group the results are the inputs themselves (shared storage, no copy).
  Tensor dispatch(const DeviceContext& ctx, Saved& s, const Tensor& xp, const std::vector<int64_t>& counts,
                  const std::function<void()>& overlap = {}) const;
  // ye (rows_out, C): the local experts' outputs -> (M_l, C) this rank's rows' outputs (ETP partials summed).
  Tensor combine(const DeviceContext& ctx, const Saved& s, const Tensor& ye) const;
  // The adjoints: d(ye) from d(combine's output), d(xp) from d(dispatch's output).
  Tensor combine_backward(const DeviceContext& ctx, const Saved& s, const Tensor& dy) const;
  Tensor dispatch_backward(const DeviceContext& ctx, const Saved& s, const Tensor& dxe) const;

 private:
  // Padded all-gather over g of `rows` rows of x -> (g.size() · pad, C).
  Tensor gather(const DeviceContext& ctx, const Communicator& g, TensorView x, int64_t rows, int64_t pad) const;
  // Its adjoint: the reduce-scatter of (g.size() · pad, C) -> this rank's first `rows` rows.
  Tensor scatter(const DeviceContext& ctx, const Communicator& g, TensorView x, int64_t rows, int64_t pad) const;
  Tensor sort(const DeviceContext& ctx, const Saved& s, TensorView x) const;
  // The local experts' rows back to where they came from (combine, and dispatch's adjoint).
  Tensor to_sources(const DeviceContext& ctx, const Saved& s, const Tensor& x) const;
  Tensor unsort(const DeviceContext& ctx, const Saved& s, TensorView x) const;
  // Builds s.sort_map / group_sizes from the chunk table: counts[src][j] rows of chunk j of each source
  // (sources in order, each starting at src · pad, or packed one after the other with pad 0). Chunk j is
  // local expert j % E_local (the sources list their chunks cycling through the local experts), or with
  // `global` global expert j, kept only when this rank holds it.
  void build_sort(const DeviceContext& ctx, Saved& s, const std::vector<std::vector<int64_t>>& counts, int64_t pad,
                  bool global) const;

  int64_t E_, E_local_, first_;
  ExpertParallel ep_;
};

}  // namespace loom
