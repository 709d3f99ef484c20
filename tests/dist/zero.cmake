# Data parallelism and ZeRO (DistributedOptimizer) under mpirun: DP = 2 and 4, and TP 2 x DP 2 with 4 ranks.
loom_dist_test_exe(test_dist_zero zero loom_optim)
if(TARGET test_dist_zero)
  loom_mpi_test(dist_zero_np2 2 test_dist_zero)
  loom_mpi_test(dist_zero_np4 4 test_dist_zero)
endif()
