# Thin wrapper over CMake and the scripts; everything real lives in CMakeLists.txt and scripts/.
#   make / make build   configure build/ (Release) and compile everything (CUDA backend included when nvcc
#                       is found, tests) with all cores
#   make demo           install what the demo needs (scripts/setup.sh --demo), build the loom binary only,
#                       train a small GPT (scripts/demo.sh); prints the time of each phase
#   make test           install everything (scripts/setup.sh), build, run every test with ctest
#   make bench          build, then run the benchmarks (bench/run_bench.sh)
#   make clean          remove build/
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The CUDA backend (compiled when nvcc is found). make build and make test always compile it (CI needs
# every CUDA source to compile); a first make demo compiles it only when a GPU is visible or LOOM_CUDA=ON
# is given, since compiling it for three GPU architectures is most of a fresh build on a small machine.
LOOM_CUDA ?= ON
DEMO_CUDA := $(if $(filter command line environment,$(origin LOOM_CUDA)),$(LOOM_CUDA),$(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo ON || echo OFF))

.PHONY: all build setup demo test bench clean

all: build

build:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DLOOM_CUDA=$(LOOM_CUDA) -DLOOM_TESTS=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD_DIR) -j$(JOBS)

setup:
	bash scripts/setup.sh

# A build directory that already exists keeps its settings (no CUDA or test toggling, which would
# recompile); a fresh one is configured for the demo alone.
demo:
	@set -e; start=$$(date +%s); \
	bash scripts/setup.sh --demo; \
	t_setup=$$(( $$(date +%s) - start )); b0=$$(date +%s); \
	if [ -f $(BUILD_DIR)/CMakeCache.txt ]; then what="the loom binary"; \
	  cmake -S . -B $(BUILD_DIR) $(CMAKE_FLAGS) >/dev/null; \
	else what="the loom binary, CUDA backend $(DEMO_CUDA)"; \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DLOOM_CUDA=$(DEMO_CUDA) -DLOOM_TESTS=OFF $(CMAKE_FLAGS); \
	fi; \
	cmake --build $(BUILD_DIR) -j$(JOBS) --target loom; \
	t_build=$$(( $$(date +%s) - b0 )); \
	DEMO_START=$$start DEMO_PHASES="setup:$$t_setup;build ($$what):$$t_build" BUILD_DIR=$(BUILD_DIR) bash scripts/demo.sh

# ctest's own timeout caps any single hung test; the suite as a whole is kept well under 20 minutes.
test: setup
	$(MAKE) build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j2 --timeout 900

bench: build
	BUILD_DIR=$(BUILD_DIR) bash bench/run_bench.sh

clean:
	rm -rf $(BUILD_DIR)
