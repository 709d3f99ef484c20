// The CPU DeviceContext: owns the op table; reports OpenMP threads and the oneDNN version/ISA.
#include <omp.h>

#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/cpu_ops.h"
#include "loom/backend/device_context.h"

namespace loom {

namespace {

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
