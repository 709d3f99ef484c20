// `loom train`'s mixture-of-experts flags (Megatron-LM's names, defaults and meanings; docs/models.md
// "Mixture of experts") and --moe-layer-freq's pattern language. Spliced into the train flag table by
// args.cpp; the cross-flag rules live in GPTConfig::validate_architecture and TrainConfig::validate.
#include <cctype>

#include "loom/core/check.h"
#include "train/args_checks.h"

namespace loom {

namespace {

// A recursive-descent reader of the list expressions Megatron evaluates with Python's eval():
//   expr := term ('+' term)* ;  term := atom ('*' int)* ;  atom := '[' int (',' int)* ']' | '(' expr ')'
// e.g. "[1,0,1]", "([0]+[1]*3)*2", "[0]*3+[1]*45".
class PatternReader {
 public:
  explicit PatternReader(const std::string& s) : s_(s) {}
  std::vector<int> read() {
    std::vector<int> v = expr();
    skip();
    if (i_ != s_.size()) fail("unexpected '" + std::string(1, s_[i_]) + "'");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    user_error("--moe-layer-freq '", s_, "': ", why, " at character ", i_ + 1,
               "; expected an integer N (every N-th layer) or a list expression such as [1,0,1,1] or ([0]+[1]*3)*2");
  }
  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  int64_t integer() {
    skip();
    const size_t start = i_;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    if (start == i_) fail("expected an integer");
    if (i_ - start > 6) fail("integer too large");
    return std::stoll(s_.substr(start, i_ - start));
  }
  std::vector<int> atom() {
    std::vector<int> v;
    if (eat('[')) {
      do {
        const int64_t x = integer();
        if (x != 0 && x != 1) fail("layer entries must be 0 (dense) or 1 (MoE), got " + std::to_string(x));
        v.push_back(int(x));
      } while (eat(','));
      if (!eat(']')) fail("expected ']'");
      return v;
    }
    if (eat('(')) {
      v = expr();
      if (!eat(')')) fail("expected ')'");
      return v;
    }
    fail("expected '[' or '('");
  }
  std::vector<int> term() {
    std::vector<int> v = atom();
    while (eat('*')) {
      const int64_t n = integer();
      if (n < 0 || int64_t(v.size()) * n > 1'000'000) fail("repeat count out of range");
      std::vector<int> r;
      for (int64_t k = 0; k < n; ++k) r.insert(r.end(), v.begin(), v.end());
      v = std::move(r);
    }
    return v;
  }
  std::vector<int> expr() {
    std::vector<int> v = term();
    while (eat('+')) {
      const std::vector<int> w = term();
      v.insert(v.end(), w.begin(), w.end());
    }
    return v;
  }

  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace

std::vector<int> parse_moe_layer_freq(const std::string& v, int64_t num_layers) {
  size_t digits = 0;
  while (digits < v.size() && std::isdigit(static_cast<unsigned char>(v[digits]))) ++digits;
  if (!v.empty() && digits == v.size()) {
    const int64_t n = parse_int_flag("--moe-layer-freq", v);
    if (n < 1) user_error("--moe-layer-freq must be >= 1 (every N-th layer is a MoE layer), got ", v);
    std::vector<int> p(size_t(std::max<int64_t>(num_layers, 0)));
    for (int64_t l = 0; l < num_layers; ++l) p[size_t(l)] = l % n == 0 ? 1 : 0;
    return p;
  }
  std::vector<int> p = PatternReader(v).read();
  if (int64_t(p.size()) != num_layers)
    user_error("--moe-layer-freq '", v, "' describes ", p.size(), " layers but --num-layers is ", num_layers);
  return p;
}

std::vector<FlagSpec<TrainConfig>> moe_flag_specs() {
  using C = TrainConfig;
  using V = const std::vector<std::string>&;
  auto one = [](const char* name, const char* metavar, const char* help, std::function<void(C&, const std::string&)> f) {
    return FlagSpec<C>{{name, Arity::kOne, metavar, help}, [f](C& c, V v) { f(c, v[0]); }};
  };
  auto sw = [](const char* name, const char* help, std::function<void(C&)> f) {
    return FlagSpec<C>{{name, Arity::kSwitch, "", help}, [f](C& c, V) { f(c); }};
  };
  auto positive = [](const char* flag, const std::string& v) {
    const int64_t n = parse_int_flag(flag, v);
    if (n < 1) user_error(flag, " must be >= 1, got ", v);
    return n;
  };
  std::vector<FlagSpec<C>> t;
  t.push_back(one("--num-experts", "E", "mixture of experts: E routed experts in each MoE layer (default: a dense model)",
                  [positive](C& c, const std::string& v) {
                    c.model.moe.num_experts = c.model.moe.router.num_experts = positive("--num-experts", v);
                  }));
  t.push_back(one("--moe-ffn-hidden-size", "F", "each expert's FFN width (default --ffn-hidden-size)",
                  [positive](C& c, const std::string& v) { c.model.moe.ffn_hidden_size = positive("--moe-ffn-hidden-size", v); }));
  t.push_back(one("--moe-router-topk", "K", "experts per token (default 2)",
                  [positive](C& c, const std::string& v) { c.model.moe.router.topk = positive("--moe-router-topk", v); }));
  t.push_back(one("--moe-shared-expert-intermediate-size", "S", "shared experts' total FFN width (default: none)",
                  [positive](C& c, const std::string& v) {
                    c.model.moe.shared_expert_intermediate_size = positive("--moe-shared-expert-intermediate-size", v);
                  }));
  t.push_back(sw("--moe-shared-expert-gate", "scale the shared experts' output by sigmoid(x . gate) (Qwen-MoE)",
                 [](C& c) { c.model.moe.shared_expert_gate = true; }));
  t.push_back(sw("--moe-shared-expert-overlap", "alltoall dispatcher: run the shared experts while routed tokens are "
                 "exchanged",
                 [](C& c) { c.moe.shared_expert_overlap = true; }));
  t.push_back(one("--moe-layer-freq", "N|PATTERN", "MoE layers: every N-th layer (default 1: all) or a list such as "
                  "([0]+[1]*3)*2 (1 = MoE, 0 = dense)",
                  [](C& c, const std::string& v) { c.moe.layer_freq = v; }));
  t.push_back(one("--moe-router-load-balancing-type", "aux_loss|seq_aux_loss|none", "default aux_loss",
                  [](C& c, const std::string& v) { c.model.moe.router.load_balancing = parse_moe_load_balancing(v); }));
  t.push_back(one("--moe-aux-loss-coeff", "X", "load-balancing loss coefficient (default 0)",
                  [](C& c, const std::string& v) { c.model.moe.router.aux_loss_coeff = parse_float_flag("--moe-aux-loss-coeff", v); }));
  t.push_back(one("--moe-z-loss-coeff", "X", "router z-loss coefficient (default: none)",
                  [](C& c, const std::string& v) { c.model.moe.router.z_loss_coeff = parse_float_flag("--moe-z-loss-coeff", v); }));
  t.push_back(one("--moe-router-score-function", "softmax|sigmoid", "default softmax",
                  [](C& c, const std::string& v) { c.model.moe.router.score_function = parse_moe_score_function(v); }));
  t.push_back(sw("--moe-router-pre-softmax", "softmax over all experts before the top-k (no renormalisation)",
                 [](C& c) { c.model.moe.router.pre_softmax = true; }));
  t.push_back(one("--moe-router-topk-scaling-factor", "X", "scale the routing probabilities (default: none)",
                  [](C& c, const std::string& v) {
                    c.model.moe.router.topk_scaling_factor = parse_float_flag("--moe-router-topk-scaling-factor", v);
                  }));
  t.push_back(sw("--moe-router-enable-expert-bias", "aux-loss-free balancing: a per-expert bias on the selection "
                 "scores, updated each step from the token counts (sigmoid scores)",
                 [](C& c) { c.model.moe.router.enable_expert_bias = true; }));
  t.push_back(one("--moe-router-bias-update-rate", "X", "default 1e-3",
                  [](C& c, const std::string& v) {
                    c.model.moe.router.bias_update_rate = parse_float_flag("--moe-router-bias-update-rate", v);
                  }));
  t.push_back(one("--moe-expert-capacity-factor", "X", "token dropping: each expert takes at most "
                  "ceil(tokens x topk / experts x X) tokens (default: no dropping)",
                  [](C& c, const std::string& v) {
                    c.model.moe.router.capacity_factor = parse_float_flag("--moe-expert-capacity-factor", v);
                  }));
  t.push_back(one("--moe-token-drop-policy", "probs|position", "which tokens over capacity are dropped (default probs)",
                  [](C& c, const std::string& v) { c.model.moe.router.drop_policy = parse_moe_drop_policy(v); }));
  t.push_back(sw("--moe-pad-expert-input-to-capacity", "every expert gets exactly its capacity of rows",
                 [](C& c) { c.model.moe.router.pad_to_capacity = true; }));
  t.push_back(one("--moe-token-dispatcher-type", "allgather|alltoall", "default allgather",
                  [](C& c, const std::string& v) { c.moe.dispatcher = parse_moe_dispatcher(v); }));
  t.push_back(sw("--moe-per-layer-logging", "TensorBoard: router losses per MoE layer too",
                 [](C& c) { c.moe.per_layer_logging = true; }));
  // Megatron's kernel choices for MoE: Loom always permutes with its fused op and runs the experts as
  // grouped GEMMs, so they change no result (logged once, like --use-flash-attn).
  for (const char* name : {"--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion"})
    t.push_back(FlagSpec<C>{{name, Arity::kSwitch, "", "a Megatron kernel choice; Loom always runs grouped GEMMs and "
                                                       "fused permutation (logged once)"},
                            [name](C& c, V) { c.kernel_choice_flags.push_back(name); }});
  return t;
}

void resolve_moe_flags(TrainConfig& cfg) {
  MoeConfig& m = cfg.model.moe;
  if (m.num_experts == 0) {
    if (!cfg.moe.layer_freq.empty())
      user_error("--moe-layer-freq needs --num-experts (a mixture-of-experts model)");
    return;
  }
  m.layer_pattern = parse_moe_layer_freq(cfg.moe.layer_freq.empty() ? "1" : cfg.moe.layer_freq, cfg.model.num_layers);
}

}  // namespace loom
