// Shared by the MoE op tests (test_cpu_moe.cpp, test_cuda_moe.cpp): a random routing as the router builds it
// — each token picks k distinct experts, some (token, expert) pairs are dropped — turned into the row_id_map
// of ops.h (expert-major rows, token order within an expert), with the probs and group sizes to match.
#pragma once
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::test {

struct MoeRouting {
  int64_t N = 0, E = 0, M = 0;
  Tensor row_id_map;                 // (N, E) i32, host
  Tensor probs;                      // (N, E) f32, host; 0 off the map
  std::vector<int64_t> group_sizes;  // (E)
};

inline MoeRouting random_routing(int64_t N, int64_t E, int64_t k, uint32_t seed, double drop = 0.2) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<char> map(size_t(N * E), 0);
  std::vector<int> experts(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t j = 0; j < k; ++j)
      if (u(rng) >= drop) map[n * E + experts[j]] = 1;
  }
  MoeRouting r;
  r.N = N;
  r.E = E;
  r.row_id_map = Tensor::empty({N, E}, DType::kI32);
  r.probs = Tensor::zeros({N, E}, DType::kF32);
  r.group_sizes.assign(size_t(E), 0);
  int32_t* ids = r.row_id_map.data<int32_t>();
  std::fill(ids, ids + N * E, -1);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      if (map[n * E + e]) {
        ids[n * E + e] = int32_t(r.M++);
        ++r.group_sizes[e];
        r.probs.data<float>()[n * E + e] = 0.1f + u(rng);
      }
  return r;
}

}  // namespace loom::test
