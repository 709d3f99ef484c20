# Expert (mixture-of-experts) parameters in the distributed optimizer and in checkpoints under mpirun -np 4:
# test_dist_experts (tests/dist/experts/*.cpp) runs synthetic MoE layouts (EP 2 over DP, EP 2 next to
# TP 2 with ETP 1 and 2, EP 1) through DDP and ZeRO-1/2/3 and the checkpoint owners of checkpoint_pieces.h.
loom_dist_test_exe(test_dist_experts experts loom_train)
if(TARGET test_dist_experts)
  loom_mpi_test(dist_experts_np4 4 test_dist_experts)
endif()
