#!/usr/bin/env bash
# Builds every tests/fuzz/fuzz_*.cpp with clang++ -fsanitize=fuzzer,address,undefined into build-fuzz/
# and runs each target for SECONDS on a scratch copy of its seeds (tests/fuzz/seeds/<target>/; the repo
# is never modified). Fails when any target crashes, hits a sanitizer report, leaks, or times out on an
# input; crash inputs are kept under build-fuzz/artifacts/<target>/.
#
#   tests/fuzz/run_fuzz.sh [SECONDS=60] [TARGET ...]     (default: all targets, one after another)
#   env: LOOM_FUZZ_BUILD_DIR (default <repo>/build-fuzz), LOOM_FUZZ_JOBS (build jobs, default 2),
#        LOOM_FUZZ_FLAGS (extra libFuzzer flags)
# Exit 77 (ctest: skipped) when clang++ with libFuzzer is not installed.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SECS=${1:-60}
shift || true
BUILD=${LOOM_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}
JOBS=${LOOM_FUZZ_JOBS:-2}

CXX=""
for c in clang++-14 clang++; do
  if command -v "$c" >/dev/null 2>&1; then CXX=$(command -v "$c"); break; fi
done
if [[ -z "$CXX" ]]; then
  echo "run_fuzz: clang++ not found; skipping (install clang and libclang-rt-dev)"
  exit 77
fi
probe=$(mktemp -d)
printf '#include <cstdint>\n#include <cstddef>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' \
  >"$probe/p.cpp"
if ! "$CXX" -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1; then
  rm -rf "$probe"
  echo "run_fuzz: $CXX cannot link -fsanitize=fuzzer (libclang-rt-dev missing?); skipping"
  exit 77
fi
rm -rf "$probe"

# Several sessions may share one build dir: builds take turns under a lock, and each run gets its own
# log and scratch corpus, so concurrent runs never clobber each other.
mkdir -p "$BUILD/logs"
exec 9>"$BUILD/.build.lock"
flock 9
echo "run_fuzz: building in $BUILD with $CXX"
if ! cmake -S "$ROOT/tests/fuzz" -B "$BUILD" -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD/logs/configure.$$.log" 2>&1; then
  cat "$BUILD/logs/configure.$$.log"
  echo "run_fuzz: configure failed"
  exit 1
fi
if ! cmake --build "$BUILD" -j"$JOBS" --target loom_fuzz_lib >"$BUILD/logs/build.$$.log" 2>&1; then
  grep -E "error|Error" "$BUILD/logs/build.$$.log" | head -40
  echo "run_fuzz: building the Loom core/data sources failed (full log: $BUILD/logs/build.$$.log)"
  exit 1
fi

if [[ $# -gt 0 ]]; then
  TARGETS=("$@")
else
  TARGETS=()
  for src in "$ROOT"/tests/fuzz/fuzz_*.cpp; do TARGETS+=("$(basename "$src" .cpp)"); done
fi
failed=()
built=()
for t in "${TARGETS[@]}"; do  # one target failing to compile does not stop the others
  if cmake --build "$BUILD" -j"$JOBS" --target "$t" >"$BUILD/logs/build_$t.$$.log" 2>&1; then
    built+=("$t")
  else
    grep -E "error" "$BUILD/logs/build_$t.$$.log" | head -20
    echo "run_fuzz: $t failed to build (log: $BUILD/logs/build_$t.$$.log)"
    failed+=("$t")
  fi
done

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
flock -u 9

for t in "${built[@]}"; do
  exe="$BUILD/$t"
  if [[ ! -x "$exe" ]]; then
    echo "run_fuzz: $t: no executable $exe"
    failed+=("$t")
    continue
  fi
  corpus=$(mktemp -d "${TMPDIR:-/tmp}/loom_fuzz_${t}_XXXXXX")
  [[ -d "$ROOT/tests/fuzz/seeds/$t" ]] && cp -r "$ROOT/tests/fuzz/seeds/$t/." "$corpus/"
  artifacts="$BUILD/artifacts/$t"
  mkdir -p "$artifacts"
  log="$BUILD/logs/$t.$$.log"
  echo "run_fuzz: $t for ${SECS}s ($(ls "$corpus" | wc -l) seeds), log $log"
  # -timeout: one input running longer than 30 s counts as a hang; -rss_limit_mb bounds memory.
  # shellcheck disable=SC2086
  (cd "$corpus" && "$exe" -max_total_time="$SECS" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
     -artifact_prefix="$artifacts/" ${LOOM_FUZZ_FLAGS:-} "$corpus") >"$log" 2>&1
  rc=$?
  execs=$(grep -a -E "^stat::number_of_executed_units" "$log" | awk '{print $2}')
  if [[ $rc -ne 0 ]] || grep -aqE "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:" "$log"; then
    echo "run_fuzz: $t FAILED (exit $rc, ${execs:-?} execs); report:"
    grep -a -E -A25 "ERROR:|runtime error:|==ERROR|deadly signal" "$log" | head -60
    ls "$artifacts" | sed 's/^/  artifact: /'
    failed+=("$t")
  else
    echo "run_fuzz: $t ok (${execs:-?} execs)"
  fi
  rm -rf "$corpus"
done

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run_fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "run_fuzz: all ${#TARGETS[@]} targets passed"
