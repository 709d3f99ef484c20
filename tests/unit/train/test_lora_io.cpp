// LoRA placement and mapping (model/gpt.h lora_site, model/hf_mapping.h hf_lora_layout) and the merge of
// train/lora_io.h on small random tensors: the rows an adapter updates in the fused weights, and that the
// PEFT modules' B rows, applied the PEFT way to the HF export of the base, give the HF export of Loom's merged
// weight, for whole layers and slices, with and without --rotary-interleaved.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "loom/model/hf_mapping.h"
#include "loom/train/lora_io.h"

using namespace loom;

namespace {

GPTConfig tiny_llama(bool interleaved) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.normalization = NormKind::kRMSNorm;
  c.activation = MlpActivation::kSwiGLU;
  c.ffn_hidden = 24;
  c.add_bias_linear = false;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.rotary_interleaved = interleaved;
  c.untie_embeddings_and_output_weights = true;
  c.max_position_embeddings = 16;
  c.vocab_size = 100;
  c.padded_vocab_size = 128;
  c.validate();
  return c;
}

Tensor random(Shape s, std::mt19937& g) {
  Tensor t = Tensor::empty(s, DType::kF32);
  std::normal_distribution<float> d(0.0f, 0.5f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(g);
  return t;
}

Tensor copy(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), DType::kF32);
  std::copy(t.data<float>(), t.data<float>() + t.numel(), c.data<float>());
  return c;
}

}  // namespace

TEST(LoraSite, RowsOfTheFusedLayouts) {
  const GPTConfig c = tiny_llama(false);  // NH 4, NKV 2, HS 8: a group is [q q k v] = 32 rows
  const auto rows = [](const LoraSite& s) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const ShardRange& r : s.rows) out.emplace_back(r.start, r.size);
    return out;
  };
  using V = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(rows(lora_site(c, LoraTarget::kQ)), (V{{0, 16}, {32, 16}}));
  EXPECT_EQ(rows(lora_site(c, LoraTarget::kK)), (V{{16, 8}, {48, 8}}));
  EXPECT_EQ(rows(lora_site(c, LoraTarget::kV)), (V{{24, 8}, {56, 8}}));
  EXPECT_EQ(rows(lora_site(c, LoraTarget::kQ, 2)), (V{{0, 16}}));  // each rank: its one group
  EXPECT_EQ(rows(lora_site(c, LoraTarget::kUp)), (V{{24, 24}}));
  EXPECT_EQ(rows(lora_site(c, LoraTarget::kUp, 2)), (V{{12, 12}}));
  EXPECT_TRUE(lora_site(c, LoraTarget::kQkv).rows.empty());
  const LoraSite proj = lora_site(c, LoraTarget::kProj);
  EXPECT_EQ(proj.layer, "self_attention.linear_proj");
  EXPECT_EQ(proj.in, 32);
  EXPECT_EQ(lora_site(c, LoraTarget::kFc2).in, 24);
  EXPECT_EQ(lora_site(c, LoraTarget::kV).module, "self_attention.v_proj");
}

