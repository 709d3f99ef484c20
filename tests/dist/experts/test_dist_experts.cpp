// Expert parameters in the distributed optimizer and in checkpoints under mpirun -np 4, on synthetic
// parameter sets laid out as GPTModel lays out a MoE model: per layer a dense unit (norm, TP-sharded fc1,
// router) that reads its expert unit (the E/EP local experts' fc1/fc2 weights, sharded over ETP, and an
// fc2 bias replicated over ETP), flagged Parameter::expert / ParamUnit::expert. For each grid
//   DP 4 with EP 2 (expert_dp 2);  TP 2 x DP 2 with EP 2, ETP 1 (the two TP ranks hold different experts);
//   TP 2 with EP 2, ETP 2 (expert_dp 1, ETP-sharded experts);  EP 1 (the expert groups are the dense ones)
// and every strategy (DDP, ZeRO-1/2/3, overlapped or not), every rank contributes rank-dependent gradients
// over two micro-batches driven through the layer hooks; then:
//   - the gradient norm (and at initialisation the parameter norm and the weights' state statistics)
//     equals the norm of every distinct element of the model, computed by hand over the union of all
//     ranks' layouts (each element once, whoever holds it);
//   - each step equals single-process AdamW / SGD on the expected gradients: dense ones averaged over
//     dp_cp (TP-summed when sequence-parallel), expert ones summed over expert_dp and scaled by 1/(DP·CP);
//     SGD is linear in the gradient, so a wrong scale or group shows in the values; every rank's
//     parameters (the replicas included) equal the reference afterwards;
//   - a checkpoint of the run holds every distinct element exactly once (owners of checkpoint_pieces.h),
//     with each rank's values, and loads into another expert layout.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <unistd.h>
#include <vector>

#include "loom/ckpt/sharded.h"
#include "loom/dist/parallel_state.h"
#include "loom/optim/distributed_optimizer.h"
#include "train/checkpoint_pieces.h"

using namespace loom;

namespace {

const Communicator& world() {
  static std::unique_ptr<Communicator> w = init_world(std::chrono::minutes(2));
  return *w;
}

constexpr int kExperts = 4, kHidden = 7, kFfn = 6, kLayers = 2;

struct Grid {
  int tp, ep, etp;
  const char* name;
};
const Grid kGrids[] = {{1, 2, 1, "DP4 EP2"}, {2, 2, 1, "TP2 DP2 EP2 ETP1"}, {2, 2, 2, "TP2 EP2 ETP2"}, {1, 1, 1, "DP4 EP1"}};

// A rank's place in both grids (PP = CP = 1), computed by hand from the rank: the norm reference
// enumerates every rank's layout with it.
struct Coords {
  int tp = 1, tp_rank = 0, dp = 1, dp_rank = 0;
  int ep = 1, ep_rank = 0, etp = 1, etp_rank = 0, edp = 1, edp_rank = 0;
};
Coords coords_of(const Grid& g, int world_size, int rank) {
  Coords c;
  c.tp = g.tp, c.tp_rank = rank % g.tp, c.dp = world_size / g.tp, c.dp_rank = rank / g.tp;
  c.ep = g.ep, c.etp = g.etp, c.etp_rank = rank % g.etp, c.ep_rank = rank / g.etp % g.ep;
  c.edp = world_size / (g.etp * g.ep), c.edp_rank = rank / (g.etp * g.ep);
  return c;
}

std::string expert_prefix(int l) { return "decoder.layers." + std::to_string(l) + ".mlp.experts."; }

// Units: embedding 0; layer l: dense 1 + 2l (reads 2 + 2l), experts 2 + 2l; head 1 + 2·kLayers.
std::vector<ParamUnit> build_layout(ParameterSet& s, const Coords& c) {
  std::vector<ParamUnit> units;
  auto unit = [&](const std::string& name, bool expert, auto add) {
    const int64_t begin = s.numel();
    add();
    units.push_back({name, begin, s.numel() - begin, {}, expert});
  };
  unit("embedding", false, [&] { s.add("embedding.word_embeddings.weight", {13, kHidden}, InitKind::kNormal, 0.02f, false); });
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    const int64_t rows = 6, local = rows / c.tp;
    unit(p.substr(0, p.size() - 1), false, [&] {
      s.add(p + "ln.weight", {kHidden}, InitKind::kOnes, 0.0f, true).sequence_parallel = c.tp > 1;
      s.add_sharded(p + "fc1.weight", {rows, kHidden}, 0, {{c.tp_rank * local, local}}, InitKind::kNormal, 0.02f, false);
      s.add(p + "mlp.router.weight", {kExperts, kHidden}, InitKind::kNormal, 0.02f, false);
    });
    units.back().reads = {int(units.size())};
    unit(p + "mlp.experts", true, [&] {
      const int local_experts = kExperts / c.ep, f = kFfn / c.etp;
      const std::vector<ShardRange> mine{{c.etp_rank * f, f}};
      for (int k = 0; k < local_experts; ++k) {
        const std::string e = std::to_string(c.ep_rank * local_experts + k);
        s.add_sharded(expert_prefix(l) + "linear_fc1.weight" + e, {kFfn, kHidden}, 0, mine, InitKind::kNormal, 0.02f, false)
            .expert = true;
        s.add_sharded(expert_prefix(l) + "linear_fc2.weight" + e, {kHidden, kFfn}, 1, mine, InitKind::kNormal, 0.01f, false)
            .expert = true;
        s.add(expert_prefix(l) + "linear_fc2.bias" + e, {kHidden}, InitKind::kZeros, 0.0f, true).expert = true;
      }
    });
  }
  unit("head", false, [&] {
    s.add("decoder.final_layernorm.weight", {kHidden}, InitKind::kOnes, 0.0f, true).sequence_parallel = c.tp > 1;
    s.add("output_layer.weight", {9, kHidden}, InitKind::kNormal, 0.02f, false);
  });
  return units;
}

