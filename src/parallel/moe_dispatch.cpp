// Expert-parallel token dispatch (see moe_dispatch.h). Invariants: every collective is called by every rank
// of its group in the same order (the counts are exchanged before the rows, so all ranks agree on the
// padded sizes); the sort map is a bijection from the buffer's real rows onto the expert-major rows, -1 on
// padding and on rows of experts this rank does not hold; combine and the backward passes reuse the
// forward's Saved, so they exchange exactly the forward's row counts.
#include "loom/parallel/moe_dispatch.h"

#include <algorithm>
#include <numeric>

#include "loom/core/check.h"
#include "loom/parallel/host_collectives.h"

namespace loom {

MoeDispatcher parse_moe_dispatcher(std::string_view s) {
  if (s == "allgather") return MoeDispatcher::kAllGather;
  if (s == "alltoall") return MoeDispatcher::kAllToAll;
  if (s == "flex" || s == "alltoall_seq")
    user_error("--moe-token-dispatcher-type ", s, " is not supported by Loom; valid: allgather, alltoall");
  user_error("--moe-token-dispatcher-type must be allgather or alltoall, got '", s, "'");
}

const char* moe_dispatcher_name(MoeDispatcher d) { return d == MoeDispatcher::kAllToAll ? "alltoall" : "allgather"; }

namespace {

int64_t row_width(TensorView x) { return x.shape().ndim() > 1 && x.shape()[0] > 0 ? x.numel() / x.shape()[0] : x.shape().cols(); }

struct Chunk {
  int64_t src_row = 0, rows = 0;
  int64_t expert = -1;  // local expert index; -1: not this rank's
};

}  // namespace

TokenDispatcher::TokenDispatcher(int64_t num_experts, const ExpertParallel& ep) : E_(num_experts), ep_(ep) {
  LOOM_CHECK(num_experts >= 1 && num_experts % ep.ep_size() == 0, "[TokenDispatcher] ", num_experts,
             " experts do not split over ", ep.ep_size(), " expert-parallel ranks");
  LOOM_CHECK(!ep.etp_replicated || ep.ep_size() == 1, "[TokenDispatcher] tokens replicated over the ETP group need EP = 1");
  E_local_ = num_experts / ep.ep_size();
  first_ = int64_t(ep.ep_rank()) * E_local_;
}

Tensor TokenDispatcher::gather(const DeviceContext& ctx, const Communicator& g, TensorView x, int64_t rows,
                               int64_t pad) const {
  const int64_t C = row_width(x);
  Tensor send = ctx.zeros({pad, C}, x.dtype());
  if (rows > 0) ctx.copy(send.view().slice_flat(0, Shape{rows, C}), x.reshape({rows, C}));
  Tensor out = ctx.empty({int64_t(g.size()) * pad, C}, x.dtype());
  g.all_gather(out, send);
  return out;
}

Tensor TokenDispatcher::scatter(const DeviceContext& ctx, const Communicator& g, TensorView x, int64_t rows,
                                int64_t pad) const {
  const int64_t C = row_width(x);
  Tensor out = ctx.empty({pad, C}, x.dtype());
  g.reduce_scatter(out, x);
  return out.slice_flat(0, Shape{rows, C});
}

void TokenDispatcher::build_sort(const DeviceContext& ctx, Saved& s, const std::vector<std::vector<int64_t>>& counts,
                                 int64_t pad, bool global) const {
  // The chunks in buffer order: source by source, expert by expert within a source.
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (size_t src = 0; src < counts.size(); ++src) {
    int64_t row = pad > 0 ? int64_t(src) * pad : total;
    for (size_t e = 0; e < counts[src].size(); ++e) {
      Chunk c{row, counts[src][e], int64_t(e) % E_local_};  // a source lists its chunks cycling the experts
      if (global) c.expert = int64_t(e) >= first_ && int64_t(e) < first_ + E_local_ ? int64_t(e) - first_ : -1;
      chunks.push_back(c);
      row += c.rows;
    }
    total = pad > 0 ? int64_t(src + 1) * pad : row;
  }
  s.group_sizes.assign(size_t(E_local_), 0);
  for (const Chunk& c : chunks)
    if (c.expert >= 0) s.group_sizes[size_t(c.expert)] += c.rows;
  std::vector<int64_t> next(size_t(E_local_), 0);
  for (int64_t e = 1; e < E_local_; ++e) next[size_t(e)] = next[size_t(e - 1)] + s.group_sizes[size_t(e - 1)];
  s.rows_out = std::accumulate(s.group_sizes.begin(), s.group_sizes.end(), int64_t(0));
  std::vector<int32_t> map(size_t(total), -1);
  bool identity = total == s.rows_out;
  for (const Chunk& c : chunks) {
    if (c.expert < 0) continue;
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t dst = next[size_t(c.expert)]++;
      map[size_t(c.src_row + r)] = int32_t(dst);
      identity = identity && dst == c.src_row + r;
    }
  }
  s.sorted = !identity;
  if (s.sorted) {
    s.sort_map = ctx.empty({total, 1}, DType::kI32);
    if (total > 0) ctx.copy(s.sort_map, TensorView(map.data(), DType::kI32, {total, 1}));
  }
}

