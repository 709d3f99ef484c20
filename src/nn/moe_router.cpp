// The MoE router: flag parsing and validation, the host routing (top-k with Megatron-Core's score functions,
// capacity, load-balancing and z losses) and its backward, the expert-bias update rule, and the Router
// module that runs the gate GEMM on the device around them. Semantics: loom/nn/moe.h.
// Routing math is f64 on the f32 logits; results are stored as f32. Every top-k breaks ties towards the
// lower index (experts of a token, tokens of an expert), so routing is a pure function of the logits.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "loom/nn/modules.h"
#include "loom/nn/moe.h"

namespace loom {

MoeScoreFunction parse_moe_score_function(const std::string& s) {
  if (s == "softmax") return MoeScoreFunction::kSoftmax;
  if (s == "sigmoid") return MoeScoreFunction::kSigmoid;
  user_error("--moe-router-score-function must be softmax or sigmoid, got '", s, "'");
}

MoeLoadBalancing parse_moe_load_balancing(const std::string& s) {
  if (s == "aux_loss") return MoeLoadBalancing::kAuxLoss;
  if (s == "seq_aux_loss") return MoeLoadBalancing::kSeqAuxLoss;
  if (s == "sinkhorn") return MoeLoadBalancing::kSinkhorn;
  if (s == "none") return MoeLoadBalancing::kNone;
  user_error("--moe-router-load-balancing-type must be aux_loss, seq_aux_loss, sinkhorn or none, got '", s, "'");
}

const char* moe_load_balancing_name(MoeLoadBalancing b) {
  switch (b) {
    case MoeLoadBalancing::kAuxLoss: return "aux_loss";
    case MoeLoadBalancing::kSeqAuxLoss: return "seq_aux_loss";
    case MoeLoadBalancing::kSinkhorn: return "sinkhorn";
    case MoeLoadBalancing::kNone: return "none";
  }
  return "?";
}

MoeDropPolicy parse_moe_drop_policy(const std::string& s) {
  if (s == "probs") return MoeDropPolicy::kProbs;
  if (s == "position") return MoeDropPolicy::kPosition;
  user_error("--moe-token-drop-policy must be probs or position, got '", s, "'");
}

void RouterConfig::validate() const {
  if (num_experts < 1) user_error("--num-experts must be at least 1, got ", num_experts);
  if (topk < 1 || topk > num_experts)
    user_error("--moe-router-topk must be between 1 and --num-experts (", num_experts, "), got ", topk);
  if (topk == 1 && score_function == MoeScoreFunction::kSoftmax && !pre_softmax &&
      load_balancing != MoeLoadBalancing::kSinkhorn)
    user_error("--moe-router-topk 1 with the softmax score function needs --moe-router-pre-softmax (a softmax over "
               "one chosen logit is constant 1 and gives the router no gradient; as Megatron-Core)");
  if (capacity_factor && !(*capacity_factor > 0))
    user_error("--moe-expert-capacity-factor must be > 0, got ", *capacity_factor,
               " (leave it unset for no token dropping)");
  if (pad_to_capacity && !capacity_factor)
    user_error("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  if (enable_expert_bias && score_function != MoeScoreFunction::kSigmoid)
    user_error("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron-Core)");
  if (!(aux_loss_coeff >= 0)) user_error("--moe-aux-loss-coeff must be >= 0, got ", aux_loss_coeff);
  if (!(z_loss_coeff >= 0)) user_error("--moe-z-loss-coeff must be >= 0, got ", z_loss_coeff);
  if (!(topk_scaling_factor >= 0))
    user_error("--moe-router-topk-scaling-factor must be > 0 when set, got ", topk_scaling_factor);
  if (load_balancing == MoeLoadBalancing::kSinkhorn) {  // Megatron-Core's sinkhorn router has none of these
    const char* s = "--moe-router-load-balancing-type sinkhorn ";
    if (aux_loss_coeff != 0) user_error(s, "does not take an aux loss (as Megatron-Core); drop --moe-aux-loss-coeff");
    if (capacity_factor) user_error(s, "drops no tokens (as Megatron-Core); drop --moe-expert-capacity-factor");
    if (score_function != MoeScoreFunction::kSoftmax || pre_softmax || topk_scaling_factor != 0)
      user_error(s, "has its own scores (sigmoid for top-1, a softmax over all experts otherwise); drop "
                 "--moe-router-score-function, --moe-router-pre-softmax and --moe-router-topk-scaling-factor");
  }
}

int64_t Routing::num_rows() const { return std::accumulate(group_sizes.begin(), group_sizes.end(), int64_t(0)); }

namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// softmax of x[0..n) into out; returns logsumexp.
double softmax(const double* x, int64_t n, double* out) {
  double m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(x[i] - m));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
  return m + std::log(sum);
}

// The k largest of v[0..n), best first, ties to the lower index.
std::vector<int32_t> topk_indices(const double* v, int64_t n, int64_t k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  idx.resize(size_t(k));
  return idx;
}

// The scores the load-balancing loss uses (Megatron's compute_routing_scores_for_aux_loss) for one token:
// softmax, or sigmoid normalised over all experts.
void aux_scores(MoeScoreFunction f, const double* l, int64_t E, double* out) {
  if (f == MoeScoreFunction::kSoftmax) {
    softmax(l, E, out);
    return;
  }
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (out[e] = sigmoid(l[e]));
  for (int64_t e = 0; e < E; ++e) out[e] /= sum + 1e-20;
}

// Per-token routing before capacity: chosen experts and their (scaled) probs.
struct TokenChoice {
  std::vector<int32_t> idx;
  std::vector<double> prob;
};

TokenChoice choose(const RouterConfig& cfg, const double* l, const std::vector<float>& bias, double* scratch) {
  const int64_t E = cfg.num_experts, k = cfg.topk;
  TokenChoice t;
  t.prob.resize(size_t(k));
  if (cfg.score_function == MoeScoreFunction::kSoftmax) {
    if (cfg.pre_softmax) {
      softmax(l, E, scratch);
      t.idx = topk_indices(scratch, E, k);
      for (int64_t j = 0; j < k; ++j) t.prob[j] = scratch[t.idx[j]];
    } else {
      t.idx = topk_indices(l, E, k);
      std::vector<double> x(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) x[j] = l[t.idx[j]];
      softmax(x.data(), k, t.prob.data());
    }
  } else {
    for (int64_t e = 0; e < E; ++e) scratch[e] = sigmoid(l[e]) + (bias.empty() ? 0.0 : double(bias[e]));
    t.idx = topk_indices(scratch, E, k);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += (t.prob[j] = sigmoid(l[t.idx[j]]));
    if (k > 1)
      for (int64_t j = 0; j < k; ++j) t.prob[j] /= sum + 1e-20;
  }
  if (cfg.topk_scaling_factor != 0)
    for (double& p : t.prob) p *= cfg.topk_scaling_factor;
  return t;
}

// Sinkhorn-Knopp balancing of exp(l) (N, E) (Megatron-Core's moe_utils.sinkhorn, in f64): scale rows and
// columns until the column factors move by less than 1e-4 on average. Capped at 10000 sweeps (it converges
// in tens for sensible logits).
std::vector<double> sinkhorn(const std::vector<double>& l, int64_t N, int64_t E) {
  std::vector<double> cost(l.size()), d0(static_cast<size_t>(N), 1.0), d1(static_cast<size_t>(E), 1.0);
  for (size_t i = 0; i < l.size(); ++i) cost[i] = std::exp(l[i]);
  const double eps = 1e-8;
  std::vector<double> d1_old = d1;
  for (int sweep = 0; sweep < 10000; ++sweep) {
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += d1[e] * cost[n * E + e];
      d0[n] = (1.0 / double(N)) / (s + eps);
    }
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += d0[n] * cost[n * E + e];
      d1[e] = (1.0 / double(E)) / (s + eps);
    }
    double err = 0;
    for (int64_t e = 0; e < E; ++e) err += std::abs(d1_old[e] - d1[e]);
    d1_old = d1;
    if (err / double(E) <= 1e-4) break;
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) cost[n * E + e] *= d1[e] * d0[n];
  return cost;
}

