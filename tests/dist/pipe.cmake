# Pipeline schedules under mpirun: test_dist_pipe (tests/dist/pipe/*.cpp) runs one step of GPTModel chunks
# through run_pipeline_step (1F1B over 2 and 4 stages, interleaved 2 x 2 virtual stages, uneven first/last
# stages, forward-only) and compares the summed loss and every gradient with a single-process model doing
# the same micro-batches in turn.
loom_dist_test_exe(test_dist_pipe pipe loom_pipeline)
if(TARGET test_dist_pipe)
  loom_mpi_test(dist_pipe_np2 2 test_dist_pipe)
  loom_mpi_test(dist_pipe_np4 4 test_dist_pipe)
endif()