bool hooked(int u) { return u == 0 || u % 2 == 1; }  // expert units are covered by their layer's hooks
bool in_unit(const Parameter& p, const ParamUnit& u) { return p.offset >= u.offset && p.offset < u.offset + u.numel; }

// Gradient of local element i for (step, micro-batch, key). Tabulated so every call site sees the same bits;
// of one sign and away from zero so that no expected gradient cancels.
float grad_value(int64_t i, int step, int mb, int key) {
  static const std::vector<float> table = [] {
    std::vector<float> t(size_t(3 * 2 * 8 * 2048));
    for (size_t k = 0; k < t.size(); ++k) {
      const size_t x = k % 2048, rest = k / 2048;
      const double key_d = double(rest % 8), mb_d = double(rest / 8 % 2), step_d = double(rest / 16);
      t[k] = float(0.05 * (1.5 + std::sin(0.37 * double(x) + 1.3 * step_d + 0.71 * mb_d + 2.1 * key_d)) *
                   (1.0 + 0.25 * double(x % 5)));
    }
    return t;
  }();
  return table[size_t(((step * 2 + mb) * 8 + key) * 2048 + i)];
}

// Who contributes a distinct gradient: dense replicated parameters agree across TP (key = DP rank), TP
// shards and sequence-parallel parameters differ per TP rank; experts differ per expert (EP rank) and
// replica (expert-DP rank), ETP shards per ETP rank, an ETP-replicated bias agrees across ETP.
int grad_key(const Parameter& p, const Coords& c, int dp_rank, int tp_rank, int edp_rank) {
  if (p.expert) {
    const int k = c.ep_rank * c.edp + edp_rank;
    return p.partition_dim >= 0 ? k * c.etp + c.etp_rank : k;
  }
  return p.partition_dim >= 0 || p.sequence_parallel ? dp_rank * c.tp + tp_rank : dp_rank;
}

// What the optimizer must see after finish_grad_sync for local element k of p on the rank at c (the same
// on every replica of that element).
float expected_grad(const Parameter& p, int64_t k, const Coords& c, int step) {
  const int64_t i = p.offset + k;
  double sum = 0;
  if (p.expert) {
    for (int e = 0; e < c.edp; ++e)
      for (int mb = 0; mb < 2; ++mb) sum += grad_value(i, step, mb, grad_key(p, c, 0, 0, e));
  } else {
    for (int d = 0; d < c.dp; ++d)
      for (int t = 0; t < c.tp; ++t) {
        if (!p.sequence_parallel && t != c.tp_rank) continue;
        for (int mb = 0; mb < 2; ++mb) sum += grad_value(i, step, mb, grad_key(p, c, d, t, 0));
      }
  }
  return float(sum / c.dp);  // dp_cp's size: the pre-scale of dense and expert buckets alike
}

