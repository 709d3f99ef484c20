# Context-parallel attention tests. test_dist_cp (tests/dist/cp/*.cpp) compares the ring attention's out, lse
# and dqkv on every rank with its slice of the single-process attention over the whole sequence: CpSim* run
# the CP ranks as threads in one process (no MPI needed), CpMpi* run under mpirun with 2 and 4 ranks (4 ranks
# also as two CP groups of 2).
loom_dist_test_exe(test_dist_cp cp loom_parallel)
if(TARGET test_dist_cp)
  add_test(NAME dist_cp_sim COMMAND test_dist_cp --gtest_filter=CpSim.*)
  set_tests_properties(dist_cp_sim PROPERTIES TIMEOUT 300 LABELS dist ENVIRONMENT OMP_NUM_THREADS=1)
  loom_mpi_test(dist_cp_np2 2 test_dist_cp --gtest_filter=CpMpi.*)
  loom_mpi_test(dist_cp_np4 4 test_dist_cp --gtest_filter=CpMpi.*)
endif()
