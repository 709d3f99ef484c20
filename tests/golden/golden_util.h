// Shared helpers of the op-level golden tests (test_golden_ops.cpp, test_golden_llama_ops.cpp): the CPU op
// table, the PyTorch fixture files tests/golden/fixtures/ops_<family>.safetensors written by gen_ops.py /
// gen_llama_ops.py (a "cases" metadata list; tensors and integer parameters named "<case>.<name>"), and the
// comparison every check uses.
//
// Error measure: max_i |got_i - want_i| / max_i |times * ref_i| with want = base + times * ref, so outputs
// that ACCUMULATE are checked as init + reference and outputs that OVERWRITE start as NaN (a missed write
// is an infinite error).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "loom/backend/device_context.h"
#include "loom/ckpt/safetensors.h"

namespace loom::golden {

inline const OpTable& ops() {
  static std::unique_ptr<DeviceContext> ctx = make_cpu_context();
  return ctx->ops();
}

// One fixture file, ops_<family>.safetensors.
class Fixture {
 public:
  explicit Fixture(const std::string& family)
      : file_(SafetensorsFile::open(std::string(LOOM_FIXTURE_DIR) + "/ops_" + family + ".safetensors")) {
    std::stringstream ss(file_.metadata().at("cases"));
    for (std::string c; std::getline(ss, c, ',');) cases_.push_back(c);
  }
  // Cases of this file; with `param`, only those that define "<case>.<param>".
  std::vector<std::string> cases(const std::string& param = "") const {
    std::vector<std::string> out;
    for (const std::string& c : cases_)
      if (param.empty() || file_.metadata().count(c + "." + param)) out.push_back(c);
    return out;
  }
  bool has(const std::string& c, const std::string& name) const { return file_.contains(c + "." + name); }
  Tensor get(const std::string& c, const std::string& name) const { return file_.read(c + "." + name); }
  int64_t param(const std::string& c, const std::string& key) const {
    return std::stoll(file_.metadata().at(c + "." + key));
  }

 private:
  SafetensorsFile file_;
  std::vector<std::string> cases_;
};

inline Tensor filled(Shape s, float v) {
  Tensor t = Tensor::empty(s, DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = v;
  return t;
}
inline Tensor nan_tensor(Shape s) { return filled(s, std::numeric_limits<float>::quiet_NaN()); }

inline Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  std::memcpy(c.raw(), t.raw(), size_t(t.nbytes()));
  return c;
}

inline double max_abs(const TensorView& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(double(t.data<float>()[i])));
  return m;
}

// A non-zero starting value for accumulating outputs, of magnitude comparable to the reference.
inline Tensor accum_init(const TensorView& ref, int salt) {
  const double mag = 0.5 * std::max(max_abs(ref), 1e-3);
  Tensor t = Tensor::empty(ref.shape(), DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = float(mag * std::sin(0.37 * double(i) + salt));
  return t;
}

// got ≈ base + times * ref, error relative to max |times * ref|. `base` may be empty (zero). Prints the
// error of every check, so the margins can be read from the test log.
inline void expect_close(const std::string& what, const TensorView& got, const TensorView& ref, double tol,
                         const TensorView& base = {}, double times = 1.0) {
  ASSERT_EQ(got.numel(), ref.numel()) << what << ": got " << got.desc() << ", reference " << ref.desc();
  const double scale = std::max(std::fabs(times) * max_abs(ref), 1e-30);
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double want = (base ? double(base.data<float>()[i]) : 0.0) + times * double(ref.data<float>()[i]);
    const double g = got.data<float>()[i];
    const double err = std::isfinite(g) ? std::fabs(g - want) : std::numeric_limits<double>::infinity();
    if (err > worst || at < 0) worst = err, at = i;
  }
  const double rel = worst / scale;
  std::printf("  [golden] %-52s rel err %.2e (tol %.0e, max|ref| %.3g)\n", what.c_str(), rel, tol, scale);
  EXPECT_LE(rel, tol) << what << ": worst element " << at << " got " << got.data<float>()[at] << " want "
                      << (base ? double(base.data<float>()[at]) : 0.0) + times * double(ref.data<float>()[at]);
}

}  // namespace loom::golden