// The global row-major index of local element k of p.
int64_t global_index(const Parameter& p, int64_t k) {
  if (p.shard.empty()) return k;
  const int d = p.partition_dim;
  int64_t inner = 1;
  for (int i = d + 1; i < p.shape.ndim(); ++i) inner *= p.shape[i];
  const int64_t local_d = p.shape[d], in = k % inner, ld = k / inner % local_d, o = k / inner / local_d;
  int64_t start = 0, g = -1;
  for (const ShardRange& r : p.shard) {
    if (ld < start + r.size) {
      g = r.start + (ld - start);
      break;
    }
    start += r.size;
  }
  return (o * p.global_shape[d] + g) * inner + in;
}

// The squared L2 norm of every distinct element of the model, from the union of all ranks' layouts.
double hand_norm_sq(const Grid& g, int step) {
  std::map<std::pair<std::string, int64_t>, float> distinct;
  for (int r = 0; r < world().size(); ++r) {
    const Coords c = coords_of(g, world().size(), r);
    ParameterSet s;
    build_layout(s, c);
    for (const Parameter& p : s.all())
      for (int64_t k = 0; k < p.shape.numel(); ++k) {
        const float v = expected_grad(p, k, c, step);
        const auto [it, fresh] = distinct.emplace(std::make_pair(p.name, global_index(p, k)), v);
        EXPECT_TRUE(fresh || it->second == v) << "replicas of " << p.name << " disagree in the reference";
      }
  }
  double sq = 0;
  for (const auto& [key, v] : distinct) sq += double(v) * double(v);
  return sq;
}

// Squared L2 and L1 norms of every distinct initial value of the model (initialisation is a function of
// the name and the global index, so every rank can build every other rank's values).
std::pair<double, double> hand_init_norms(const Grid& g, uint64_t seed) {
  std::map<std::pair<std::string, int64_t>, float> distinct;
  for (int r = 0; r < world().size(); ++r) {
    ParameterSet s;
    build_layout(s, coords_of(g, world().size(), r));
    std::vector<float> v(size_t(s.numel()));
    s.initialize_range(seed, 0, s.numel(), v.data());
    for (const Parameter& p : s.all())
      for (int64_t k = 0; k < p.shape.numel(); ++k) distinct.emplace(std::make_pair(p.name, global_index(p, k)), v[size_t(p.offset + k)]);
  }
  double sq = 0, l1 = 0;
  for (const auto& [key, v] : distinct) sq += double(v) * double(v), l1 += std::abs(double(v));
  return {sq, l1};
}

struct Case {
  ShardingStrategy sharding;
  bool overlap;
  bool overlap_params = false;
};
const Case kCases[] = {
    {ShardingStrategy::kNone, false},           {ShardingStrategy::kNone, true},
    {ShardingStrategy::kOptim, false},          {ShardingStrategy::kOptim, true, true},
    {ShardingStrategy::kOptimGrads, false},     {ShardingStrategy::kOptimGrads, true},
    {ShardingStrategy::kOptimGradsParams, false}, {ShardingStrategy::kOptimGradsParams, true, true},
};

std::unique_ptr<ParallelState> make_state(const Grid& g) {
  ParallelConfig cfg;
  cfg.tensor_model_parallel_size = g.tp;
  cfg.expert_model_parallel_size = g.ep;
  cfg.expert_tensor_parallel_size = g.etp;
  return ParallelState::create(cfg, world().split(0, world().rank(), "world"));
}

// A directory every rank agrees on (rank 0's pid).
std::string shared_dir(const std::string& tag) {
  const double pid = world().all_reduce_scalar(world().rank() == 0 ? double(::getpid()) : 0.0, ReduceOp::kSum);
  return (std::filesystem::temp_directory_path() / ("loom_dist_experts_" + tag + "_" + std::to_string(int64_t(pid))))
      .string();
}

