# Communicator tests. test_dist_comm (tests/dist/comm/*.cpp) runs every collective, dtype, async twin,
# point-to-point pattern, split and ParallelState layout under mpirun with 2, 4 and 8 ranks.
# test_dist_comm_fault runs mpirun itself on dist_fault_child (tests/dist/comm/fault/) to check that a
# collective mismatch and a dying rank end the job quickly with a non-zero status and a message.
loom_dist_test_exe(test_dist_comm comm loom_dist)
if(TARGET test_dist_comm AND MPI_CXX_FOUND)
  loom_mpi_test(dist_comm_np2 2 test_dist_comm)
  loom_mpi_test(dist_comm_np4 4 test_dist_comm)
  loom_mpi_test(dist_comm_np8 8 test_dist_comm)
endif()

add_executable(dist_fault_child ${CMAKE_CURRENT_SOURCE_DIR}/comm/fault/fault_child.cpp)
target_link_libraries(dist_fault_child PRIVATE loom_dist)
add_executable(test_dist_comm_fault ${CMAKE_CURRENT_SOURCE_DIR}/comm/fault/test_fault.cpp)
target_link_libraries(test_dist_comm_fault PRIVATE GTest::gtest GTest::gtest_main)
add_dependencies(test_dist_comm_fault dist_fault_child)
if(LOOM_MPIEXEC AND MPI_CXX_FOUND)
  target_compile_definitions(test_dist_comm_fault PRIVATE LOOM_MPIRUN="${LOOM_MPIEXEC}"
                             LOOM_FAULT_CHILD="$<TARGET_FILE:dist_fault_child>")
  # Not under mpirun: the test starts its own mpirun jobs.
  add_test(NAME dist_comm_fault COMMAND test_dist_comm_fault)
  set_tests_properties(dist_comm_fault PROPERTIES TIMEOUT 300 LABELS dist)
endif()
