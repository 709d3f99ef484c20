# End-to-end distributed training: test_dist_train (tests/dist/train/*.cpp) is a plain gtest that launches
# `mpirun ... loom train` itself for each layout (DP, ZeRO-1/3, TP, TP+SP, PP 1F1B and interleaved, CP,
# TP x PP, DP x TP x PP on 8 ranks) and compares the per-iteration losses with a single-process run;
# resharding (save TP2 x PP2, resume as one process and as DP4 ZeRO-1) and a killed rank.
loom_dist_test_exe(test_dist_train train loom_train)
if(TARGET test_dist_train AND LOOM_MPIEXEC)
  add_dependencies(test_dist_train loom)
  target_compile_definitions(test_dist_train PRIVATE LOOM_MPIEXEC="${LOOM_MPIEXEC}")
  gtest_discover_tests(test_dist_train DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 900 LABELS dist)
endif()