// Runs three steps of `c` on grid g and checks gradients, norms and updates against the reference. With
// `save`, also saves a checkpoint to it at the end; returns the run's parameter values by name (host).
void run_case(const Grid& g, const Case& c, OptimizerKind kind, const std::string& save = "") {
  const bool sgd = kind == OptimizerKind::kSGD;
  SCOPED_TRACE(std::string(g.name) + " " + sharding_strategy_name(c.sharding) + (c.overlap ? " overlap" : "") +
               (c.overlap_params ? " overlap-param-gather" : "") + (sgd ? " sgd" : " adam"));
  auto ctx = make_cpu_context();
  auto ps = make_state(g);
  const Coords co = coords_of(g, world().size(), world().rank());
  ASSERT_EQ(co.tp_rank, ps->tp_rank());
  ASSERT_EQ(co.ep_rank, ps->ep_rank());
  ASSERT_EQ(co.etp_rank, ps->etp_rank());
  ASSERT_EQ(co.edp_rank, ps->expert_dp_rank());
  ASSERT_EQ(co.edp, ps->expert_dp().size());
  constexpr uint64_t kSeed = 17;
  constexpr float kLr = 3e-3f, kWd = 0.1f, kScale = 0.75f;

  ParameterSet ref;
  build_layout(ref, co);
  ref.allocate(*ctx);
  ref.initialize(kSeed);
  std::vector<ParamRange> ranges;
  for (const Parameter& p : ref.all()) ranges.push_back({p.offset, p.shape.numel(), !p.no_weight_decay});
  AdamW ref_adam(*ctx, ref.numel(), ranges, AdamWConfig{});
  OptimizerConfig oc;
  oc.kind = kind;
  oc.sgd_momentum = 0.9f;
  Tensor ref_momentum = Tensor::zeros({ref.numel()}, DType::kF32);

  ParameterSet set;
  const std::vector<ParamUnit> units = build_layout(set, co);
  set.allocate(*ctx, DType::kF32, DType::kF32, true, param_storage_for(c.sharding));
  DDPConfig ddp;
  ddp.sharding = c.sharding;
  ddp.bucket_size = 40;
  ddp.overlap_grad_reduce = c.overlap;
  ddp.overlap_param_gather = c.overlap_params;
  DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, oc);
  opt.initialize(kSeed);
  {  // The weights' figures count each distinct element once too.
    const auto [sq, l1] = hand_init_norms(g, kSeed);
    EXPECT_NEAR(opt.param_norm(), std::sqrt(sq), 1e-6 * std::sqrt(sq));
    const OptimizerStateStats st = opt.state_stats();
    EXPECT_NEAR(st.weight_l2, std::sqrt(sq), 1e-6 * std::sqrt(sq));
    EXPECT_NEAR(st.weight_l1, l1, 1e-6 * l1);
  }
  for (const auto& b : opt.bucket_info(0))
    EXPECT_EQ(b.group_size, b.expert ? ps->expert_dp().size() : ps->dp_cp().size());
  ParamHooks* hooks = opt.hooks(0);
  auto close = [](float got, float want) { return std::abs(got - want) <= 1e-6f * std::abs(want) + 1e-9f; };
  // Every parameter a hooked unit's computation reads: its own and, for a layer, its experts'.
  auto touches = [&](const Parameter& p, int u) {
    return in_unit(p, units[size_t(u)]) || (u % 2 == 1 && u + 1 < int(units.size()) && in_unit(p, units[size_t(u + 1)]));
  };
  auto check_params = [&](const std::string& what) {
    for (int u = 0; u < int(units.size()); ++u) {
      if (!hooked(u)) continue;
      hooks->before_forward(u);
      for (const Parameter& p : set.all()) {
        if (!touches(p, u)) continue;
        const float* got = p.compute.data<float>();
        const float* want = ref.find(p.name)->value.data<float>();
        for (int64_t k = 0; k < p.shape.numel(); ++k)
          ASSERT_TRUE(close(got[k], want[k])) << what << " " << p.name << "[" << k << "] " << got[k] << " vs " << want[k];
      }
      hooks->after_forward(u);
    }
  };

  for (int step = 0; step < 3; ++step) {
    for (const Parameter& p : ref.all())
      for (int64_t k = 0; k < p.shape.numel(); ++k) ref.grads().data<float>()[p.offset + k] = expected_grad(p, k, co, step);
    opt.start_step();
    for (int mb = 0; mb < 2; ++mb) {
      opt.set_last_microbatch(0, mb == 1);
      check_params("forward of step " + std::to_string(step));
      for (int u = int(units.size()) - 1; u >= 0; --u) {
        if (!hooked(u)) continue;
        hooks->before_backward(u);
        for (Parameter& p : set.all()) {
          if (!touches(p, u)) continue;
          float* pg = p.grad.data<float>();
          const int key = grad_key(p, co, co.dp_rank, co.tp_rank, co.edp_rank);
          for (int64_t k = 0; k < p.shape.numel(); ++k) pg[k] += grad_value(p.offset + k, step, mb, key);
        }
        hooks->after_backward(u);
      }
    }
    opt.finish_grad_sync();
    EXPECT_FALSE(opt.found_inf());
    const double want = std::sqrt(hand_norm_sq(g, step));
    EXPECT_NEAR(opt.grad_norm(), want, 1e-6 * want) << "step " << step;
    if (sgd) {
      for (const ParamRange& r : ranges) {
        SgdParams sp;
        sp.lr = kLr, sp.momentum = oc.sgd_momentum, sp.weight_decay = r.weight_decay ? kWd : 0.0f;
        sp.grad_scale = kScale, sp.zero_grad = true;
        const Shape s{r.numel};
        ctx->ops().sgd_update(ref.values().slice_flat(r.offset, s), ref.grads().slice_flat(r.offset, s),
                              ref_momentum.view().slice_flat(r.offset, s), sp);
      }
    } else {
      ref_adam.step(ref.values(), ref.grads(), kLr, kWd, kScale, true);
    }
    opt.step(kLr, kWd, kScale);
    int64_t owned[2] = {0, 0}, local[2] = {0, 0};  // dense, expert
    for (const Parameter& p : set.all()) local[p.expert] += p.shape.numel();
    for (const StateShard& s : opt.state_shards()) {
      const int64_t off = s.param->offset + s.begin;
      owned[s.param->expert] += s.end - s.begin;
      const TensorView state = sgd ? s.momentum_buffer : s.exp_avg;
      const float* want_state = (sgd ? ref_momentum : ref_adam.exp_avg()).data<float>() + off;
      for (int64_t k = 0; k < s.end - s.begin; ++k) {
        ASSERT_TRUE(close(s.master.data<float>()[k], ref.values().data<float>()[off + k])) << s.param->name << " master";
        ASSERT_TRUE(close(state.data<float>()[k], want_state[k])) << s.param->name << " state";
      }
    }
    // The owned pieces of the replicas tile the rank's layout once (sharded: dense over dp_cp, expert
    // over expert_dp) or each replica owns all of it.
    const bool none = c.sharding == ShardingStrategy::kNone;
    EXPECT_EQ(int64_t(ps->dp_cp().all_reduce_scalar(double(owned[0]))), (none ? co.dp : 1) * local[0]);
    EXPECT_EQ(int64_t(ps->expert_dp().all_reduce_scalar(double(owned[1]))), (none ? co.edp : 1) * local[1]);
  }
  check_params("after the last step");  // every replica's parameters (ZeRO: all-gathered) are the reference's

  if (save.empty()) return;
  std::vector<TensorPiece> pieces = checkpoint_save_pieces(*ps, opt, {&set}, /*save_optim=*/true);
  int64_t saved = 0;
  for (const TensorPiece& t : pieces) saved += (t.flat_end < 0 ? piece_box_numel(t) : t.flat_end) - t.flat_begin;
  save_sharded_checkpoint(save, 3, pieces, checkpoint_layout_json(*ps, c.sharding), "{}", ps->world());
  const ShardedCheckpoint ck = ShardedCheckpoint::open(save + "/iter_0000003");
  const auto layout = ck.layout_json();
  EXPECT_NE(layout.find("\"ep\":" + std::to_string(g.ep)), std::string::npos) << layout;
  EXPECT_NE(layout.find("\"etp\":" + std::to_string(g.etp)), std::string::npos) << layout;
  // Exactly once: the elements written over all ranks equal the distinct elements of the checkpoint's
  // tensors (weights and one optimizer state per weight), and every one of them is readable (covered).
  int64_t distinct = 0;
  for (const std::string& name : ck.tensor_names()) distinct += ck.global_shape(name).numel();
  EXPECT_EQ(int64_t(ps->world().all_reduce_scalar(double(saved))), distinct);
  const int64_t weights = [&] {
    int64_t n = 0;
    for (const std::string& name : ck.tensor_names())
      if (name.rfind("optimizer.", 0) != 0) n += ck.global_shape(name).numel();
    return n;
  }();
  EXPECT_EQ(distinct, 3 * weights);  // Adam: exp_avg and exp_avg_sq of every weight
  EXPECT_TRUE(ck.contains(expert_prefix(1) + "linear_fc2.bias" + std::to_string(kExperts - 1)));
  // What this rank holds is what the checkpoint says (its box of every tensor, values and state).
  for (const Parameter& p : ref.all()) {
    Tensor got = Tensor::empty(p.shape, DType::kF32), st = Tensor::empty(p.shape, DType::kF32);
    TensorPiece box = param_box(p, p.name);
    box.data = got;
    ck.read(box);
    box.name = std::string("optimizer.") + (sgd ? "momentum_buffer." : "exp_avg.") + p.name;
    box.data = st;
    ck.read(box);
    const float* want_state = (sgd ? ref_momentum : ref_adam.exp_avg()).data<float>() + p.offset;
    for (int64_t k = 0; k < p.shape.numel(); ++k) {
      ASSERT_TRUE(close(got.data<float>()[k], p.value.data<float>()[k])) << p.name << " saved value";
      ASSERT_TRUE(close(st.data<float>()[k], want_state[k])) << p.name << " saved state";
    }
  }
}

