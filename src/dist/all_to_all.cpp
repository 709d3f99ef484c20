// All-to-all pieces every backend shares: the argument checks and element offsets of all_to_all_v
// (AllToAllPlan), and Communicator's equal-split all_to_all defaults, which derive equal counts and call
// the backend's all_to_all_v. Invariants checked here, once for every backend: out and inp have the same
// dtype and trailing shape, one count per group rank, counts >= 0 and summing to each tensor's dim 0,
// and the two tensors do not overlap (no backend can exchange in place).
#include "dist/dist_util.h"
#include "loom/dist/communicator.h"

namespace loom {

namespace dist {

namespace {

// Elements per row: the product of the trailing dims (well defined when dim 0 is 0).
int64_t trailing_elements(const Shape& s) {
  int64_t n = 1;
  for (int i = 1; i < s.ndim(); ++i) n *= s[i];
  return n;
}

bool same_trailing_shape(const Shape& a, const Shape& b) {
  if (a.ndim() != b.ndim()) return false;
  for (int i = 1; i < a.ndim(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Offsets and element counts of one side; `what` names the count vector in messages.
void plan_side(const std::string& text, int size, TensorView t, const std::vector<int64_t>& counts,
               const char* what, const char* tensor, int64_t row, std::vector<int64_t>& off,
               std::vector<int64_t>& count) {
  LOOM_CHECK(int64_t(counts.size()) == size, "[all_to_all_v] on group ", text, ": ", what, " has ", counts.size(),
             " entries, expected one per group rank (", size, ")");
  int64_t rows = 0;
  off.resize(size_t(size));
  count.resize(size_t(size));
  for (int p = 0; p < size; ++p) {
    const int64_t c = counts[size_t(p)];
    LOOM_CHECK(c >= 0, "[all_to_all_v] on group ", text, ": ", what, "[", p, "] = ", c, " is negative");
    off[size_t(p)] = rows * row;
    count[size_t(p)] = c * row;
    rows += c;
  }
  LOOM_CHECK(rows == t.size(0), "[all_to_all_v] on group ", text, ": ", what, " sum to ", rows, " rows but ", tensor,
             " ", t.desc(), " has ", t.size(0), " rows (dim 0)");
}

}  // namespace

AllToAllPlan plan_all_to_all(const std::string& text, int size, TensorView out,
                             const std::vector<int64_t>& out_counts, TensorView inp,
                             const std::vector<int64_t>& in_counts) {
  LOOM_CHECK(out.ndim() >= 1 && inp.ndim() >= 1, "[all_to_all_v] on group ", text, ": out ", out.desc(), " and inp ",
             inp.desc(), " need a dim 0 to split into rows");
  LOOM_CHECK(out.dtype() == inp.dtype(), "[all_to_all_v] on group ", text, ": out ", out.desc(), " and inp ",
             inp.desc(), " differ in dtype");
  LOOM_CHECK(same_trailing_shape(out.shape(), inp.shape()), "[all_to_all_v] on group ", text, ": out ", out.desc(),
             " and inp ", inp.desc(), " differ in their trailing shape (the shape of one row)");
  LOOM_CHECK((out.numel() == 0 || out.defined()) && (inp.numel() == 0 || inp.defined()), "[all_to_all_v] on group ",
             text, ": undefined tensor");
  LOOM_CHECK(!overlaps(out, inp), "[all_to_all_v] on group ", text, ": out ", out.desc(), " and inp ", inp.desc(),
             " overlap; all-to-all cannot run in place");
  AllToAllPlan plan;
  plan.row_elements = trailing_elements(inp.shape());
  plan_side(text, size, inp, in_counts, "in_counts", "inp", plan.row_elements, plan.send_off, plan.send_count);
  plan_side(text, size, out, out_counts, "out_counts", "out", plan.row_elements, plan.recv_off, plan.recv_count);
  return plan;
}

std::vector<int64_t> equal_all_to_all_counts(const std::string& text, int size, TensorView out, TensorView inp) {
  LOOM_CHECK(out.ndim() >= 1 && out.shape() == inp.shape() && out.dtype() == inp.dtype(), "[all_to_all] on group ",
             text, ": out ", out.desc(), " and inp ", inp.desc(),
             " must have the same dtype and shape, with a dim 0 to split");
  LOOM_CHECK(inp.size(0) % size == 0, "[all_to_all] on group ", text, ": dim 0 of inp ", inp.desc(),
             " must split into group size ", size, " equal chunks");
  return std::vector<int64_t>(size_t(size), inp.size(0) / size);
}

}  // namespace dist

void Communicator::all_to_all(TensorView out, TensorView inp) const {
  const std::vector<int64_t> counts = dist::equal_all_to_all_counts(name(), size(), out, inp);
  all_to_all_v(out, counts, inp, counts);
}

std::unique_ptr<Work> Communicator::all_to_all_async(TensorView out, TensorView inp) const {
  const std::vector<int64_t> counts = dist::equal_all_to_all_counts(name(), size(), out, inp);
  return all_to_all_v_async(out, counts, inp, counts);
}

}  // namespace loom