// For every target set: merge random adapters into random weights, export base and merged weights with the
// HF mapping, export the adapters with hf_lora_layout, and apply them the PEFT way to the HF base.
TEST(HfLoraLayout, PeftUpdateOfTheHfBaseIsTheHfExportOfTheMerge) {
  using T = LoraTarget;
  const std::vector<std::vector<T>> sets = {{T::kQkv, T::kProj, T::kFc1, T::kFc2},
                                            {T::kProj, T::kFc2, T::kQ, T::kK, T::kV, T::kGate, T::kUp},
                                            {T::kK, T::kUp}};
  for (const bool interleaved : {false, true})
    for (const std::vector<T>& targets : sets) {
      SCOPED_TRACE(std::string("interleaved ") + (interleaved ? "yes" : "no") + ", " + std::to_string(targets.size()) +
                   " targets");
      const GPTConfig c = tiny_llama(interleaved);
      const int64_t R = 3;
      std::mt19937 g(7);
      const HfLayout layout = hf_layout(c);
      std::map<std::string, Tensor> base, merged;
      std::map<std::string, TensorView> views;
      for (const HfParamMap& m : layout.params) {
        base.emplace(m.loom_name, random(m.loom_shape, g));
        merged.emplace(m.loom_name, copy(base.at(m.loom_name)));
        views[m.loom_name] = merged.at(m.loom_name);
      }
      LoraOptions lo{{R, 5.0f, 0.0f}, targets};
      const std::vector<HfLoraMap> maps = hf_lora_layout(c, targets, R);
      std::map<std::string, Tensor> adapters;
      for (const HfLoraMap& m : maps) {
        adapters.emplace(m.loom_a, random(m.a_shape, g));
        adapters.emplace(m.b.loom_name, random(m.b.loom_shape, g));
      }
      merge_lora(c, lo, adapters, views);
      // HF tensors of the base and of the merge.
      std::map<std::string, Tensor> hf_base, hf_merged;
      for (const HfParamMap& m : layout.params) {
        const std::vector<Tensor> a = loom_to_hf(m, base.at(m.loom_name)), b = loom_to_hf(m, merged.at(m.loom_name));
        for (size_t p = 0; p < m.parts.size(); ++p) {
          hf_base.emplace(m.parts[p].name, copy(a[p]));
          hf_merged.emplace(m.parts[p].name, copy(b[p]));
        }
      }
      // PEFT: W_hf += scale · B_hf @ A on each module; the adapters' names sit under the PEFT prefix.
      const double scale = 5.0 / 3.0;
      const std::string peft = kPeftPrefix;
      std::set<std::string> adapted;
      for (const HfLoraMap& m : maps) {
        const std::vector<Tensor> bs = loom_to_hf(m.b, adapters.at(m.b.loom_name));
        const Tensor& A = adapters.at(m.loom_a);
        ASSERT_EQ(m.hf_a.size(), bs.size());
        for (size_t p = 0; p < bs.size(); ++p) {
          std::string w = m.b.parts[p].name;
          ASSERT_EQ(w.rfind(peft, 0), 0u) << w;
          w = w.substr(peft.size(), w.size() - peft.size() - std::string(".lora_B.weight").size()) + ".weight";
          ASSERT_EQ(m.hf_a[p].substr(peft.size()), w.substr(0, w.size() - 7) + ".lora_A.weight");
          Tensor& W = hf_base.at(w);
          const int64_t rows = W.shape()[0], in = W.shape()[1];
          ASSERT_EQ(bs[p].shape(), Shape({rows, R})) << w;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t k = 0; k < in; ++k) {
              double d = 0;
              for (int64_t j = 0; j < R; ++j) d += double(bs[p].data<float>()[r * R + j]) * double(A.data<float>()[j * in + k]);
              W.data<float>()[r * in + k] = float(double(W.data<float>()[r * in + k]) + scale * d);
            }
          adapted.insert(w);
        }
      }
      for (const auto& [name, want] : hf_merged) {
        const Tensor& got = hf_base.at(name);
        double worst = 0;
        for (int64_t i = 0; i < got.numel(); ++i)
          worst = std::max(worst, double(std::abs(got.data<float>()[i] - want.data<float>()[i])));
        if (adapted.count(name)) EXPECT_LT(worst, 1e-5) << name;
        else EXPECT_EQ(worst, 0.0) << name;
      }
      EXPECT_EQ(adapted.size(), size_t(c.num_layers) * (targets.size() == 2 ? 2 : 7));
    }
}

TEST(HfLoraLayout, Gpt2IsRefusedWithTheReason) {
  GPTConfig c;  // GPT-2 defaults
  c.num_layers = 1;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.vocab_size = 50;
  c.padded_vocab_size = 64;
  try {
    hf_lora_layout(c, {LoraTarget::kQkv}, 2);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("Conv1D c_attn"), std::string::npos) << e.what();
  }
}