Tensor TokenDispatcher::sort(const DeviceContext& ctx, const Saved& s, TensorView x) const {
  const int64_t C = row_width(x);
  Tensor out = ctx.empty({s.rows_out, C}, x.dtype());
  ctx.ops().moe_permute_forward(out, x.reshape({x.numel() / C, C}), s.sort_map);
  return out;
}

Tensor TokenDispatcher::unsort(const DeviceContext& ctx, const Saved& s, TensorView x) const {
  const int64_t C = row_width(x), rows = s.sort_map.shape()[0];
  Tensor out = ctx.empty({rows, C}, x.dtype());
  ctx.ops().moe_permute_backward(out, x.reshape({s.rows_out, C}), s.sort_map);  // zeros where no expert row
  return out;
}


Tensor TokenDispatcher::dispatch(const DeviceContext& ctx, Saved& s, const Tensor& xp, const std::vector<int64_t>& counts,
                                 const std::function<void()>& overlap) const {
  LOOM_CHECK(int64_t(counts.size()) == E_, "[TokenDispatcher] expected ", E_, " expert counts, got ", counts.size());
  const int64_t Ml = xp.shape()[0], C = row_width(xp);
  LOOM_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t(0)) == Ml, "[TokenDispatcher] the counts sum to ",
             std::accumulate(counts.begin(), counts.end(), int64_t(0)), " rows, the input has ", Ml);
  s = Saved{};
  s.rows_in = Ml;
  const int EP = ep_.ep_size(), ETP = ep_.etp_size();
  const bool split_etp = ETP > 1 && !ep_.etp_replicated;
  if (EP == 1 && !split_etp) {  // every expert is here and every token too
    if (overlap) overlap();
    s.group_sizes = counts;
    s.rows_out = Ml;
    return xp;
  }
  if (ep_.kind == MoeDispatcher::kAllGather) {
    const Communicator& g = *ep_.etp_ep;
    const int P = g.size();
    if (overlap) overlap();
    std::vector<int32_t> mine(counts.begin(), counts.end());
    std::vector<int32_t> all(size_t(P) * size_t(E_));
    all_gather_host(ctx, g, all.data(), mine.data(), E_, DType::kI32);
    std::vector<std::vector<int64_t>> table(size_t(P), std::vector<int64_t>(size_t(E_), 0));
    int64_t pad = 0;
    for (int q = 0; q < P; ++q) {
      int64_t rows = 0;
      for (int64_t e = 0; e < E_; ++e) rows += table[q][e] = all[size_t(q) * E_ + e];
      pad = std::max(pad, rows);
    }
    s.gather_pad = std::max<int64_t>(pad, 1);
    s.gather_rows = Ml;
    Tensor G = gather(ctx, g, xp, Ml, s.gather_pad);
    build_sort(ctx, s, table, s.gather_pad, /*global=*/true);
    return sort(ctx, s, G);
  }
  // alltoall: the per-(EP rank, local expert) counts first, then the rows.
  std::vector<int32_t> send_tab(counts.begin(), counts.end());
  std::vector<int32_t> recv_tab = send_tab;
  if (EP > 1)
    all_to_all_host(ctx, *ep_.ep, recv_tab.data(), send_tab.data(), int64_t(send_tab.size()), DType::kI32);
  s.send_counts.assign(size_t(EP), 0);
  s.recv_counts.assign(size_t(EP), 0);
  for (int j = 0; j < EP; ++j)
    for (int64_t e = 0; e < E_local_; ++e) {
      s.send_counts[size_t(j)] += send_tab[size_t(j * E_local_ + e)];
      s.recv_counts[size_t(j)] += recv_tab[size_t(j * E_local_ + e)];
    }
  s.rows_recv = std::accumulate(s.recv_counts.begin(), s.recv_counts.end(), int64_t(0));
  Tensor R;
  if (EP > 1) {
    R = ctx.empty({s.rows_recv, C}, xp.dtype());
    std::unique_ptr<Work> w = ep_.ep->all_to_all_v_async(R, s.recv_counts, xp.reshape({Ml, C}), s.send_counts);
    if (overlap) overlap();
    w->wait();
  } else {
    if (overlap) overlap();
    R = xp.reshape({Ml, C});  // the rows themselves (read only from here on)
  }
  std::vector<std::vector<int64_t>> table;
  if (!split_etp) {
    table.assign(size_t(EP), std::vector<int64_t>(size_t(E_local_)));
    for (int i = 0; i < EP; ++i)
      for (int64_t e = 0; e < E_local_; ++e) table[i][e] = recv_tab[size_t(i * E_local_ + e)];
    // One source block per EP rank, packed.
    build_sort(ctx, s, table, 0, false);
    return s.sorted ? sort(ctx, s, R) : R;
  }
  std::vector<int32_t> all(size_t(ETP) * recv_tab.size());
  all_gather_host(ctx, *ep_.etp, all.data(), recv_tab.data(), int64_t(recv_tab.size()), DType::kI32);
  // One source block per ETP rank, holding its (EP rank, local expert) chunks.
  table.assign(size_t(ETP), {});
  int64_t pad = 0;
  for (int t = 0; t < ETP; ++t) {
    std::vector<int64_t> flat;
    int64_t rows = 0;
    for (int i = 0; i < EP; ++i)
      for (int64_t e = 0; e < E_local_; ++e) {
        flat.push_back(all[size_t(t) * recv_tab.size() + size_t(i * E_local_ + e)]);
        rows += flat.back();
      }
    table[size_t(t)] = std::move(flat);
    pad = std::max(pad, rows);
  }
  s.gather_pad = std::max<int64_t>(pad, 1);
  s.gather_rows = s.rows_recv;
  Tensor G = gather(ctx, *ep_.etp, R, s.rows_recv, s.gather_pad);
  build_sort(ctx, s, table, s.gather_pad, false);
  return sort(ctx, s, G);
}