// Sinkhorn routing of one token: the top-k of `select` (the balanced row in training, else the
// activation), probs = the activation (sigmoid for top-1, softmax over all E otherwise) at those experts.
TokenChoice choose_sinkhorn(const RouterConfig& cfg, const double* l, const double* select, double* act) {
  const int64_t E = cfg.num_experts, k = cfg.topk;
  if (k == 1)
    for (int64_t e = 0; e < E; ++e) act[e] = sigmoid(l[e]);
  else
    softmax(l, E, act);
  TokenChoice t;
  t.idx = topk_indices(select ? select : act, E, k);
  for (int64_t j = 0; j < k; ++j) t.prob.push_back(act[t.idx[j]]);
  return t;
}

// The per-(token, expert) weight G with d(aux_loss)/d(scores[n, e]) = G[n, e]; also returns the loss.
double aux_loss_weights(const RouterConfig& cfg, const std::vector<double>& scores, int64_t N, int64_t seq_length,
                        std::vector<double>& G) {
  const int64_t E = cfg.num_experts, k = cfg.topk;
  G.assign(size_t(N * E), 0.0);
  if (N == 0) return 0;
  std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) chosen[n] = topk_indices(&scores[n * E], E, k);
  const double coeff = cfg.aux_loss_coeff;
  if (cfg.load_balancing == MoeLoadBalancing::kAuxLoss) {
    std::vector<double> count(size_t(E), 0.0), psum(size_t(E), 0.0);
    for (int64_t n = 0; n < N; ++n) {
      for (int32_t e : chosen[n]) count[e] += 1;
      for (int64_t e = 0; e < E; ++e) psum[e] += scores[n * E + e];
    }
    const double c = double(E) * coeff / (double(k) * double(N) * double(N));
    double loss = 0;
    for (int64_t e = 0; e < E; ++e) loss += psum[e] * count[e];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) G[n * E + e] = count[e] * c;
    return loss * c;
  }
  // seq_aux_loss: per sequence b (tokens b·T .. b·T + T - 1).
  const int64_t T = seq_length, B = N / T;
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> cost(size_t(E), 0.0), pmean(size_t(E), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = b * T + t;
      for (int32_t e : chosen[n]) cost[e] += 1;
      for (int64_t e = 0; e < E; ++e) pmean[e] += scores[n * E + e];
    }
    for (int64_t e = 0; e < E; ++e) {
      cost[e] /= double(T) * double(k) / double(E);
      pmean[e] /= double(T);
      loss += cost[e] * pmean[e];
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) G[(b * T + t) * E + e] = coeff * cost[e] / (double(B) * double(T));
  }
  return coeff * loss / double(B);
}

