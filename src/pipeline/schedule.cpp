// Pipeline schedules (see loom/pipeline/schedule.h): the per-rank order of forwards and backwards
// (Megatron's no-pipelining, 1F1B and interleaved 1F1B), the executor that runs an order over
// PipelineStage chunks with point-to-point messages (the GPTModel adapter is gpt_stage.cpp).
//
// Message matching: the Communicator has no tags, so between two ranks messages must be received in the
// order they were sent. Every rank derives the full send order of its neighbours from their schedule
// orders (all ranks can compute every rank's order) and checks that the message it is about to receive
// is the next one its peer sends: with PP = 2 and interleaving one pair of ranks carries activations and
// gradients both ways, and only the schedule's structure keeps them in order.
#include "loom/pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <optional>

namespace loom {

namespace {

void check_interleaving(int pp_size, int num_chunks, int64_t nmb) {
  LOOM_CHECK(pp_size >= 1 && num_chunks >= 1 && nmb >= 1, "[pipeline] pp_size ", pp_size, ", chunks ",
             num_chunks, ", micro-batches ", nmb, " must all be >= 1");
  if (num_chunks == 1) return;
  if (pp_size == 1)
    user_error("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1");
  if (nmb % pp_size != 0)
    user_error("--num-layers-per-virtual-pipeline-stage needs the number of micro-batches (", nmb,
               ") to be a multiple of the pipeline size (", pp_size, ")");
}

}  // namespace

std::vector<PipelineOp> pipeline_schedule_order(int pp_size, int pp_rank, int num_chunks, int64_t nmb,
                                                bool forward_only) {
  check_interleaving(pp_size, num_chunks, nmb);
  LOOM_CHECK(pp_rank >= 0 && pp_rank < pp_size, "[pipeline] rank ", pp_rank, " out of range for size ", pp_size);
  std::vector<PipelineOp> order;
  if (pp_size == 1) {  // gradient accumulation
    for (int64_t m = 0; m < nmb; ++m) {
      order.push_back({false, 0, m});
      if (!forward_only) order.push_back({true, 0, m});
    }
    return order;
  }
  const int64_t P = pp_size, V = num_chunks;
  if (V == 1) {  // 1F1B
    const int64_t warmup = forward_only ? nmb : std::min<int64_t>(P - pp_rank - 1, nmb);
    for (int64_t m = 0; m < warmup; ++m) order.push_back({false, 0, m});
    for (int64_t i = 0; i < nmb - warmup; ++i) {
      order.push_back({false, 0, warmup + i});
      if (!forward_only) order.push_back({true, 0, i});
    }
    if (!forward_only)
      for (int64_t m = nmb - warmup; m < nmb; ++m) order.push_back({true, 0, m});
    return order;
  }
  // Interleaved: the k-th forward (backward) of every rank handles the same (chunk, micro-batch):
  // groups of PP micro-batches go through chunk 0, then chunk 1, ... (backwards from the last chunk).
  const int64_t total = nmb * V;
  auto op = [&](int64_t k, bool backward) {
    const int64_t in_group = k % (P * V);
    int64_t chunk = in_group / P;
    if (backward) chunk = V - 1 - chunk;
    return PipelineOp{backward, int(chunk), (k / (P * V)) * P + k % P};
  };
  int64_t warmup = total;
  if (!forward_only) warmup = std::min<int64_t>((P - pp_rank - 1) * 2 + (V - 1) * P, total);
  for (int64_t k = 0; k < warmup; ++k) order.push_back(op(k, false));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(op(k + warmup, false));
    order.push_back(op(k, true));
  }
  if (!forward_only)
    for (int64_t k = total - warmup; k < total; ++k) order.push_back(op(k, true));
  return order;
}

int pipeline_activation_slots(int pp_size, int num_chunks, int64_t nmb) {
  int most = 1;
  for (int r = 0; r < pp_size; ++r) {
    std::vector<int> in_flight(size_t(num_chunks), 0);
    for (const PipelineOp& op : pipeline_schedule_order(pp_size, r, num_chunks, nmb, false)) {
      int& n = in_flight[size_t(op.chunk)];
      n += op.backward ? -1 : 1;
      most = std::max(most, n);
    }
  }
  return most;
}