// combine and dispatch's backward are the same map (rows of the local experts back to the ranks and rows
// they came from, ETP partial sums added): one implementation.
Tensor TokenDispatcher::to_sources(const DeviceContext& ctx, const Saved& s, const Tensor& x) const {
  const int EP = ep_.ep_size(), ETP = ep_.etp_size();
  const bool split_etp = ETP > 1 && !ep_.etp_replicated;
  if (EP == 1 && !split_etp) {
    if (ETP > 1) ep_.etp->all_reduce(x);  // replicated tokens: sum the experts' partial results, in place
    return x;
  }
  Tensor Y = s.sorted ? unsort(ctx, s, x) : x;
  if (ep_.kind == MoeDispatcher::kAllGather) return scatter(ctx, *ep_.etp_ep, Y, s.rows_in, s.gather_pad);
  if (split_etp) Y = scatter(ctx, *ep_.etp, Y, s.rows_recv, s.gather_pad);
  if (EP == 1) return Y;
  Tensor out = ctx.empty({s.rows_in, row_width(x)}, x.dtype());
  ep_.ep->all_to_all_v(out, s.send_counts, Y, s.recv_counts);
  return out;
}

Tensor TokenDispatcher::combine(const DeviceContext& ctx, const Saved& s, const Tensor& ye) const {
  return to_sources(ctx, s, ye);
}

Tensor TokenDispatcher::combine_backward(const DeviceContext& ctx, const Saved& s, const Tensor& dy) const {
  const int EP = ep_.ep_size(), ETP = ep_.etp_size();
  const bool split_etp = ETP > 1 && !ep_.etp_replicated;
  if (EP == 1 && !split_etp) return dy;
  const int64_t C = row_width(dy);
  Tensor G;
  if (ep_.kind == MoeDispatcher::kAllGather) {
    G = gather(ctx, *ep_.etp_ep, dy, s.rows_in, s.gather_pad);
  } else {
    Tensor R;
    if (EP > 1) {
      R = ctx.empty({s.rows_recv, C}, dy.dtype());
      ep_.ep->all_to_all_v(R, s.recv_counts, dy.reshape({s.rows_in, C}), s.send_counts);
    } else {
      R = dy.reshape({s.rows_in, C});
    }
    G = split_etp ? gather(ctx, *ep_.etp, R, s.rows_recv, s.gather_pad) : R;
  }
  return s.sorted ? sort(ctx, s, G) : G;
}

Tensor TokenDispatcher::dispatch_backward(const DeviceContext& ctx, const Saved& s, const Tensor& dxe) const {
  return to_sources(ctx, s, dxe);
}

}  // namespace loom
