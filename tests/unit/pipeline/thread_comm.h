// Test-only in-process communicator: N ranks run as threads of one process and exchange point-to-point
// messages with rendezvous semantics (a send completes only once the receiver has copied the data, as a
// large MPI or NCCL message does), so a schedule that would deadlock or that rewrites a buffer before its
// send completed shows up here. Every blocking wait times out (an exception in that rank's thread), so a
// deadlock fails the test instead of hanging it. Only send/recv and their async twins exist.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "loom/dist/communicator.h"

namespace loom::test {

class ThreadWorld {
 public:
  explicit ThreadWorld(int size, std::chrono::milliseconds timeout = std::chrono::milliseconds(5000))
      : size_(size), timeout_(timeout), queues_(size_t(size * size)) {}
  int size() const { return size_; }

  struct Pending {
    const void* data;
    int64_t nbytes;
    bool taken = false;
  };

  std::shared_ptr<Pending> post(int from, int to, TensorView x) {
    auto p = std::make_shared<Pending>(Pending{x.raw(), x.nbytes()});
    std::lock_guard lock(mu_);
    queues_[size_t(from * size_ + to)].push_back(p);
    cv_.notify_all();
    return p;
  }
  void wait_taken(const std::shared_ptr<Pending>& p, int from, int to) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout_, [&] { return p->taken; }))
      LOOM_FAIL("[thread comm] send ", from, " -> ", to, " never received (deadlock)");
  }
  void take(int from, int to, TensorView x) {
    std::unique_lock lock(mu_);
    auto& q = queues_[size_t(from * size_ + to)];
    if (!cv_.wait_for(lock, timeout_, [&] { return !q.empty(); }))
      LOOM_FAIL("[thread comm] recv ", to, " <- ", from, " never sent (deadlock)");
    std::shared_ptr<Pending> p = q.front();
    q.pop_front();
    LOOM_CHECK(p->nbytes == x.nbytes(), "[thread comm] recv of ", x.nbytes(), " bytes got ", p->nbytes);
    std::memcpy(x.raw(), p->data, size_t(p->nbytes));
    p->taken = true;
    cv_.notify_all();
  }
  bool taken(const std::shared_ptr<Pending>& p) {
    std::lock_guard lock(mu_);
    return p->taken;
  }

 private:
  int size_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::deque<std::shared_ptr<Pending>>> queues_;  // [from * size + to]
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(ThreadWorld& world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }
  std::string name() const override { return "pipeline(test)"; }
  std::vector<int> global_ranks() const override {
    std::vector<int> r(size_t(world_.size()));
    for (int i = 0; i < world_.size(); ++i) r[size_t(i)] = i;
    return r;
  }
  void all_reduce(TensorView, ReduceOp) const override { unsupported(); }
  double all_reduce_scalar(double, ReduceOp) const override { unsupported(); }
  void broadcast(TensorView, int) const override { unsupported(); }
  void all_gather(TensorView, TensorView) const override { unsupported(); }
  void reduce_scatter(TensorView, TensorView) const override { unsupported(); }
  void barrier() const override { unsupported(); }
  void send(TensorView x, int peer) const override { send_async(x, peer)->wait(); }
  void recv(TensorView x, int peer) const override {
    check_peer(peer);
    world_.take(peer, rank_, x);
  }
  std::unique_ptr<Work> all_reduce_async(TensorView, ReduceOp) const override { unsupported(); }
  std::unique_ptr<Work> all_gather_async(TensorView, TensorView) const override { unsupported(); }
  std::unique_ptr<Work> reduce_scatter_async(TensorView, TensorView) const override { unsupported(); }
  std::unique_ptr<Work> send_async(TensorView x, int peer) const override {
    check_peer(peer);
    return std::make_unique<SendWork>(world_, world_.post(rank_, peer, x), rank_, peer);
  }
  std::unique_ptr<Work> recv_async(TensorView, int) const override { unsupported(); }
  void all_to_all_v(TensorView, const std::vector<int64_t>&, TensorView, const std::vector<int64_t>&) const override {
    unsupported();
  }
  std::unique_ptr<Work> all_to_all_v_async(TensorView, const std::vector<int64_t>&, TensorView,
                                           const std::vector<int64_t>&) const override {
    unsupported();
  }
  std::unique_ptr<Communicator> split(int, int, std::string) const override { unsupported(); }

 private:
  class SendWork final : public Work {
   public:
    SendWork(ThreadWorld& w, std::shared_ptr<ThreadWorld::Pending> p, int from, int to)
        : w_(w), p_(std::move(p)), from_(from), to_(to) {}
    ~SendWork() override {
      try {
        wait();
      } catch (...) {
      }
    }
    void wait() override { w_.wait_taken(p_, from_, to_); }
    bool done() override { return w_.taken(p_); }

   private:
    ThreadWorld& w_;
    std::shared_ptr<ThreadWorld::Pending> p_;
    int from_, to_;
  };
  void check_peer(int peer) const {
    LOOM_CHECK(peer >= 0 && peer < world_.size() && peer != rank_, "[thread comm] bad peer ", peer);
  }
  [[noreturn]] void unsupported() const { LOOM_FAIL("[thread comm] only point-to-point exists"); }
  ThreadWorld& world_;
  int rank_;
};

// Runs fn(rank) on `size` threads; rethrows the first exception after all joined.
inline void run_ranks(int size, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace loom::test