// Loads the checkpoint at `dir` into grid g with strategy s and checks that every rank's parameters
// (values and masters) are the checkpoint's.
void load_into(const Grid& g, ShardingStrategy s, const std::string& dir) {
  SCOPED_TRACE(std::string("load into ") + g.name + " " + sharding_strategy_name(s));
  auto ctx = make_cpu_context();
  auto ps = make_state(g);
  const Coords co = coords_of(g, world().size(), world().rank());
  ParameterSet set;
  const std::vector<ParamUnit> units = build_layout(set, co);
  set.allocate(*ctx, DType::kF32, DType::kF32, true, param_storage_for(s));
  DDPConfig ddp;
  ddp.sharding = s;
  DistributedOptimizer opt(*ctx, {&set}, {units}, *ps, ddp, OptimizerConfig{});
  const ShardedCheckpoint ck = ShardedCheckpoint::open(dir + "/iter_0000003");
  const std::vector<TensorPiece> targets = checkpoint_load_targets(opt, {&set}, /*load_optim=*/true);
  ck.read(targets);
  opt.sync_params_from_masters();
  for (int u = 0; u < int(units.size()); ++u) {
    if (!hooked(u)) continue;
    opt.hooks(0)->before_forward(u);
    for (const Parameter& p : set.all()) {
      if (!in_unit(p, units[size_t(u)]) && !(u % 2 == 1 && u + 1 < int(units.size()) && in_unit(p, units[size_t(u + 1)])))
        continue;
      Tensor want = Tensor::empty(p.shape, DType::kF32);
      TensorPiece box = param_box(p, p.name);
      box.data = want;
      ck.read(box);
      ASSERT_EQ(std::memcmp(p.compute.raw(), want.raw(), size_t(p.shape.numel()) * 4), 0) << p.name;
    }
    opt.hooks(0)->after_forward(u);
  }
}

}  // namespace

