// An in-process communicator for simulating CP ranks as threads (the ring's logic, buffers and message
// order are tested without mpirun). Point-to-point follows MPI's matching rule: the k-th receive a rank posts
// from a peer gets the k-th message that peer sent to it, whenever the receive is waited on; sends are
// buffered (complete at once). A receive whose message has the wrong size or dtype fails, so a message-order
// bug shows up as an error, not as silently swapped buffers. all_gather is built from the same messages;
// the other collectives are not needed by the ring and fail loudly.
#pragma once
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/core/check.h"
#include "loom/dist/communicator.h"

namespace loom::test {

class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), chans_(size_t(size * size)) {}
  int size() const { return size_; }

  struct Message {
    DType dtype;
    int64_t numel;
    std::vector<char> bytes;
  };
  struct Channel {  // messages from one rank to another, by sequence number
    std::mutex mu;
    std::condition_variable cv;
    std::map<int64_t, Message> pending;
    int64_t sent = 0, posted = 0;
  };
  Channel& chan(int src, int dst) { return chans_[size_t(src * size_ + dst)]; }

 private:
  int size_;
  std::vector<Channel> chans_;
};

class ThreadComm final : public Communicator {
 public:
  ThreadComm(ThreadGroup& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size(); }
  std::string name() const override { return "thread-context-parallel"; }
  std::vector<int> global_ranks() const override {
    std::vector<int> r(size_t(g_.size()));
    for (int i = 0; i < g_.size(); ++i) r[size_t(i)] = i;
    return r;
  }

  void send(TensorView x, int peer) const override { post_send(x, peer); }
  void recv(TensorView x, int peer) const override { RecvWork(this, x, peer).wait(); }
  std::unique_ptr<Work> send_async(TensorView x, int peer) const override {
    post_send(x, peer);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> recv_async(TensorView x, int peer) const override {
    return std::make_unique<RecvWork>(this, x, peer);
  }
  void all_gather(TensorView out, TensorView inp) const override {
    const int64_t es = int64_t(dtype_size(inp.dtype()));
    LOOM_CHECK(out.numel() == inp.numel() * size(), "[thread_comm] all_gather size mismatch");
    for (int p = 0; p < size(); ++p)
      if (p != rank_) post_send(inp, p);
    for (int p = 0; p < size(); ++p) {
      TensorView part(static_cast<char*>(out.raw()) + p * inp.numel() * es, inp.dtype(), inp.shape());
      if (p == rank_) std::memcpy(part.raw(), inp.raw(), size_t(inp.nbytes()));
      else recv(part, p);
    }
  }

  void all_reduce(TensorView, ReduceOp) const override { LOOM_FAIL("[thread_comm] all_reduce is not simulated"); }
  double all_reduce_scalar(double, ReduceOp) const override { LOOM_FAIL("[thread_comm] not simulated"); }
  void broadcast(TensorView, int) const override { LOOM_FAIL("[thread_comm] broadcast is not simulated"); }
  void reduce_scatter(TensorView, TensorView) const override { LOOM_FAIL("[thread_comm] not simulated"); }
  void barrier() const override { LOOM_FAIL("[thread_comm] barrier is not simulated"); }
  std::unique_ptr<Work> all_reduce_async(TensorView, ReduceOp) const override { LOOM_FAIL("[thread_comm] not simulated"); }
  std::unique_ptr<Work> all_gather_async(TensorView, TensorView) const override { LOOM_FAIL("[thread_comm] not simulated"); }
  std::unique_ptr<Work> reduce_scatter_async(TensorView, TensorView) const override {
    LOOM_FAIL("[thread_comm] not simulated");
  }
  void all_to_all_v(TensorView, const std::vector<int64_t>&, TensorView, const std::vector<int64_t>&) const override {
    LOOM_FAIL("[thread_comm] all_to_all_v is not simulated");
  }
  std::unique_ptr<Work> all_to_all_v_async(TensorView, const std::vector<int64_t>&, TensorView,
                                           const std::vector<int64_t>&) const override {
    LOOM_FAIL("[thread_comm] not simulated");
  }
  std::unique_ptr<Communicator> split(int, int, std::string) const override { LOOM_FAIL("[thread_comm] not simulated"); }

 private:
  struct DoneWork final : Work {
    void wait() override {}
    bool done() override { return true; }
  };
  // Takes its sequence number when posted (MPI's matching order), copies the message in on wait().
  struct RecvWork final : Work {
    const ThreadComm* c;
    TensorView x;
    int peer;
    int64_t seq;
    bool finished = false;
    RecvWork(const ThreadComm* comm, TensorView t, int p) : c(comm), x(t), peer(p) {
      LOOM_CHECK(p >= 0 && p < c->size() && p != c->rank_, "[thread_comm] bad peer ", p);
      ThreadGroup::Channel& ch = c->g_.chan(peer, c->rank_);
      std::lock_guard<std::mutex> lk(ch.mu);
      seq = ch.posted++;
    }
    ~RecvWork() override { wait(); }
    void wait() override {
      if (finished) return;
      ThreadGroup::Channel& ch = c->g_.chan(peer, c->rank_);
      std::unique_lock<std::mutex> lk(ch.mu);
      ch.cv.wait(lk, [&] { return ch.pending.count(seq) > 0; });
      ThreadGroup::Message m = std::move(ch.pending.at(seq));
      ch.pending.erase(seq);
      lk.unlock();
      finished = true;
      LOOM_CHECK(m.dtype == x.dtype() && m.numel == x.numel(), "[thread_comm] rank ", c->rank_,
                 " received message ", seq, " from ", peer, " as ", x.desc(), " but it was ", dtype_name(m.dtype),
                 " with ", m.numel, " elements (message order mismatch)");
      std::memcpy(x.raw(), m.bytes.data(), m.bytes.size());
    }
    bool done() override { return finished; }
  };

  void post_send(TensorView x, int peer) const {
    LOOM_CHECK(peer >= 0 && peer < size() && peer != rank_, "[thread_comm] bad peer ", peer);
    ThreadGroup::Message m{x.dtype(), x.numel(), std::vector<char>(size_t(x.nbytes()))};
    std::memcpy(m.bytes.data(), x.raw(), size_t(x.nbytes()));
    ThreadGroup::Channel& ch = g_.chan(rank_, peer);
    {
      std::lock_guard<std::mutex> lk(ch.mu);
      ch.pending.emplace(ch.sent++, std::move(m));
    }
    ch.cv.notify_all();
  }

  ThreadGroup& g_;
  int rank_;
};

}  // namespace loom::test
