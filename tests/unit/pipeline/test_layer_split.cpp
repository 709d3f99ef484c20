// pipeline_layer_split: even stages, Megatron's uneven first/last stages, virtual chunks, and the
// user errors naming the flags.
#include <gtest/gtest.h>

#include <string>

#include "loom/pipeline/schedule.h"

namespace loom {
namespace {

std::string describe(const std::vector<std::vector<StageLayers>>& split) {
  std::string s;
  for (const auto& stage : split) {
    if (!s.empty()) s += " | ";
    for (size_t v = 0; v < stage.size(); ++v) {
      if (v) s += ' ';
      s += std::to_string(stage[v].first_layer);
      s += '+';
      s += std::to_string(stage[v].num_layers);
    }
  }
  return s;
}

std::string error_of(int64_t L, int P, int V, int64_t first, int64_t last) {
  try {
    pipeline_layer_split(L, P, V, first, last);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineLayerSplit, Even) {
  EXPECT_EQ(describe(pipeline_layer_split(12, 1, 1, 0, 0)), "0+12");
  EXPECT_EQ(describe(pipeline_layer_split(12, 4, 1, 0, 0)), "0+3 | 3+3 | 6+3 | 9+3");
  EXPECT_NE(error_of(10, 4, 1, 0, 0).find("--num-layers (10) must be divisible by --pipeline-model-parallel-size (4)"),
            std::string::npos);
}

TEST(PipelineLayerSplit, UnevenFirstAndLast) {
  EXPECT_EQ(describe(pipeline_layer_split(10, 4, 1, 1, 3)), "0+1 | 1+3 | 4+3 | 7+3");
  EXPECT_EQ(describe(pipeline_layer_split(10, 4, 1, 4, 0)), "0+4 | 4+2 | 6+2 | 8+2");
  EXPECT_EQ(describe(pipeline_layer_split(9, 3, 1, 0, 1)), "0+4 | 4+4 | 8+1");
  EXPECT_EQ(describe(pipeline_layer_split(5, 2, 1, 2, 3)), "0+2 | 2+3");
  const std::string e = error_of(10, 4, 1, 1, 2);  // 7 left for 2 stages
  EXPECT_NE(e.find("--decoder-first-pipeline-num-layers (1)"), std::string::npos) << e;
  EXPECT_NE(e.find("--decoder-last-pipeline-num-layers (2)"), std::string::npos) << e;
  EXPECT_FALSE(error_of(6, 2, 1, 2, 3).empty());   // both ends set on 2 stages must cover every layer
  EXPECT_FALSE(error_of(6, 3, 1, 3, 3).empty());   // the middle stage would get no layer
  EXPECT_FALSE(error_of(6, 2, 1, 7, 0).empty());
  EXPECT_FALSE(error_of(6, 1, 1, 2, 0).empty());   // needs PP > 1
}

TEST(PipelineLayerSplit, VirtualChunks) {
  // Chunk v of stage s is model chunk v·PP + s.
  EXPECT_EQ(describe(pipeline_layer_split(8, 2, 2, 0, 0)), "0+2 4+2 | 2+2 6+2");
  EXPECT_EQ(describe(pipeline_layer_split(12, 3, 2, 0, 0)), "0+2 6+2 | 2+2 8+2 | 4+2 10+2");
  EXPECT_NE(error_of(10, 2, 2, 0, 0).find("--num-layers-per-virtual-pipeline-stage"), std::string::npos);
  EXPECT_NE(error_of(8, 1, 2, 0, 0).find("--pipeline-model-parallel-size > 1"), std::string::npos);
  EXPECT_NE(error_of(8, 2, 2, 1, 0).find("cannot be combined"), std::string::npos);
}

}  // namespace
}  // namespace loom