TEST(DistExperts, EveryGridAndStrategyEqualsTheReference) {
  if (world().size() != 4) GTEST_SKIP() << "run under mpirun -np 4";
  for (const Grid& g : kGrids)
    for (const Case& c : kCases) run_case(g, c, OptimizerKind::kAdam);
}

// SGD is linear in the gradient: the expert pre-scale (1/(DP·CP), not 1/expert_dp) and the reduction group
// show in the updated values.
TEST(DistExperts, SgdShowsTheExpertGradientScale) {
  if (world().size() != 4) GTEST_SKIP() << "run under mpirun -np 4";
  for (const Grid& g : kGrids)
    for (const Case& c : {kCases[0], kCases[3], kCases[5], kCases[7]}) run_case(g, c, OptimizerKind::kSGD);
}

// Checkpoints: saved from TP2 x EP2 (ETP 1, the two TP ranks holding different experts) under ZeRO-1 and
// from TP2 x EP2 x ETP2 without ZeRO, each element exactly once; loaded into EP 1 (every rank asks for
// every expert) and into EP 2 under ZeRO-3 (each rank for some experts only).
TEST(DistExperts, CheckpointsSaveEachElementOnceAndReshard) {
  if (world().size() != 4) GTEST_SKIP() << "run under mpirun -np 4";
  struct Save {
    const Grid& grid;
    Case c;
  };
  for (const Save& s : {Save{kGrids[1], kCases[3]}, Save{kGrids[2], kCases[0]}, Save{kGrids[0], kCases[6]}}) {
    const std::string dir = shared_dir(std::to_string(&s.grid - kGrids));
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
    world().barrier();
    run_case(s.grid, s.c, OptimizerKind::kAdam, dir);
    load_into(kGrids[3], ShardingStrategy::kNone, dir);
    load_into(kGrids[2], ShardingStrategy::kOptimGradsParams, dir);
    load_into(kGrids[1], ShardingStrategy::kOptimGrads, dir);
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
  }
}