bool has_aux_loss(const RouterConfig& cfg, bool training) {
  return training && cfg.aux_loss_coeff != 0 && (cfg.load_balancing == MoeLoadBalancing::kAuxLoss ||
                                                 cfg.load_balancing == MoeLoadBalancing::kSeqAuxLoss);
}

void check_seq_length(const RouterConfig& cfg, int64_t N, int64_t seq_length, bool training) {
  if (!has_aux_loss(cfg, training) || cfg.load_balancing != MoeLoadBalancing::kSeqAuxLoss) return;
  LOOM_CHECK(seq_length > 0 && N % seq_length == 0, "[router] seq_aux_loss needs the ", N,
             " tokens to be whole sequences of seq_length ", seq_length);
}

std::vector<double> to_f64(const float* x, int64_t n) { return std::vector<double>(x, x + n); }

}  // namespace

Routing route_tokens(const RouterConfig& cfg, const float* logits_f32, int64_t N, int64_t seq_length, bool training,
                     const std::vector<float>& expert_bias) {
  cfg.validate();
  check_seq_length(cfg, N, seq_length, training);
  const int64_t E = cfg.num_experts, k = cfg.topk;
  LOOM_CHECK(expert_bias.empty() || int64_t(expert_bias.size()) == E, "[router] expected ", E,
             " expert biases, got ", expert_bias.size());
  const std::vector<double> l = to_f64(logits_f32, N * E);
  Routing r;
  r.N = N;
  r.E = E;
  r.k = k;
  r.topk_idx.resize(size_t(N * k));
  r.topk_probs.resize(size_t(N * k));
  std::vector<double> gates(size_t(N * E), 0.0), scratch(static_cast<size_t>(E));
  std::vector<char> map(size_t(N * E), 0);
  const bool sink = cfg.load_balancing == MoeLoadBalancing::kSinkhorn;
  const std::vector<double> balanced = sink && training ? sinkhorn(l, N, E) : std::vector<double>();
  for (int64_t n = 0; n < N; ++n) {
    const TokenChoice t =
        sink ? choose_sinkhorn(cfg, &l[n * E], balanced.empty() ? nullptr : &balanced[n * E], scratch.data())
             : choose(cfg, &l[n * E], cfg.enable_expert_bias ? expert_bias : std::vector<float>{}, scratch.data());
    for (int64_t j = 0; j < k; ++j) {
      r.topk_idx[n * k + j] = t.idx[j];
      gates[n * E + t.idx[j]] = t.prob[j];
      map[n * E + t.idx[j]] = 1;
    }
  }
  // Capacity: a column mask of the kept (token, expert) pairs.
  std::vector<char> final_map = map;
  if (cfg.capacity_factor) {
    const int64_t cap = int64_t(std::ceil(double(N * k) / double(E) * *cfg.capacity_factor));
    if (cap <= N) {
      std::vector<char> keep(size_t(N * E), 0);
      std::vector<int32_t> order(static_cast<size_t>(N));
      std::vector<double> v(static_cast<size_t>(N));
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t n = 0; n < N; ++n)
          v[n] = cfg.drop_policy == MoeDropPolicy::kProbs ? gates[n * E + e] : double(map[n * E + e]);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + cap, order.end(),
                          [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
        for (int64_t i = 0; i < cap; ++i) keep[order[i] * E + e] = 1;
      }
      for (int64_t i = 0; i < N * E; ++i) final_map[i] = cfg.pad_to_capacity ? keep[i] : char(map[i] && keep[i]);
    } else if (cfg.pad_to_capacity) {
      std::fill(final_map.begin(), final_map.end(), 1);  // every expert gets all N tokens
    }
  }
  r.probs.assign(size_t(N * E), 0.0f);
  r.group_sizes.assign(size_t(E), 0);
  for (int64_t i = 0; i < N * E; ++i) {
    if (!final_map[i]) continue;
    r.probs[i] = float(gates[i]);
    ++r.group_sizes[i % E];
  }
  r.tokens_per_expert = r.group_sizes;
  r.row_id_map.assign(size_t(N * E), -1);
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      if (final_map[n * E + e]) r.row_id_map[n * E + e] = int32_t(row++);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) r.topk_probs[n * k + j] = r.probs[n * E + r.topk_idx[n * k + j]];

  if (has_aux_loss(cfg, training)) {
    std::vector<double> scores(static_cast<size_t>(N * E)), G;
    for (int64_t n = 0; n < N; ++n) aux_scores(cfg.score_function, &l[n * E], E, &scores[n * E]);
    r.aux_loss = aux_loss_weights(cfg, scores, N, seq_length, G);
  }
  if (training && cfg.z_loss_coeff != 0 && N > 0) {
    double z = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double lse = softmax(&l[n * E], E, scratch.data());
      z += lse * lse;
    }
    r.z_loss = cfg.z_loss_coeff * z / double(N);
  }
  return r;
}

