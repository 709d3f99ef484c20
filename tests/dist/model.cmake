# Model-parallel GPT tests. test_dist_model (tests/dist/model/*.cpp) builds a single-process model on every
# rank and the same model split by tensor / sequence / pipeline parallelism over the ranks, and compares the
# loss and every parameter gradient (np 2: TP2, TP2+SP, PP2; np 4 adds TP4, TP4+SP and TP2 x PP2).
loom_dist_test_exe(test_dist_model model loom_model)
if(TARGET test_dist_model)
  loom_mpi_test(dist_model_np2 2 test_dist_model)
  loom_mpi_test(dist_model_np4 4 test_dist_model)
endif()
