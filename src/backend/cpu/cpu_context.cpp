// The CPU DeviceContext: owns the op table; reports OpenMP threads and the oneDNN version/ISA.
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/cpu_ops.h"
#include "loom/backend/device_context.h"

namespace loom {

namespace {

// A cgroup memory limit file's value ("max" or a huge v1 sentinel: no limit).
int64_t cgroup_limit(const char* path) {
  std::ifstream f(path);
  std::string v;
  if (!(f >> v) || v == "max") return std::numeric_limits<int64_t>::max();
  try {
    const unsigned long long b = std::stoull(v);
    return b >= (1ULL << 62) ? std::numeric_limits<int64_t>::max() : int64_t(b);
  } catch (const std::exception&) {
    return std::numeric_limits<int64_t>::max();
  }
}

int64_t host_memory_capacity() {
  int64_t cap = int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
  if (cap <= 0) cap = std::numeric_limits<int64_t>::max();
  cap = std::min({cap, cgroup_limit("/sys/fs/cgroup/memory.max"),
                  cgroup_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes")});
  rlimit rl{};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    cap = std::min(cap, int64_t(std::min<rlim_t>(rl.rlim_cur, rlim_t(std::numeric_limits<int64_t>::max()))));
  return cap;
}

class CpuContext final : public DeviceContext {
 public:
  Device device() const override { return cpu_device(); }
  const OpTable& ops() const override { return ops_; }
  void synchronize() const override {}
  std::string description() const override {
    const dnnl_version_t* v = dnnl_version();
    return "cpu (" + std::to_string(omp_get_max_threads()) + " OpenMP threads, oneDNN " +
           std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) + ")";
  }
  int64_t memory_capacity() const override { return host_memory_capacity(); }
  void copy(TensorView dst, TensorView src) const override {
    LOOM_CHECK(dst.nbytes() == src.nbytes(), "[copy] ", dst.desc(), " <- ", src.desc(), " size mismatch");
    LOOM_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "[copy] cpu context copies host memory only");
    if (dst.nbytes()) std::memcpy(dst.raw(), src.raw(), size_t(src.nbytes()));
  }

 private:
  cpu::CpuOps ops_;
};

}  // namespace

Tensor DeviceContext::zeros(Shape s, DType dt) const {
  Tensor t = empty(s, dt);
  ops().fill_(t, 0.0f);
  return t;
}

std::unique_ptr<DeviceContext> make_cpu_context() { return std::make_unique<CpuContext>(); }

}  // namespace loom