void route_tokens_backward(const RouterConfig& cfg, const float* logits_f32, const Routing& r, const float* dprobs,
                           int64_t seq_length, bool training, double aux_grad_scale,
                           const std::vector<float>& expert_bias, float* dlogits) {
  const int64_t N = r.N, E = r.E, k = r.k;
  const std::vector<double> l = to_f64(logits_f32, N * E);
  std::vector<double> dl(size_t(N * E), 0.0), s(static_cast<size_t>(E)), ds(static_cast<size_t>(E));
  std::vector<double> dp(static_cast<size_t>(k));
  const double sf = cfg.topk_scaling_factor != 0 ? cfg.topk_scaling_factor : 1.0;
  for (int64_t n = 0; n < N; ++n) {
    const double* ln = &l[n * E];
    double* dln = &dl[n * E];
    const int32_t* idx = &r.topk_idx[n * k];
    // Only kept top-k pairs carry a gradient (dropped and padding pairs are multiplied by a 0 mask).
    for (int64_t j = 0; j < k; ++j)
      dp[j] = r.row_id_map[n * E + idx[j]] >= 0 ? sf * double(dprobs[n * E + idx[j]]) : 0.0;
    // Sinkhorn's probs are the softmax over all E (k > 1), like pre-softmax, or the sigmoid (k = 1).
    const bool sink = cfg.load_balancing == MoeLoadBalancing::kSinkhorn;
    if ((cfg.score_function == MoeScoreFunction::kSoftmax && cfg.pre_softmax) || (sink && k > 1)) {
      softmax(ln, E, s.data());
      std::fill(ds.begin(), ds.end(), 0.0);
      for (int64_t j = 0; j < k; ++j) ds[idx[j]] = dp[j];
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += s[e] * ds[e];
      for (int64_t e = 0; e < E; ++e) dln[e] += s[e] * (ds[e] - dot);
    } else if (cfg.score_function == MoeScoreFunction::kSoftmax && !sink) {
      std::vector<double> x(static_cast<size_t>(k)), p(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) x[j] = ln[idx[j]];
      softmax(x.data(), k, p.data());
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += p[j] * dp[j];
      for (int64_t j = 0; j < k; ++j) dln[idx[j]] += p[j] * (dp[j] - dot);
    } else {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += (s[j] = sigmoid(ln[idx[j]]));
      const double D = sum + 1e-20;
      double dot = 0;  // Σ dp_i · q_i with q = s / D
      for (int64_t j = 0; j < k; ++j) dot += dp[j] * s[j] / D;
      for (int64_t j = 0; j < k; ++j) {
        const double dsj = k > 1 ? (dp[j] - dot) / D : dp[j];
        dln[idx[j]] += dsj * s[j] * (1.0 - s[j]);
      }
    }
  }
  (void)expert_bias;  // the bias moves the selection only; it has no gradient path
  if (has_aux_loss(cfg, training) && N > 0) {
    check_seq_length(cfg, N, seq_length, training);
    std::vector<double> scores(static_cast<size_t>(N * E)), G;
    for (int64_t n = 0; n < N; ++n) aux_scores(cfg.score_function, &l[n * E], E, &scores[n * E]);
    aux_loss_weights(cfg, scores, N, seq_length, G);
    for (int64_t n = 0; n < N; ++n) {
      const double* q = &scores[n * E];
      const double* g = &G[n * E];
      double* dln = &dl[n * E];
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += q[e] * g[e];
      if (cfg.score_function == MoeScoreFunction::kSoftmax) {
        for (int64_t e = 0; e < E; ++e) dln[e] += aux_grad_scale * q[e] * (g[e] - dot);
      } else {
        // q = σ / (Σσ + 1e-20): dσ_e = (g_e - Σ g·q) / D, D = Σσ + 1e-20 = σ_e / q_e.
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += (s[e] = sigmoid(l[n * E + e]));
        const double D = sum + 1e-20;
        for (int64_t e = 0; e < E; ++e) dln[e] += aux_grad_scale * (g[e] - dot) / D * s[e] * (1.0 - s[e]);
      }
    }
  }
  if (training && cfg.z_loss_coeff != 0 && N > 0) {
    for (int64_t n = 0; n < N; ++n) {
      const double lse = softmax(&l[n * E], E, s.data());
      const double c = aux_grad_scale * cfg.z_loss_coeff * 2.0 * lse / double(N);
      for (int64_t e = 0; e < E; ++e) dl[n * E + e] += c * s[e];
    }
  }
  for (int64_t i = 0; i < N * E; ++i) dlogits[i] = float(dl[i]);
}

