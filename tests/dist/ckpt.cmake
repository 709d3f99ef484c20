# Sharded checkpoints under mpirun: test_dist_ckpt (tests/dist/ckpt/*.cpp) saves a TP2 x ZeRO2 layout from
# 4 real ranks through the collective save_sharded_checkpoint, reads it back on every rank in other layouts,
# and checks that a failure on one rank fails the save on every rank and leaves the old checkpoint current.
loom_dist_test_exe(test_dist_ckpt ckpt loom_ckpt)
if(TARGET test_dist_ckpt)
  loom_mpi_test(dist_ckpt_np4 4 test_dist_ckpt)
endif()
