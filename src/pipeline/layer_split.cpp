// Decoder layers per pipeline stage and virtual chunk (Megatron's get_num_layers_to_build and the layer
// offset of each virtual stage): an even split, uneven first/last stages, or interleaved chunks.
#include "loom/pipeline/schedule.h"

namespace loom {

std::vector<std::vector<StageLayers>> pipeline_layer_split(int64_t num_layers, int pp_size, int num_chunks,
                                                           int64_t first_stage_layers, int64_t last_stage_layers) {
  const int64_t P = pp_size, V = num_chunks, L = num_layers;
  LOOM_CHECK(P >= 1 && V >= 1, "[pipeline_layer_split] pp_size ", P, " and num_chunks ", V, " must be >= 1");
  if (L < 1) user_error("--num-layers must be >= 1, got ", L);
  if (first_stage_layers < 0 || last_stage_layers < 0)
    user_error("--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers must be >= 0, got ",
               first_stage_layers, " and ", last_stage_layers);
  const bool uneven = first_stage_layers > 0 || last_stage_layers > 0;
  std::vector<std::vector<StageLayers>> split(static_cast<size_t>(P), std::vector<StageLayers>(static_cast<size_t>(V)));

  if (V > 1) {
    if (P == 1) user_error("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1");
    if (uneven)
      user_error("--num-layers-per-virtual-pipeline-stage cannot be combined with "
                 "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers");
    if (L % (P * V) != 0)
      user_error("--num-layers (", L, ") must be divisible by --pipeline-model-parallel-size (", P,
                 ") times the number of virtual stages per rank (", V,
                 ") given by --num-layers-per-virtual-pipeline-stage");
    const int64_t per_chunk = L / (P * V);
    for (int64_t s = 0; s < P; ++s)
      for (int64_t v = 0; v < V; ++v) split[size_t(s)][size_t(v)] = {(v * P + s) * per_chunk, per_chunk};
    return split;
  }

  std::vector<int64_t> counts(size_t(P), 0);
  if (!uneven) {
    if (L % P != 0)
      user_error("--num-layers (", L, ") must be divisible by --pipeline-model-parallel-size (", P,
                 "); or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers");
    for (auto& c : counts) c = L / P;
  } else {
    if (P == 1)
      user_error("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
                 "--pipeline-model-parallel-size > 1");
    const int64_t ends = (first_stage_layers > 0) + (last_stage_layers > 0);
    const int64_t middle = P - ends;
    const int64_t rest = L - first_stage_layers - last_stage_layers;
    if (rest < 0 || (middle == 0 && rest != 0) || (middle > 0 && (rest == 0 || rest % middle != 0)))
      user_error("--num-layers (", L, ") minus --decoder-first-pipeline-num-layers (", first_stage_layers,
                 ") and --decoder-last-pipeline-num-layers (", last_stage_layers, ") leaves ", rest,
                 " layers, which must split evenly (at least one each) over the other ", middle,
                 " pipeline stages of --pipeline-model-parallel-size ", P);
    for (int64_t s = 0; s < P; ++s) counts[size_t(s)] = middle > 0 ? rest / middle : 0;
    if (first_stage_layers > 0) counts[0] = first_stage_layers;
    if (last_stage_layers > 0) counts[size_t(P - 1)] = last_stage_layers;
  }
  int64_t first = 0;
  for (int64_t s = 0; s < P; ++s) {
    split[size_t(s)][0] = {first, counts[size_t(s)]};
    first += counts[size_t(s)];
  }
  return split;
}

}  // namespace loom