std::vector<float> get_updated_expert_bias(const std::vector<float>& tokens_per_expert,
                                           const std::vector<float>& expert_bias, float update_rate) {
  LOOM_CHECK(tokens_per_expert.size() == expert_bias.size() && !expert_bias.empty(),
             "[router] expert bias update: expected one token count per expert (", expert_bias.size(), "), got ",
             tokens_per_expert.size());
  float sum = 0;
  for (float t : tokens_per_expert) sum += t;
  const float mean = sum / float(tokens_per_expert.size());
  std::vector<float> out(expert_bias.size());
  for (size_t e = 0; e < out.size(); ++e) {
    const float offset = mean - tokens_per_expert[e];
    const float sign = offset > 0 ? 1.0f : (offset < 0 ? -1.0f : 0.0f);
    out[e] = expert_bias[e] + sign * update_rate;
  }
  return out;
}

Router::Router(ParameterSet& ps, const std::string& prefix, int64_t hidden, const RouterConfig& cfg, float init_std)
    : cfg_(cfg), hidden_(hidden) {
  cfg_.validate();
  weight_ = &ps.add(prefix + ".router.weight", {cfg.num_experts, hidden}, InitKind::kNormal, init_std, false);
  if (cfg.enable_expert_bias) expert_bias_.assign(size_t(cfg.num_experts), 0.0f);
  local_tokens_.assign(size_t(cfg.num_experts), 0.0f);
}