namespace {

// A message between neighbouring ranks, named by what the receiver does with it.
struct Message {
  bool grad = false;  // false: activation for input(); true: gradient for output_grad()
  int chunk = 0;      // the receiver's chunk
  int64_t microbatch = 0;
  bool operator==(const Message&) const = default;
};

// Where rank `rank`'s op sends its result (nothing for the model's ends).
std::optional<std::pair<int, Message>> destination(int P, int V, int rank, const PipelineOp& op) {
  if (!op.backward) {
    if (rank == P - 1 && op.chunk == V - 1) return std::nullopt;
    const int to = (rank + 1) % P;
    return std::make_pair(to, Message{false, rank == P - 1 ? op.chunk + 1 : op.chunk, op.microbatch});
  }
  if (rank == 0 && op.chunk == 0) return std::nullopt;
  const int to = (rank + P - 1) % P;
  return std::make_pair(to, Message{true, rank == 0 ? op.chunk - 1 : op.chunk, op.microbatch});
}

class Timer {
 public:
  Timer(const PipelineCallbacks& cb, const char* phase) : cb_(cb), phase_(phase) {
    if (cb_.timer) cb_.timer(phase_, true);
  }
  ~Timer() {
    if (cb_.timer) cb_.timer(phase_, false);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

 private:
  const PipelineCallbacks& cb_;
  const char* phase_;
};

}  // namespace

PipelineStepResult run_pipeline_schedule(const std::vector<PipelineStage*>& chunks, const Communicator& pp,
                                         int64_t nmb, bool forward_only, const PipelineCallbacks& cb) {
  const int P = pp.size(), rank = pp.rank(), V = int(chunks.size());
  LOOM_CHECK(V >= 1, "[pipeline] no model chunks");
  const std::vector<PipelineOp> order = pipeline_schedule_order(P, rank, V, nmb, forward_only);
  const int slots_needed = pipeline_activation_slots(P, V, nmb);
  for (int v = 0; v < V; ++v)
    LOOM_CHECK(chunks[size_t(v)]->slots() >= slots_needed, "[pipeline] chunk ", v, " has ",
               chunks[size_t(v)]->slots(), " activation slots; the schedule for PP ", P, ", ", V,
               " chunks and ", nmb, " micro-batches needs ", slots_needed, " (pipeline_activation_slots)");

  // What each peer sends to this rank, in its send order.
  std::map<int, std::deque<Message>> expected;
  if (P > 1) {
    for (int peer : {(rank + P - 1) % P, (rank + 1) % P}) {
      if (expected.count(peer)) continue;
      std::deque<Message>& q = expected[peer];
      for (const PipelineOp& op : pipeline_schedule_order(P, peer, V, nmb, forward_only)) {
        const auto d = destination(P, V, peer, op);
        if (d && d->first == rank) q.push_back(d->second);
      }
    }
  }
  auto receive = [&](TensorView into, int from, const Message& msg) {
    std::deque<Message>& q = expected[from];
    LOOM_CHECK(!q.empty() && q.front() == msg, "[pipeline] rank ", rank, " would receive ",
               msg.grad ? "gradient" : "activation", " of chunk ", msg.chunk, " micro-batch ", msg.microbatch,
               " out of its peer's send order");
    q.pop_front();
    pp.recv(into, from);
  };

  // Sends in flight per (chunk, slot): the output (forward) and input-gradient (backward) buffers.
  std::vector<std::unique_ptr<Work>> fwd_sends(size_t(V) * size_t(slots_needed));
  std::vector<std::unique_ptr<Work>> bwd_sends(size_t(V) * size_t(slots_needed));

  PipelineStepResult result;
  for (const PipelineOp& op : order) {
    PipelineStage& stage = *chunks[size_t(op.chunk)];
    const int slot = int(op.microbatch % slots_needed);
    const size_t key = size_t(op.chunk) * size_t(slots_needed) + size_t(slot);
    stage.set_slot(slot);
    const bool first = rank == 0 && op.chunk == 0, last = rank == P - 1 && op.chunk == V - 1;
    const auto dest = destination(P, V, rank, op);
    if (!op.backward) {
      if (!first) {
        Timer t(cb, "forward-recv");
        receive(stage.input(), (rank + P - 1) % P, Message{false, op.chunk, op.microbatch});
      }
      if (fwd_sends[key]) {  // the slot's output is still being sent (an earlier micro-batch)
        Timer t(cb, "forward-send");
        fwd_sends[key]->wait();
        fwd_sends[key].reset();
      }
      double loss;
      {
        Timer t(cb, "forward-compute");
        loss = stage.forward(op.microbatch);
      }
      if (last) {
        result.loss_sum += loss;
        ++result.microbatches;
        if (cb.after_loss) cb.after_loss(op.microbatch);
      }
      if (dest) {
        Timer t(cb, "forward-send");
        fwd_sends[key] = pp.send_async(stage.output(), dest->first);
      }
    } else {
      if (!last) {
        Timer t(cb, "backward-recv");
        receive(stage.output_grad(), (rank + 1) % P, Message{true, op.chunk, op.microbatch});
      }
      if (bwd_sends[key]) {
        Timer t(cb, "backward-send");
        bwd_sends[key]->wait();
        bwd_sends[key].reset();
      }
      if (cb.before_backward) cb.before_backward(op.chunk, op.microbatch, op.microbatch == nmb - 1);
      {
        Timer t(cb, "backward-compute");
        stage.backward(op.microbatch);
      }
      if (dest) {
        Timer t(cb, "backward-send");
        bwd_sends[key] = pp.send_async(stage.input_grad(), dest->first);
      }
    }
  }
  for (auto* sends : {&fwd_sends, &bwd_sends})
    for (auto& w : *sends)
      if (w) {
        Timer t(cb, sends == &fwd_sends ? "forward-send" : "backward-send");
        w->wait();
      }
  for (const auto& [peer, q] : expected)
    LOOM_CHECK(q.empty(), "[pipeline] rank ", rank, " left ", q.size(), " messages of rank ", peer, " unreceived");
  return result;
}

}  // namespace loom
