# Thin wrapper over CMake and the scripts; everything real lives in CMakeLists.txt and scripts/.
#   make / make build   configure build/ (Release) and compile with all cores
#   make demo           install what is missing (scripts/setup.sh), build, train a small GPT (scripts/demo.sh)
#   make test           install what is missing, build, run every test with ctest
#   make bench          build, then run the benchmarks (bench/run_bench.sh)
#   make clean          remove build/
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all build setup demo test bench clean

all: build

build:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)
	cmake --build $(BUILD_DIR) -j$(JOBS)

setup:
	bash scripts/setup.sh

demo: setup
	$(MAKE) build
	BUILD_DIR=$(BUILD_DIR) bash scripts/demo.sh

# ctest's own timeout caps any single hung test; the suite as a whole is kept well under 20 minutes.
test: setup
	$(MAKE) build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j2 --timeout 900

bench: build
	BUILD_DIR=$(BUILD_DIR) bash bench/run_bench.sh

clean:
	rm -rf $(BUILD_DIR)
