// GPTModel's FP8 state (see loom/model/gpt.h, "FP8"): the step boundaries of delayed scaling, the amax
// reduction over the replicas, and the per-site scaling state that checkpoints save and restore. The sites
// are listed once, by the constructor (gpt.cpp), from the layers' linears.
#include "model/gpt_impl.h"

namespace loom {

// ---- FP8 -------------------------------------------------------------------------------------------

int GPTModel::fp8_num_sites() const { return fp8_ ? int(fp8_->sites.size()) : 0; }

void GPTModel::fp8_begin_step() {
  if (!fp8_) return;
  for (const Fp8State::Site& s : fp8_->sites) s.gemm->begin_step();
}

void GPTModel::fp8_update_scaling(const std::vector<const Communicator*>& groups) {
  if (!fp8_) return;
  for (const Communicator* c : groups)
    if (c != nullptr && c->size() > 1) {
      fp8_->fwd->reduce_amaxes(*c);
      fp8_->bwd->reduce_amaxes(*c);
    }
  fp8_->fwd->update();
  fp8_->bwd->update();
}

void GPTModel::fp8_discard_amaxes() {
  if (!fp8_) return;
  ctx_.ops().fill_(fp8_->fwd->current_amaxes(), 0.0f);
  ctx_.ops().fill_(fp8_->bwd->current_amaxes(), 0.0f);
}

std::string GPTModel::fp8_state_name(int site) const {
  LOOM_CHECK(site >= 0 && site < fp8_num_sites(), "[GPTModel] FP8 site ", site, " out of range (", fp8_num_sites(), ")");
  return fp8_->sites[size_t(site)].name + ".fp8_state";
}

Tensor GPTModel::fp8_state(int site) const {
  LOOM_CHECK(site >= 0 && site < fp8_num_sites(), "[GPTModel] FP8 site ", site, " out of range");
  const Fp8ScalingGroup* groups[3] = {fp8_->fwd.get(), fp8_->fwd.get(), fp8_->bwd.get()};
  const Fp8Gemm& g = *fp8_->sites[size_t(site)].gemm;
  const int slots[3] = {g.input_slot(), g.weight_slot(), g.grad_slot()};
  const int64_t L = fp8_->fwd->amax_history().size(0);
  Tensor out = Tensor::empty({3, 1 + L}, DType::kF32);
  for (int r = 0; r < 3; ++r) {
    ctx_.copy(out.view().slice_flat(r * (1 + L), Shape{1}), groups[r]->scale(slots[r]));
    const int64_t n = groups[r]->size();
    for (int64_t h = 0; h < L; ++h)
      ctx_.copy(out.view().slice_flat(r * (1 + L) + 1 + h, Shape{1}),
                groups[r]->amax_history().view().slice_flat(h * n + slots[r], Shape{1}));
  }
  return out;
}

void GPTModel::fp8_set_state(int site, TensorView st) {
  LOOM_CHECK(site >= 0 && site < fp8_num_sites(), "[GPTModel] FP8 site ", site, " out of range");
  const int64_t L = fp8_->fwd->amax_history().size(0);
  LOOM_CHECK(st.dtype() == DType::kF32 && st.numel() == 3 * (1 + L), "[GPTModel] FP8 state of site ", site,
             " must be (3, ", 1 + L, ") f32, got ", st.desc());
  Tensor host = Tensor::empty({3, 1 + L}, DType::kF32);
  ctx_.copy(host, st.reshape({3, 1 + L}));
  const Fp8ScalingGroup* groups[3] = {fp8_->fwd.get(), fp8_->fwd.get(), fp8_->bwd.get()};
  const Fp8Gemm& g = *fp8_->sites[size_t(site)].gemm;
  const int slots[3] = {g.input_slot(), g.weight_slot(), g.grad_slot()};
  for (int r = 0; r < 3; ++r) {
    const float scale = host.data<float>()[r * (1 + L)];
    Tensor s = Tensor::empty({1}, DType::kF32), si = Tensor::empty({1}, DType::kF32);
    s.data<float>()[0] = scale;
    si.data<float>()[0] = 1.0f / scale;
    ctx_.copy(groups[r]->scale(slots[r]), s);
    ctx_.copy(groups[r]->scale_inv(slots[r]), si);
    const int64_t n = groups[r]->size();
    for (int64_t h = 0; h < L; ++h)
      ctx_.copy(groups[r]->amax_history().view().slice_flat(h * n + slots[r], Shape{1}),
                host.view().slice_flat(r * (1 + L) + 1 + h, Shape{1}));
  }
  fp8_begin_step();
}

}  // namespace loom