void Router::forward(const DeviceContext& ctx, Saved& s, TensorView inp, int64_t seq_length, bool training,
                     const RoutingGroup* group) const {
  const int64_t E = cfg_.num_experts, Nl = inp.numel() / hidden_;
  Tensor logits = ctx.empty({Nl, E}, DType::kF32);
  ctx.ops().matmul_forward(logits, inp.reshape({Nl, hidden_}), weight_->compute, TensorView());
  std::vector<float> local(size_t(Nl * E));
  if (Nl > 0) ctx.copy(TensorView(local.data(), DType::kF32, {Nl, E}), logits);
  const int64_t N = group ? group->num_tokens : Nl;
  if (group) {
    LOOM_CHECK(int64_t(group->local_tokens.size()) == Nl, "[router] the routing group lists ",
               group->local_tokens.size(), " local tokens, the input has ", Nl);
    s.logits.assign(size_t(N * E), 0.0f);
    group->gather(s.logits.data(), local.data(), E);
  } else {
    s.logits = std::move(local);
  }
  s.routing = route_tokens(cfg_, s.logits.data(), N, seq_length, training, expert_bias_);
  s.group = group;
  s.seq_length = seq_length;
  s.training = training;
  // This rank's rows: its tokens' probabilities and a permutation of them alone (expert-major, local order).
  std::vector<float> probs(size_t(Nl * E));
  std::vector<int32_t> map(size_t(Nl * E), -1);
  s.group_sizes.assign(size_t(E), 0);
  for (int64_t n = 0; n < Nl; ++n) {
    const int64_t t = group ? group->local_tokens[size_t(n)] : n;
    for (int64_t e = 0; e < E; ++e) {
      probs[n * E + e] = s.routing.probs[t * E + e];
      if (s.routing.row_id_map[t * E + e] >= 0) map[n * E + e] = 0;
    }
  }
  int32_t row = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < Nl; ++n)
      if (map[n * E + e] == 0) {
        map[n * E + e] = row++;
        ++s.group_sizes[e];
      }
  ensure_tensor(ctx, s.probs, {Nl, E});
  ensure_tensor(ctx, s.row_id_map, {Nl, E}, DType::kI32);
  if (Nl > 0) {
    ctx.copy(s.probs, TensorView(probs.data(), DType::kF32, {Nl, E}));
    ctx.copy(s.row_id_map, TensorView(map.data(), DType::kI32, {Nl, E}));
  }
}

void Router::backward(const DeviceContext& ctx, TensorView dinp, TensorView dprobs, TensorView inp, const Saved& s,
                      double aux_grad_scale) const {
  const int64_t E = cfg_.num_experts, N = s.routing.N, Nl = inp.numel() / hidden_;
  LOOM_CHECK(dprobs.dtype() == DType::kF32 && dprobs.numel() == Nl * E, "[router] expected dprobs (", Nl, ", ", E,
             ") f32, got ", dprobs.desc());
  std::vector<float> local(size_t(Nl * E)), dp, dl(size_t(N * E));
  if (Nl > 0) ctx.copy(TensorView(local.data(), DType::kF32, {Nl, E}), dprobs);
  if (s.group) {
    dp.assign(size_t(N * E), 0.0f);
    s.group->gather(dp.data(), local.data(), E);
  } else {
    dp = std::move(local);
  }
  route_tokens_backward(cfg_, s.logits.data(), s.routing, dp.data(), s.seq_length, s.training, aux_grad_scale,
                        expert_bias_, dl.data());
  if (s.group) {  // this rank's rows of the micro-batch's gradient
    std::vector<float> mine(size_t(Nl * E));
    for (int64_t n = 0; n < Nl; ++n)
      std::copy_n(&dl[size_t(s.group->local_tokens[size_t(n)] * E)], E, &mine[size_t(n * E)]);
    dl = std::move(mine);
  }
  Tensor dlogits = ctx.empty({Nl, E}, DType::kF32);
  if (Nl > 0) ctx.copy(dlogits, TensorView(dl.data(), DType::kF32, {Nl, E}));
  const DType cd = weight_->compute.dtype();
  if (cd != DType::kF32) {
    Tensor d16 = ctx.empty({Nl, E}, cd);
    ctx.ops().cast(d16, dlogits);
    dlogits = d16;
  }
  ctx.ops().matmul_backward(dinp.reshape({Nl, hidden_}), weight_->grad, TensorView(), dlogits,
                            inp.reshape({Nl, hidden_}), weight_->compute);
}

void Router::update_expert_bias(const std::vector<float>& tokens_per_expert) {
  LOOM_CHECK(cfg_.enable_expert_bias, "[router] update_expert_bias needs --moe-router-enable-expert-bias");
  expert_bias_ = get_updated_expert_bias(tokens_per_expert, expert_bias_, float(cfg_.bias_update_rate));
  std::fill(local_tokens_.begin(), local_tokens_.end(), 0.0f);
}

}  // namespace loom
