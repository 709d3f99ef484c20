#!/usr/bin/env bash
# One-call GPU check of Loom's CUDA backend, for a machine with one NVIDIA GPU (H100/H200), a copy of the
# working tree, the CUDA toolkit and a python3 with CUDA PyTorch. Stages, in order (GPU_CHECK_STAGES):
#
#   gpu       nvidia-smi / torch: which GPU, driver, CUDA, PyTorch (INFO; FAIL when no GPU is visible)
#   deps      the C++ build dependencies (oneDNN, nlohmann-json, yaml-cpp, ICU, SentencePiece, GoogleTest,
#             pkg-config): the system's, else the Debian 12 .debs of $GPU_DEPS_DIR unpacked into a private
#             prefix (made on a dev machine by `scripts/gpu_check.sh --fetch-deps`; see bench/gpu/README.md)
#   build     cmake Release with CUDA for this GPU's arch only (LOOM_CUDA_ARCH, default 90), -j16,
#             targets loom + test_backend (GPU_BUILD_TARGETS)
#   test      every built test binary's tests named *Cuda*/*CUDA*/*Gpu*/*GPU* (test_backend: '*Cuda*');
#             passed / failed / skipped counts
#   sanitize  compute-sanitizer memcheck on a quick subset (the first CUDA test of each suite)
#   train     tiny GPT, 20 iterations, `--device cpu` vs `--device cuda`, per-iteration lm loss compared
#             (fp32: 1e-4 relative; also bf16 at 2e-2)
#   bench     GPT-2 124M BF16 in Loom and in PyTorch (bench/gpu/pytorch_gpt2.py: torch.compile, SDPA,
#             fused AdamW), then a 1.3B GPT in BF16 and FP8 (--fp8-format hybrid): ms/iter, tokens/s, MFU
#   kernels   (not in the default list) ncu: GPU time per kernel over one iteration (GPT-2 124M BF16 unless
#             GPU_KERNELS_{LAYERS,HIDDEN,HEADS,SEQ,BATCH} and GPU_KERNELS_PRECISIONS ["bf16"] (also fp8) say
#             otherwise), top kernels; the table in $OUT/<key>.txt
#   profile   (not in the default list) nsys over a few iterations of GPT-2 124M with Loom's --profile
#
# Every stage runs under `timeout`, inside an overall budget (GPU_CHECK_BUDGET seconds, default 570, to
# fit a 10-minute command): a failure is recorded and the next stage runs; a stage without time left is
# SKIPped. The summary table (stage | result | figure, GPU name, Loom/PyTorch and FP8/BF16 ratios, and
# every command run, ready for bench/RESULTS.md) is printed at the end and rewritten after every stage to
# $OUT/gpu_summary.md when $OUT is set (else <build>/logs/gpu_summary.md), so a killed run still leaves
# it. Logs of every command: <build>/logs/ (also packed into $OUT/gpu_logs.tar.gz), and the transcript
# of this script: $OUT/gpu_check.log (else <build>/logs/gpu_check.log).
#
# Usage:
#   bash scripts/gpu_check.sh               # all default stages
#   bash scripts/gpu_check.sh --dry-run     # print the commands every stage would run; run nothing
#   bash scripts/gpu_check.sh --fetch-deps  # on a Debian 12 dev machine: download the build deps' .debs
#   GPU_CHECK_STAGES="gpu deps build test sanitize train" bash scripts/gpu_check.sh   # split over 2 calls
#   GPU_CHECK_STAGES="gpu deps build bench" bash scripts/gpu_check.sh                 # (build is then a no-op)
#
# Environment (defaults in brackets):
#   GPU_CHECK_STAGES ["gpu deps build test sanitize train bench"]   GPU_CHECK_BUDGET [570] seconds overall
#   GPU_BUILD_DIR [build-gpu]   LOOM_CUDA_ARCH [90] (90a for wgmma code)   GPU_BUILD_JOBS [nproc]
#   GPU_BUILD_TARGETS ["loom test_backend"]; "all" builds everything, "none" only configures
#   GPU_CMAKE_ARGS [] extra cmake arguments   GPU_BUILD_TIMEOUT [420]
#   GPU_DEPS_DIR [out/gpudeps]   GPU_DEPS_ROOT [<build>/deps-root]   GPU_DEPS_FORCE [0]: 1 = use the .debs
#     even when the system has the packages
#   GPU_TEST_TIMEOUT [150]   GPU_TEST_FILTER ['*Cuda*:*CUDA*:*Gpu*:*GPU*']
#   GPU_SANITIZE_TIMEOUT [120]  GPU_SANITIZE_TOOLS [memcheck] (also racecheck synccheck initcheck)
#   GPU_SANITIZE_MAX [40] tests   GPU_SANITIZE_FILTER [first CUDA test of each suite]
#   GPU_TRAIN_VARIANTS ["gpt llama gpt-features llama-features moe lora"] ("none": only the GPU-only checks: same seed
#   twice, save/resume, FP8 loss falls, out-of-range ids; -features and those need GPU_TRAIN_DATA from
#   scripts/gpu_pack.sh)   GPU_TRAIN_DATA [unset]
#   GPU_TRAIN_PRECISIONS ["fp32 bf16"] (also fp8)  GPU_TRAIN_ITERS [20]  GPU_TRAIN_LAYERS [2]
#   GPU_TRAIN_HIDDEN [128] GPU_TRAIN_HEADS [2] GPU_TRAIN_SEQ [128] GPU_TRAIN_BATCH [4] (global: 2x, so two
#   micro-batches accumulate) GPU_TRAIN_VOCAB [1000] GPU_TRAIN_RTOL [1e-4] GPU_TRAIN_RTOL_BF16 [2e-2]
#   GPU_TRAIN_RTOL_FP8 [5e-2]  GPU_TRAIN_TIMEOUT [90] per run  GPU_TRAIN_CPU_THREADS [nproc]
#   GPU_BENCH_VOCAB [50257]
#   GPU_BENCH_124M_{LAYERS,HIDDEN,HEADS,SEQ,BATCH,WARMUP,ITERS} [12 768 12 1024 16 5 30]
#   GPU_BENCH_TORCH_WARMUP [10] (torch.compile happens in the first)  GPU_BENCH_TORCH_COMPILE [1]
#   GPU_BENCH_1B_{LAYERS,HIDDEN,HEADS,SEQ,BATCH,WARMUP,ITERS} [24 2048 16 2048 4 3 10]
#   GPU_BENCH_TORCH_124M [1]: 0 = no PyTorch 124M run   GPU_BENCH_1B_PRECISIONS ["bf16 fp8"]   GPU_BENCH_TORCH_1B [0]: 1 = PyTorch 1.3B too
#   GPU_BENCH_TIMEOUT_{124M,TORCH,1B} [120 240 150] per run   GPU_PEAK_TFLOPS [989.4] (H100 SXM dense BF16)
#   GPU_PROFILE_TIMEOUT [120]   NSYS [nsys on PATH or under /opt/nvidia]
#   PYTHON [python3]   LOOM_BIN [<build>/loom]   OUT [unset: the device tool's output folder]
# Exit status: 0 when no stage FAILed, 1 otherwise (2: bad usage).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

DRY=false
MODE=check
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=true ;;
    --fetch-deps) MODE=fetch ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (--dry-run, --fetch-deps, --help)" >&2; exit 2 ;;
  esac
done

# Debian 12 packages the build needs (CMakeLists.txt's find_package / pkg_check_modules), with the
# runtime libraries they link and OpenCL (oneDNN's CMake config asks for it).
DEB_PACKAGES="libdnnl-dev libdnnl2 ocl-icd-libopencl1 ocl-icd-opencl-dev opencl-c-headers opencl-clhpp-headers
opencl-headers nlohmann-json3-dev libicu-dev libicu72 libyaml-cpp-dev libyaml-cpp0.7 libsentencepiece-dev
libsentencepiece0 libgtest-dev libgmock-dev pkgconf pkgconf-bin libpkgconf3"
DEPS_DIR="${GPU_DEPS_DIR:-out/gpudeps}"
[[ "$DEPS_DIR" == /* ]] || DEPS_DIR="$ROOT/$DEPS_DIR"

if [[ "$MODE" == fetch ]]; then
  # Run on the Debian 12 dev machine (it reaches Debian's mirrors; the GPU machine reaches nothing).
  mkdir -p "$DEPS_DIR" && cd "$DEPS_DIR" || exit 1
  echo "[gpu_check] downloading into $DEPS_DIR: ${DEB_PACKAGES//$'\n'/ }"
  # shellcheck disable=SC2086  # the package list is meant to split
  if ! apt-get download $DEB_PACKAGES; then
    echo "[gpu_check] apt-get download failed (run 'apt-get update' first?)" >&2
    exit 1
  fi
  echo "[gpu_check] $(find . -maxdepth 1 -name '*.deb' | wc -l) packages, $(du -sh . | cut -f1) in $DEPS_DIR"
  echo "[gpu_check] on the GPU machine the check unpacks them into a private prefix; carry the folder," \
       "e.g. run(carry=[\"${DEPS_DIR#"$ROOT"/}\"], command=\"bash scripts/gpu_check.sh\")"
  exit 0
fi

# ---- settings -----------------------------------------------------------------------------------------
STAGES="${GPU_CHECK_STAGES:-gpu deps build test sanitize train bench}"
BUDGET="${GPU_CHECK_BUDGET:-570}"
RESERVE=10                                   # seconds kept back for the summary
BUILD="${GPU_BUILD_DIR:-build-gpu}"
[[ "$BUILD" == /* ]] || BUILD="$ROOT/$BUILD"
ARCH="${LOOM_CUDA_ARCH:-90}"
NPROC="$(nproc 2>/dev/null || echo 4)"
JOBS="${GPU_BUILD_JOBS:-$NPROC}"
TARGETS="${GPU_BUILD_TARGETS:-loom test_backend}"
DEPS_ROOT="${GPU_DEPS_ROOT:-$BUILD/deps-root}"
PYTHON="${PYTHON:-python3}"
LOOM="${LOOM_BIN:-$BUILD/loom}"
PEAK="${GPU_PEAK_TFLOPS:-989.4}"
PARSE="$ROOT/bench/gpu/parse_loom_log.py"
TORCH_BENCH="$ROOT/bench/gpu/pytorch_gpt2.py"

LOGDIR="$BUILD/logs"
mkdir -p "$LOGDIR"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  SUMMARY="$OUT/gpu_summary.md" TRANSCRIPT="$OUT/gpu_check.log" TARBALL="$OUT/gpu_logs.tar.gz"
else
  SUMMARY="$LOGDIR/gpu_summary.md" TRANSCRIPT="$LOGDIR/gpu_check.log" TARBALL=""
fi
ROWS="$LOGDIR/.rows.tsv"    # stage \t result \t figure, one line per recorded result
CMDS="$LOGDIR/commands.sh"  # every command run, copyable
: >"$ROWS"
: >"$TRANSCRIPT"
printf '# commands run by scripts/gpu_check.sh, %s (repository root: %s)\n' "$(date -u '+%F %T UTC')" "$ROOT" >"$CMDS"
T0=$SECONDS

# ---- helpers ------------------------------------------------------------------------------------------
say() { printf '[gpu_check +%ss] %s\n' "$((SECONDS - T0))" "$*" | tee -a "$TRANSCRIPT"; }

# Shell-quote only what needs it, so the printed commands read like typed ones and still paste.
qcmd() {
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s' "${out% }"
}

rel() { printf '%s' "${1#"$ROOT"/}"; }

# Seconds a stage may take: min(WANT, what is left of the budget); 0 when less than MIN is left.
budget_for() {
  local want="$1" min="${2:-15}" left=$((BUDGET - (SECONDS - T0) - RESERVE))
  if ((left < min)); then echo 0; elif ((want < left)); then echo "$want"; else echo "$left"; fi
}

# run_cmd LOG TIMEOUT CMD... : runs CMD with its output in LOG, sets RC (124/137: timed out) and DUR.
run_cmd() {
  local log="$1" t="$2" c t1
  shift 2
  c="$(qcmd "$@")"
  c="${c//"$ROOT"\//}"  # commands run from the repository root: print its paths relative to it
  printf '%s\n' "$c" >>"$CMDS"
  say "\$ $c"
  say "    (timeout ${t}s, log $(rel "$log"))"
  RC=0 DUR=0
  $DRY && return 0
  printf '$ %s\n' "$c" >"$log"
  t1=$SECONDS
  timeout -k 10 "$t" "$@" >>"$log" 2>&1
  RC=$?
  DUR=$((SECONDS - t1))
  if ((RC == 124 || RC == 137)); then say "    -> TIMED OUT after ${DUR}s"; else say "    -> exit $RC after ${DUR}s"; fi
}
timed_out() { ((RC == 124 || RC == 137)); }
why_failed() { if timed_out; then echo "timed out after ${DUR}s"; else tail_err "$1"; fi; }

# JSON field of a one-line JSON document (empty when absent or null).
jget() {
  "$PYTHON" -c 'import json, sys
try:
    v = json.loads(sys.argv[1]).get(sys.argv[2])
except Exception:
    v = None
print("" if v is None else v)' "$1" "$2" 2>/dev/null
}
fmt() { "$PYTHON" -c 'import sys; print(format(float(sys.argv[1]), sys.argv[2]))' "$1" "$2" 2>/dev/null || printf '%s' "$1"; }
tail_err() {  # a short reason from a failed command's log: its last error-looking line, else its last line
  local l
  l="$(grep -aE 'error|Error|ERROR|what\(\)|FAILED|Assertion|Aborted|out of memory|not found' "$1" 2>/dev/null | tail -n 1)"
  [[ -n "$l" ]] || l="$(tail -n 1 "$1" 2>/dev/null)"
  l="${l//|/\\|}"
  printf '%s' "${l:0:160}"
}

record() {  # STAGE RESULT FIGURE
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$ROWS"
  say "== $1: $2 -- $3"
  render
}

GPU_DESC="" TORCH_DESC="" NVCC_DESC=""
TREE_DESC="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata')"
git -C "$ROOT" status --porcelain 2>/dev/null | grep -q . && TREE_DESC+=" + uncommitted changes"
declare -A R=()   # figures shared between stages (batch sizes, tokens/s, ms/iter)

render() {
  local tmp="$SUMMARY.tmp" pass fail skip
  pass="$(cut -f2 "$ROWS" | grep -cx PASS)"
  fail="$(cut -f2 "$ROWS" | grep -cx FAIL)"
  skip="$(cut -f2 "$ROWS" | grep -cx SKIP)"
  {
    echo "# Loom GPU check — $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- GPU: ${GPU_DESC:-unknown}"
    echo "- Host: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//') ($NPROC cores); ${NVCC_DESC:-nvcc ?}; ${TORCH_DESC:-PyTorch ?}"
    echo "- Tree: $TREE_DESC; build $(rel "$BUILD"), CUDA arch $ARCH"
    echo "- MFU against $PEAK TFLOP/s (H100/H200 SXM dense BF16; GPU_PEAK_TFLOPS); FLOPs per token 6·N + 12·L·C·T (bench/gpu/README.md)"
    echo
    echo "| stage | result | figure |"
    echo "|---|---|---|"
    awk -F'\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$ROWS"
    echo
    echo "Ratios: Loom/PyTorch tokens/s (${R[model_124]:-GPT-2 124M} BF16): **${R[ratio_torch]:-n/a}**; FP8/BF16 speed (${R[model_1b]:-GPT 1.3B}): **${R[ratio_fp8]:-n/a}**"
    echo
    echo "$pass PASS, $fail FAIL, $skip SKIP; $((SECONDS - T0)) s of the ${BUDGET} s budget$($DRY && echo ' (dry run: nothing was executed)')."
    echo
    echo "Commands (in order; logs in $(rel "$LOGDIR")/):"
    echo
    echo '```'
    grep -v '^#' "$CMDS"
    echo '```'
  } >"$tmp" && mv "$tmp" "$SUMMARY"
  if [[ -n "$TARBALL" ]]; then
    tar -czf "$TARBALL.tmp" -C "$LOGDIR" --exclude='*.nsys-rep' --exclude='*.qdstrm' --exclude='ckpt_*' . 2>/dev/null &&
      mv "$TARBALL.tmp" "$TARBALL"
  fi
}

finish() {
  render
  echo
  cat "$SUMMARY"
  [[ -n "${OUT:-}" ]] && echo "[gpu_check] summary: $SUMMARY; transcript: $TRANSCRIPT; logs: $TARBALL"
}
trap 'say "interrupted"; record "gpu_check" FAIL "interrupted by a signal"; finish; exit 1' INT TERM

GPU_OK=true  # false when nvidia-smi / torch see no GPU: GPU stages are then skipped

# ---- stage: gpu ---------------------------------------------------------------------------------------
stage_gpu() {
  local smi
  local nvcc
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  NVCC_DESC="nvcc $("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  TORCH_DESC="$("$PYTHON" -c 'import torch; print(f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}, GPU visible: {torch.cuda.is_available()})")' 2>/dev/null || echo "PyTorch: not importable by $PYTHON")"
  smi="$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | head -n 1)"
  printf '%s\n' "$(nvidia-smi 2>&1)" >"$LOGDIR/nvidia-smi.log"
  if [[ -n "$smi" ]]; then
    GPU_DESC="$(cut -d, -f1 <<<"$smi" | sed 's/ *$//') ($(cut -d, -f2 <<<"$smi" | sed 's/^ *//'), driver $(cut -d, -f3 <<<"$smi" | sed 's/^ *//'), max SM clock $(cut -d, -f4 <<<"$smi" | sed 's/^ *//'); $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s) visible)"
    record gpu PASS "$GPU_DESC"
  else
    GPU_OK=false
    if command -v nvidia-smi >/dev/null; then GPU_DESC="none visible ($(nvidia-smi -L 2>&1 | head -n 1))"
    else GPU_DESC="none visible (no nvidia-smi)"; fi
    record gpu "$($DRY && echo SKIP || echo FAIL)" "$GPU_DESC"
  fi
}

# ---- stage: deps --------------------------------------------------------------------------------------
CXX_BIN="${CXX:-$(command -v c++ || command -v g++ || echo c++)}"
PKG_CONFIG_EXE=""
missing_deps() {  # prints what the build would not find; extra args go to the compiler (-I...)
  local h
  for h in dnnl.hpp nlohmann/json.hpp yaml-cpp/yaml.h unicode/utypes.h sentencepiece_processor.h gtest/gtest.h; do
    printf '#include <%s>\n' "$h" | "$CXX_BIN" -std=c++20 -E -x c++ - "$@" >/dev/null 2>&1 || printf '%s ' "$h"
  done
  [[ -n "$PKG_CONFIG_EXE" ]] || command -v pkg-config >/dev/null || command -v pkgconf >/dev/null || printf 'pkg-config '
  command -v cmake >/dev/null || printf 'cmake '
  command -v "$CXX_BIN" >/dev/null || printf 'c++ '
}
unpack_deb() {  # DEB DIR: dpkg-deb where there is one, else ar + tar (a .deb is an ar archive)
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$1" "$2"; return; fi
  local member
  member="$(ar t "$1" | grep '^data\.tar')" || return 1
  case "$member" in
    *.xz) ar p "$1" "$member" | tar -xJ -C "$2" ;;
    *.zst) ar p "$1" "$member" | tar --zstd -x -C "$2" ;;
    *.gz) ar p "$1" "$member" | tar -xz -C "$2" ;;
    *) ar p "$1" "$member" | tar -x -C "$2" ;;
  esac
}
use_deps_bundle() {  # unpack the .debs into DEPS_ROOT (once) and point CMake, pkg-config and ld.so at it
  local lib="$DEPS_ROOT/usr/lib/x86_64-linux-gnu" d
  if [[ ! -f "$DEPS_ROOT/.unpacked" ]]; then
    rm -rf "$DEPS_ROOT" && mkdir -p "$DEPS_ROOT" || return 1
    for d in "$DEPS_DIR"/*.deb; do
      unpack_deb "$d" "$DEPS_ROOT" 2>>"$LOGDIR/deps.log" || { echo "cannot unpack $d" >>"$LOGDIR/deps.log"; return 1; }
    done
    # The .pc files say prefix=/usr: point them at the private prefix (CMake's pkg_check_modules then
    # links the unpacked libraries by full path, with -I into the prefix).
    find "$DEPS_ROOT" -name '*.pc' -exec sed -i -E "s#(^|[=[:space:]]|-I|-L)/usr(/|[[:space:]]|\$)#\\1$DEPS_ROOT/usr\\2#g" {} +
    touch "$DEPS_ROOT/.unpacked"
  fi
  export CMAKE_PREFIX_PATH="$DEPS_ROOT/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_PATH="$lib/pkgconfig:$DEPS_ROOT/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  # ld.so for loom and the tests (ICU's libicudata is only reachable this way), and ld's -rpath-link.
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! command -v pkg-config >/dev/null && [[ -x "$DEPS_ROOT/usr/bin/pkgconf" ]]; then
    PKG_CONFIG_EXE="$DEPS_ROOT/usr/bin/pkgconf"
  fi
  {
    echo "CMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH"
    echo "PKG_CONFIG_PATH=$PKG_CONFIG_PATH"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "PKG_CONFIG_EXECUTABLE=${PKG_CONFIG_EXE:-system}"
  } >>"$LOGDIR/deps.log"
  printf 'export CMAKE_PREFIX_PATH=%q PKG_CONFIG_PATH=%q LD_LIBRARY_PATH=%q\n' \
    "$CMAKE_PREFIX_PATH" "$PKG_CONFIG_PATH" "$LD_LIBRARY_PATH" >>"$CMDS"
}
stage_deps() {
  local miss ndeb
  : >"$LOGDIR/deps.log"
  miss="$(missing_deps)"
  ndeb="$(find "$DEPS_DIR" -maxdepth 1 -name '*.deb' 2>/dev/null | wc -l)"
  echo "missing from the system: ${miss:-nothing}; .debs in $DEPS_DIR: $ndeb" >>"$LOGDIR/deps.log"
  if [[ -z "$miss" && "${GPU_DEPS_FORCE:-0}" != 1 ]]; then
    record deps PASS "system packages"
    return
  fi
  if ((ndeb == 0)); then
    record deps FAIL "missing: ${miss:-nothing (GPU_DEPS_FORCE=1)}; no .debs in $(rel "$DEPS_DIR") (make them with scripts/gpu_check.sh --fetch-deps and carry the folder)"
    return
  fi
  if $DRY; then
    say "(dry run) would unpack $ndeb .debs from $(rel "$DEPS_DIR") into $DEPS_ROOT"
    record deps SKIP "dry run: $ndeb .debs; system lacks: ${miss:-nothing}"
    return
  fi
  if ! use_deps_bundle; then
    record deps FAIL "could not unpack $(rel "$DEPS_DIR") into $DEPS_ROOT: $(tail_err "$LOGDIR/deps.log")"
    return
  fi
  local still
  still="$(missing_deps -I"$DEPS_ROOT/usr/include")"
  if [[ -n "$still" ]]; then
    record deps FAIL "still missing after unpacking $ndeb .debs: ${still% }"
  else
    record deps PASS "$ndeb Debian .debs unpacked into $(rel "$DEPS_ROOT") (system lacked: ${miss:-nothing, forced})"
  fi
}

# ---- stage: build -------------------------------------------------------------------------------------
BUILD_FAILED=false  # a failed build leaves stale or no binaries: the stages that run them are skipped
stage_build() {
  local t args=() gen=() major
  t="$(budget_for "${GPU_BUILD_TIMEOUT:-420}" 60)"
  if ((t == 0)); then record build SKIP "no time left"; return; fi
  if [[ ! -f "$BUILD/CMakeCache.txt" ]] && command -v ninja >/dev/null; then gen=(-G Ninja); fi
  major="$(cmake --version 2>/dev/null | sed -n '1s/.* \([0-9]*\)\..*/\1/p')"
  args=(-S "$ROOT" -B "$BUILD" ${gen[@]+"${gen[@]}"} -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON
        "-DCMAKE_CUDA_ARCHITECTURES=$ARCH")
  # CMake 4 refuses package configs that declare cmake_minimum_required < 3.5 (some Debian ones do).
  [[ -n "$major" ]] && ((major >= 4)) && args+=(-DCMAKE_POLICY_VERSION_MINIMUM=3.5)
  [[ -n "$PKG_CONFIG_EXE" ]] && args+=("-DPKG_CONFIG_EXECUTABLE=$PKG_CONFIG_EXE")
  # shellcheck disable=SC2206  # GPU_CMAKE_ARGS is a list of words on purpose
  [[ -n "${GPU_CMAKE_ARGS:-}" ]] && args+=(${GPU_CMAKE_ARGS})
  run_cmd "$LOGDIR/configure.log" "$t" cmake "${args[@]}"
  local cfg_s=$DUR
  if $DRY; then :; elif ((RC != 0)); then
    BUILD_FAILED=true
    record build FAIL "cmake configure: $(tail_err "$LOGDIR/configure.log")"
    return
  elif ! grep -q "Loom: CUDA backend ON" "$LOGDIR/configure.log"; then
    BUILD_FAILED=true
    record build FAIL "configured WITHOUT the CUDA backend: $(grep -m1 'Loom: CUDA backend' "$LOGDIR/configure.log")"
    return
  fi
  if [[ "$TARGETS" == none ]]; then
    if $DRY; then record build SKIP "dry run"; else record build PASS "configure only (GPU_BUILD_TARGETS=none), ${cfg_s}s"; fi
    return
  fi
  local targ=()
  # shellcheck disable=SC2206
  [[ "$TARGETS" == all ]] || targ=(--target $TARGETS)
  t="$(budget_for "${GPU_BUILD_TIMEOUT:-420}" 30)"
  if ((t == 0)); then record build SKIP "no time left after configure"; return; fi
  run_cmd "$LOGDIR/build.log" "$t" cmake --build "$BUILD" -j "$JOBS" ${targ[@]+"${targ[@]}"}
  if $DRY; then record build SKIP "dry run"; return; fi
  if ((RC != 0)); then BUILD_FAILED=true; fi
  if timed_out; then
    record build FAIL "timed out after ${DUR}s (GPU_BUILD_TIMEOUT; a rerun continues where it stopped)"
  elif ((RC != 0)); then
    record build FAIL "$(tail_err "$LOGDIR/build.log")"
  else
    record build PASS "sm_$ARCH, configure ${cfg_s}s + build ${DUR}s (-j$JOBS, targets: $TARGETS)"
  fi
}

# ---- stage: test --------------------------------------------------------------------------------------
TEST_FILTER="${GPU_TEST_FILTER:-*Cuda*:*CUDA*:*Gpu*:*GPU*}"
declare -A CUDA_TESTS=()  # binary -> file with its matching test names (Suite.Test, one a line)
list_cuda_tests() {  # BIN OUTFILE: the binary's tests whose suite or name says Cuda/CUDA/Gpu/GPU
  timeout 60 "$1" --gtest_list_tests 2>/dev/null | awk '
    /^[^ ]/ { suite = $1; next }                       # "Suite." (maybe "  # TypeParam = ...")
    /^  [^ ]/ { name = $1; full = suite name; if (full ~ /Cuda|CUDA|Gpu|GPU/) print full }' >"$2"
}
test_binaries() {
  local b
  for b in "$BUILD"/tests/test_*; do
    [[ -f "$b" && -x "$b" && "$b" != *.cmake ]] && printf '%s\n' "$b"
  done
}
# A crashed test again under cuda-gdb (host and device frames), its backtrace in the log and the summary.
test_backtrace() {
  local bin="$1" filter="$2" gdb t log
  gdb="$(command -v cuda-gdb || echo /usr/local/cuda/bin/cuda-gdb)"
  [[ -x "$gdb" ]] || return 0
  t="$(budget_for 90 30)"
  ((t == 0)) && return 0
  log="$LOGDIR/backtrace_${filter//[^A-Za-z0-9_.]/_}.log"
  run_cmd "$log" "$t" "$gdb" -batch -ex run -ex bt -ex 'info cuda kernels' --args "$bin" "--gtest_filter=$filter" \
    --gtest_color=no
  say "    backtrace: $(grep -a -E '^#[0-9]+ ' "$log" | head -n 6 | cut -c1-160 | paste -sd'|' -)"
}
stage_test() {
  local bins=() b n t list ran=0 passed=0 failed=0 skipped=0 crashed=() names=() log
  mapfile -t bins < <(test_binaries)
  if $DRY; then bins=("$BUILD/tests/test_backend"); fi
  if ((${#bins[@]} == 0)); then record test FAIL "no test binaries in $(rel "$BUILD")/tests"; return; fi
  for b in "${bins[@]}"; do
    n="$(basename "$b")"
    list="$LOGDIR/tests_$n.list"
    $DRY || list_cuda_tests "$b" "$list"
    if ! $DRY && [[ ! -s "$list" ]]; then continue; fi
    CUDA_TESTS[$b]="$list"
    # One process per test suite: a crash (a host segfault, a sticky CUDA error) loses one suite, not the
    # whole binary, and names it. Line-buffered, so a crash's log ends at the test that crashed.
    local suite suites
    if $DRY; then suites=("<each suite>"); else mapfile -t suites < <(cut -d. -f1 "$list" | awk '!seen[$0]++'); fi
    for suite in "${suites[@]}"; do
      t="$(budget_for "${GPU_TEST_TIMEOUT:-150}" 20)"
      if ((t == 0)); then crashed+=("$n/$suite: no time left"); continue; fi
      log="$LOGDIR/test_${n}_$suite.log"
      run_cmd "$log" "$t" stdbuf -oL -eL "$b" "--gtest_filter=$suite.*" --gtest_color=no
      $DRY && continue
      ran=$((ran + 1))
      local p f s total
      total="$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log" | tail -n 1)"
      p="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' "$log" | tail -n 1)"
      s="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below:.*/\1/p' "$log" | tail -n 1)"
      f="$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\{0,1\}, listed below:.*/\1/p' "$log" | tail -n 1)"
      passed=$((passed + ${p:-0})) skipped=$((skipped + ${s:-0})) failed=$((failed + ${f:-0}))
      if [[ -z "$total" ]]; then
        local last
        last="$(grep -a '^\[ RUN      \]' "$log" | tail -n 1 | sed 's/^\[ RUN      \] //')"
        if timed_out; then crashed+=("$suite timed out after ${DUR}s in ${last:-?}")
        else
          crashed+=("$suite exit $RC in ${last:-?}")
          test_backtrace "$b" "${last:-$suite.*}"
        fi
      fi
      mapfile -t -O "${#names[@]}" names < <(sed -n 's/^\[  FAILED  \] \([A-Za-z0-9_/]*\.[A-Za-z0-9_/]*\).*/\1/p' "$log" | sort -u)
    done
  done
  if $DRY; then record test SKIP "dry run"; return; fi
  if ((ran == 0 && ${#crashed[@]} == 0)); then
    record test FAIL "no test named like $TEST_FILTER in: $(printf '%s ' "${bins[@]##*/}")"
    return
  fi
  local fig="$passed passed, $failed failed, $skipped skipped ($ran binaries, filter '$TEST_FILTER')"
  if ((${#names[@]})); then
    fig+="; failed: $(printf '%s ' "${names[@]:0:4}")"
    fig="${fig% }"
    ((${#names[@]} > 4)) && fig+=" ..."
  fi
  if ((${#crashed[@]})); then fig+="; $(printf '%s; ' "${crashed[@]}")"; fig="${fig%; }"; fi
  if ((failed == 0 && ${#crashed[@]} == 0 && passed > 0)); then
    ((skipped > 0)) && $GPU_OK && fig+=" (skips with a GPU visible: see the log)"
    record test PASS "$fig"
  else
    ((passed == 0 && failed == 0 && ${#crashed[@]} == 0)) && fig+=" (nothing passed: did REQUIRE_GPU skip everything?)"
    record test FAIL "$fig"
  fi
}

# ---- stage: sanitize ----------------------------------------------------------------------------------
stage_sanitize() {
  local san tool b n filter t log errs results=() bad=0 max="${GPU_SANITIZE_MAX:-40}"
  san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  if ! $DRY && [[ ! -x "$san" ]]; then record sanitize SKIP "compute-sanitizer not found"; return; fi
  if $DRY; then CUDA_TESTS["$BUILD/tests/test_backend"]="/dev/null"; fi
  if ((${#CUDA_TESTS[@]} == 0)); then
    for b in $(test_binaries); do
      list_cuda_tests "$b" "$LOGDIR/tests_$(basename "$b").list"
      [[ -s "$LOGDIR/tests_$(basename "$b").list" ]] && CUDA_TESTS[$b]="$LOGDIR/tests_$(basename "$b").list"
    done
  fi
  if ((${#CUDA_TESTS[@]} == 0)); then record sanitize SKIP "no CUDA tests to run"; return; fi
  for tool in ${GPU_SANITIZE_TOOLS:-memcheck}; do
    for b in "${!CUDA_TESTS[@]}"; do
      n="$(basename "$b")"
      if [[ -n "${GPU_SANITIZE_FILTER:-}" ]]; then
        filter="$GPU_SANITIZE_FILTER"
      elif $DRY; then
        filter="<first CUDA test of each suite, at most $max>"
      else  # the first test of each suite: every kernel family once, quickly. Tests that provoke CUDA API
        # errors on purpose (error naming, bad arguments) are left out: the sanitizer counts those calls.
        filter="$(grep -vE 'CheckNames|Rejects|Bad|Error|Checks' "${CUDA_TESTS[$b]}" | awk -F. '!seen[$1]++' |
          head -n "$max" | paste -sd: -)"
      fi
      t="$(budget_for "${GPU_SANITIZE_TIMEOUT:-120}" 30)"
      if ((t == 0)); then results+=("$tool/$n: no time left"); continue; fi
      log="$LOGDIR/sanitize_${tool}_$n.log"
      run_cmd "$log" "$t" "$san" --tool "$tool" --error-exitcode 86 --print-limit 50 "$b" \
        "--gtest_filter=$filter" --gtest_color=no
      $DRY && continue
      errs="$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$log" | tail -n 1)"
      local ntests
      ntests="$(tr ':' '\n' <<<"$filter" | grep -c .)"
      if timed_out; then
        results+=("$tool/$n: timed out (${ntests} tests)"); bad=1
      elif ((RC == 0)) && [[ "${errs:-x}" == 0 ]]; then
        results+=("$tool/$n: 0 errors over $ntests tests")
      elif ((RC != 86)) && [[ "${errs:-x}" == 0 ]]; then
        # No memory error; the exit status is the tests' own (failures are the test stage's business).
        results+=("$tool/$n: 0 errors over $ntests tests (the tests exited $RC: see the test stage)")
      elif [[ -n "$errs" && "$errs" != 0 ]]; then
        results+=("$tool/$n: $errs errors ($(grep -m1 -E '^========= (Invalid|Program hit|Race|Uninitialized|Barrier)' "$log" | sed 's/^========= //' | cut -c1-90))"); bad=1
      else
        results+=("$tool/$n: exit $RC ($(tail_err "$log"))"); bad=1
      fi
    done
  done
  if $DRY; then record sanitize SKIP "dry run"; return; fi
  local fig
  fig="$(printf '%s; ' "${results[@]}")"
  record sanitize "$( ((bad)) && echo FAIL || echo PASS)" "${fig%; }"
}

# ---- stage: train (GPU vs CPU losses) -----------------------------------------------------------------
loom_ready() {
  if $DRY || [[ -x "$LOOM" ]]; then return 0; fi
  record "$1" SKIP "no Loom binary at $(rel "$LOOM") (build failed or skipped)"
  return 1
}
# train_run KEY DEV FLAGS... : one `loom train` on DEV with a metrics JSONL; logs in TLOG/TJS, RC set.
# Returns 1 (and runs nothing) when the budget has no time left for it.
train_run() {
  local key="$1" dev="$2" t
  shift 2
  t="$(budget_for "${GPU_TRAIN_TIMEOUT:-90}" 15)"
  ((t == 0)) && return 1
  TLOG="$LOGDIR/train_${key}_$dev.log" TJS="$LOGDIR/train_${key}_$dev.jsonl"
  rm -f "$TJS"  # loom appends to an existing metrics file
  run_cmd "$TLOG" "$t" env "OMP_NUM_THREADS=${GPU_TRAIN_CPU_THREADS:-$NPROC}" "$LOOM" train "$@" --device "$dev" \
    --metrics-jsonl "$TJS"
  return 0
}
# Flags of one training variant (mock tokens or the packed text dataset; GPT-2 or Llama architecture).
train_variant_flags() {
  local variant="$1" data="${GPU_TRAIN_DATA:-}" N="${2:-${GPU_TRAIN_ITERS:-20}}"
  local L="${GPU_TRAIN_LAYERS:-2}" C="${GPU_TRAIN_HIDDEN:-128}" T="${GPU_TRAIN_SEQ:-128}" B="${GPU_TRAIN_BATCH:-4}"
  local V="${GPU_TRAIN_VOCAB:-1000}"
  VFLAGS=(--num-layers "$L" --hidden-size "$C" --seq-length "$T" --max-position-embeddings "$T"
    --micro-batch-size "$B" --global-batch-size "$((2 * B))" --train-iters "$N" --lr 1e-3 --min-lr 1e-4
    --lr-warmup-iters 2 --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --clip-grad 1.0 --log-interval 1 --eval-iters 0 --seed 1234)
  local arch=(--num-attention-heads 2) drop=(--hidden-dropout 0 --attention-dropout 0) src=(--mock-data --vocab-size "$V")
  case "$variant" in
    gpt*) ;;
    llama*|moe*|lora*)
      arch=(--num-attention-heads 4 --group-query-attention --num-query-groups 2 --normalization RMSNorm
            --swiglu --ffn-hidden-size 344 --position-embedding-type rope --untie-embeddings-and-output-weights
            --disable-bias-linear)
      # moe: the Llama layers with 4 routed experts (top-2, grouped GEMM, aux + z loss) and a shared expert;
      # lora: rank-8 adapters on every linear of the Llama layers, the base frozen.
      if [[ "$variant" == moe* ]]; then
        arch+=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 172 --moe-shared-expert-intermediate-size 172
               --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3)
      elif [[ "$variant" == lora* ]]; then
        arch+=(--lora-rank 8 --lora-alpha 16)
      fi ;;
    *) return 1 ;;
  esac
  local text=(--data-path "$data/text_document" --split 100,0,0 --tokenizer-type GPT2BPETokenizer
              --vocab-file "$data/encoder.json" --merge-file "$data/vocab.bpe")
  case "$variant" in
    *-text)  # real text, nothing else
      [[ -n "$data" && -f "$data/text_document.idx" ]] || return 2
      src=("${text[@]}") ;;
    *-oob)  # token ids up to 1099 for a vocabulary of 1000
      [[ -n "$data" && -f "$data/oob_document.idx" ]] || return 2
      src=(--data-path "$data/oob_document" --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 1000) ;;
    *-features)  # dropout + recomputation + document masks on real text
      [[ -n "$data" && -f "$data/text_document.idx" ]] || return 2
      drop=(--hidden-dropout 0.1 --attention-dropout 0.1)
      src=("${text[@]}" --reset-attention-mask --reset-position-ids --eod-mask-loss)
      if [[ "$variant" == gpt* ]]; then src+=(--recompute-granularity selective)
      else src+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1); fi ;;
  esac
  VFLAGS+=("${arch[@]}" "${drop[@]}" "${src[@]}")
}
prec_flags() {  # PREC -> PFLAGS, PRTOL
  case "$1" in
    fp32) PFLAGS=() PRTOL="${GPU_TRAIN_RTOL:-1e-4}" ;;
    bf16) PFLAGS=(--bf16) PRTOL="${GPU_TRAIN_RTOL_BF16:-2e-2}" ;;
    fp8) PFLAGS=(--bf16 --fp8-format hybrid) PRTOL="${GPU_TRAIN_RTOL_FP8:-5e-2}" ;;
    *) return 1 ;;
  esac
}
# compare_runs LABEL A_JSONL B_JSONL RTOL [compare args]: records PASS/FAIL from parse_loom_log.py compare.
compare_runs() {
  local label="$1" a="$2" b="$3" rtol="$4" cmp key
  shift 4
  key="${label//[^A-Za-z0-9]/_}"
  cmp="$("$PYTHON" "$PARSE" compare "$a" "$b" --rtol "$rtol" "$@" 2>"$LOGDIR/compare_$key.txt")"
  echo "$cmp" >>"$LOGDIR/compare_$key.txt"
  local iters worst wit
  iters="$(jget "$cmp" iters)" worst="$(jget "$cmp" max_rel_diff)" wit="$(jget "$cmp" worst_iter)"
  local fig="max rel diff of lm loss $(fmt "${worst:-nan}" .2e) (iteration ${wit:-?}) over ${iters:-0} iterations, tol $rtol"
  if [[ "$(jget "$cmp" ok)" == True ]]; then record "$label" PASS "$fig"
  else record "$label" FAIL "$fig $(jget "$cmp" problems)"; fi
}
stage_train() {
  loom_ready train || return
  local variant prec dev ok dline rc
  local N="${GPU_TRAIN_ITERS:-20}"
  for variant in ${GPU_TRAIN_VARIANTS:-gpt llama gpt-features llama-features moe lora}; do
    [[ "$variant" == none ]] && continue  # GPU_TRAIN_VARIANTS=none: only the GPU-only checks below
    train_variant_flags "$variant"
    rc=$?
    if ((rc == 1)); then record "train $variant" FAIL "unknown variant (gpt, llama, moe, lora, gpt-features, llama-features)"; continue; fi
    if ((rc == 2)); then record "train $variant" SKIP "needs GPU_TRAIN_DATA with text_document.{bin,idx} (scripts/gpu_pack.sh)"; continue; fi
    for prec in ${GPU_TRAIN_PRECISIONS:-fp32 bf16}; do
      if ! prec_flags "$prec"; then record "train $variant $prec" FAIL "unknown precision (fp32, bf16, fp8)"; continue; fi
      ok=true
      for dev in cpu cuda; do
        if ! train_run "${variant}_$prec" "$dev" "${VFLAGS[@]}" ${PFLAGS[@]+"${PFLAGS[@]}"}; then
          record "train $variant $prec cpu-vs-gpu" SKIP "no time left"; ok=false; break
        fi
        if ! $DRY && ((RC != 0)); then
          record "train $variant $prec cpu-vs-gpu" FAIL "--device $dev run: $(why_failed "$TLOG")"; ok=false; break
        fi
      done
      $ok || continue
      if $DRY; then record "train $variant $prec cpu-vs-gpu" SKIP "dry run"; continue; fi
      dline="$("$PYTHON" "$PARSE" device "$TLOG")"
      if [[ "$dline" != cuda* ]]; then
        record "train $variant $prec cpu-vs-gpu" FAIL "--device cuda run did not compute on the GPU (device: ${dline:-not printed})"
        continue
      fi
      compare_runs "train $variant $prec cpu-vs-gpu" "$LOGDIR/train_${variant}_${prec}_cpu.jsonl" \
        "$LOGDIR/train_${variant}_${prec}_cuda.jsonl" "$PRTOL"
    done
  done
  stage_train_gpu_only
}
# Determinism, save/resume, FP8 trains, out-of-range token ids: GPU runs only.
stage_train_gpu_only() {
  local variant="${GPU_TRAIN_REPEAT_VARIANT:-llama-features}" prec=bf16 first ck
  train_variant_flags "$variant" || variant=llama
  train_variant_flags "$variant"
  prec_flags "$prec"
  first="$LOGDIR/train_${variant}_${prec}_cuda.jsonl"
  if [[ -s "$first" ]] || $DRY; then
    if train_run "${variant}_${prec}_again" cuda "${VFLAGS[@]}" "${PFLAGS[@]}"; then
      if $DRY; then record "train gpu determinism" SKIP "dry run"
      elif ((RC != 0)); then record "train gpu determinism ($variant $prec)" FAIL "$(why_failed "$TLOG")"
      else compare_runs "train gpu determinism ($variant $prec, same seed twice)" "$first" "$TJS" 0; fi
    fi
    ck="$LOGDIR/ckpt_resume"
    rm -rf "$ck"
    if train_run "${variant}_${prec}_save10" cuda "${VFLAGS[@]}" "${PFLAGS[@]}" --save "$ck" --exit-interval 10 &&
       { $DRY || ((RC == 0)); } &&
       train_run "${variant}_${prec}_resume" cuda "${VFLAGS[@]}" "${PFLAGS[@]}" --load "$ck"; then
      if $DRY; then record "train gpu resume" SKIP "dry run"
      elif ((RC != 0)); then record "train gpu resume ($variant $prec)" FAIL "$(why_failed "$TLOG")"
      else compare_runs "train gpu save@10+resume vs straight ($variant $prec)" "$first" "$TJS" 0 --from-iter 11; fi
    elif ! $DRY; then
      record "train gpu resume ($variant $prec)" FAIL "save run: $(why_failed "$TLOG")"
    fi
  else
    record "train gpu determinism/resume" SKIP "no straight $variant $prec GPU run to compare with"
  fi
  # FP8 (hybrid) on real text: the loss falls.
  if train_variant_flags gpt-text "${GPU_TRAIN_FP8_ITERS:-60}"; then
    if train_run gpt_fp8_falls cuda "${VFLAGS[@]}" --bf16 --fp8-format hybrid; then
      if $DRY; then record "train gpu fp8 loss falls" SKIP "dry run"
      elif ((RC != 0)); then record "train gpu fp8 loss falls" FAIL "$(why_failed "$TLOG")"
      else
        local r
        r="$("$PYTHON" "$PARSE" falls "$TJS" --min-drop 1.0)"
        record "train gpu fp8 (hybrid) loss falls" "$([[ "$(jget "$r" ok)" == True ]] && echo PASS || echo FAIL)" \
          "$(jget "$r" iters) iterations: lm loss $(fmt "$(jget "$r" first_loss)" .3f) -> $(fmt "$(jget "$r" last3_mean)" .3f) (last 3), needs a drop >= 1.0"
      fi
    fi
  else
    record "train gpu fp8 loss falls" SKIP "needs GPU_TRAIN_DATA (scripts/gpu_pack.sh)"
  fi
  # Token ids beyond --vocab-size: the run must stop with an error naming the batch, on both devices.
  if train_variant_flags gpt-oob; then
    local dev line
    for dev in cpu cuda; do
      train_run oob "$dev" "${VFLAGS[@]}" || break
      $DRY && continue
      line="$(grep -a -m1 -iE 'token id.*(out of range|vocabulary)|out-of-range token' "$TLOG" | cut -c1-200)"
      if ((RC != 0)) && ! timed_out && [[ -n "$line" ]]; then
        record "train $dev out-of-range token ids" PASS "exit $RC: ${line//|/\\|}"
      else
        record "train $dev out-of-range token ids" FAIL "exit $RC, error line: ${line:-none} ($(tail_err "$TLOG"))"
      fi
    done
  fi
}

# ---- stage: bench -------------------------------------------------------------------------------------
is_oom() { grep -qiE 'out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|OutOfMemory' "$1" 2>/dev/null; }

# bench_loom KEY LABEL L C NH T B W N TIMEOUT PREC_FLAGS... : sets R[KEY_*]; retries once at B/2 on OOM.
bench_loom() {
  local key="$1" label="$2" L="$3" C="$4" NH="$5" T="$6" B="$7" W="$8" N="$9" tmo="${10}"
  shift 10
  local V="${GPU_BENCH_VOCAB:-50257}" t log js res attempt
  for attempt in 1 2; do
    t="$(budget_for "$tmo" 30)"
    if ((t == 0)); then record "$label" SKIP "no time left"; return 1; fi
    log="$LOGDIR/bench_${key}.log" js="$LOGDIR/bench_${key}.jsonl"
    rm -f "$js"
    run_cmd "$log" "$t" "$LOOM" train --device cuda --mock-data --vocab-size "$V" --num-layers "$L" \
      --hidden-size "$C" --num-attention-heads "$NH" --seq-length "$T" --max-position-embeddings "$T" \
      --micro-batch-size "$B" --global-batch-size "$B" --train-iters "$((W + N))" --lr 6e-4 --min-lr 6e-5 \
      --lr-warmup-iters 0 --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 \
      --clip-grad 1.0 --log-interval 1 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 1234 \
      --log-throughput --metrics-jsonl "$js" "$@"
    if $DRY; then record "$label" SKIP "dry run"; R[${key}_B]="$B"; return 1; fi
    if ((RC != 0)) && ! timed_out && is_oom "$log" && ((B > 1 && attempt == 1)); then
      say "    out of memory at micro-batch $B: retrying at $((B / 2))"
      mv "$log" "$LOGDIR/bench_${key}_oom_B$B.log"
      B=$((B / 2))
      continue
    fi
    break
  done
  R[${key}_B]="$B"
  if ((RC != 0)); then
    record "$label" FAIL "B=$B T=$T: $(why_failed "$log")"
    return 1
  fi
  res="$("$PYTHON" "$PARSE" timing "$js" --warmup "$W" --batch "$B" --seq "$T" --layers "$L" --hidden "$C" \
    --vocab "$V" --peak "$PEAK")"
  echo "$res" >>"$log"
  if [[ "$(jget "$res" ok)" != True ]]; then record "$label" FAIL "B=$B T=$T: $(jget "$res" error)"; return 1; fi
  R[${key}_ms]="$(jget "$res" ms_per_iter)" R[${key}_tps]="$(jget "$res" tokens_per_s)"
  R[${key}_mfu]="$(jget "$res" mfu)"
  record "$label" PASS "B=$B T=$T: $(fmt "${R[${key}_ms]}" .1f) ms/iter, $(fmt "${R[${key}_tps]}" ,.0f) tokens/s, MFU $(fmt "${R[${key}_mfu]}" .1%) ($(jget "$res" model_tflops) TFLOP/s; Loom's log: $(jget "$res" loom_logged_tflops)), median of $(jget "$res" iters) after $W warm-up, loss $(fmt "$(jget "$res" first_loss)" .3f) -> $(fmt "$(jget "$res" last_loss)" .3f)"
}

# bench_torch KEY LABEL L C NH T B W N TIMEOUT
bench_torch() {
  local key="$1" label="$2" L="$3" C="$4" NH="$5" T="$6" B="$7" W="$8" N="$9" tmo="${10}"
  local t log line attempt comp=(--compile)
  [[ "${GPU_BENCH_TORCH_COMPILE:-1}" == 1 ]] || comp=(--no-compile)
  for attempt in 1 2; do
    t="$(budget_for "$tmo" 40)"
    if ((t == 0)); then record "$label" SKIP "no time left"; return 1; fi
    log="$LOGDIR/bench_${key}.log"
    run_cmd "$log" "$t" env PYTHONUNBUFFERED=1 "$PYTHON" "$TORCH_BENCH" --layers "$L" --hidden "$C" --heads "$NH" \
      --seq "$T" --batch "$B" --vocab "${GPU_BENCH_VOCAB:-50257}" --iters "$N" --warmup "$W" --dtype bf16 \
      "${comp[@]}" --peak-tflops "$PEAK"
    if $DRY; then record "$label" SKIP "dry run"; return 1; fi
    if ((RC == 3 && B > 1 && attempt == 1)); then
      say "    PyTorch out of memory at batch $B: retrying at $((B / 2))"
      mv "$log" "$LOGDIR/bench_${key}_oom_B$B.log"
      B=$((B / 2))
      continue
    fi
    break
  done
  line="$(grep -a '^pytorch tokens/s:' "$log" | tail -n 1)"
  if ((RC != 0)) || [[ -z "$line" ]]; then
    record "$label" FAIL "B=$B T=$T: $(why_failed "$log")"
    return 1
  fi
  local info
  info="$(grep -a '^{"impl": "pytorch"' "$log" | tail -n 1)"
  R[${key}_tps]="$(awk '{print $3}' <<<"$line")" R[${key}_ms]="$(awk '{print $5}' <<<"$line")" R[${key}_B]="$B"
  record "$label" PASS "B=$B T=$T: $(fmt "${R[${key}_ms]}" .1f) ms/iter, $(fmt "${R[${key}_tps]}" ,.0f) tokens/s, MFU $(fmt "$(jget "$info" mfu)" .1%), torch $(jget "$info" torch), compile=$(jget "$info" compile), fused AdamW=$(jget "$info" fused_adamw), first iter $(jget "$info" first_iter_ms) ms, peak $(jget "$info" peak_mem_gib) GiB"
}

stage_bench() {
  loom_ready bench || return
  local L="${GPU_BENCH_124M_LAYERS:-12}" C="${GPU_BENCH_124M_HIDDEN:-768}" NH="${GPU_BENCH_124M_HEADS:-12}"
  local T="${GPU_BENCH_124M_SEQ:-1024}" B="${GPU_BENCH_124M_BATCH:-16}" W="${GPU_BENCH_124M_WARMUP:-5}"
  local N="${GPU_BENCH_124M_ITERS:-30}" m="GPT-2 124M"
  [[ "$L/$C/$NH" == 12/768/12 ]] || m="GPT L=$L C=$C NH=$NH"
  R[model_124]="$m"
  bench_loom l124 "bench $m loom bf16" "$L" "$C" "$NH" "$T" "$B" "$W" "$N" "${GPU_BENCH_TIMEOUT_124M:-120}" --bf16
  # PyTorch at the batch Loom ran (the same work), or the configured one when Loom failed.
  [[ "${GPU_BENCH_TORCH_124M:-1}" == 1 ]] && bench_torch t124 "bench $m pytorch bf16" "$L" "$C" "$NH" "$T" "${R[l124_B]:-$B}" "${GPU_BENCH_TORCH_WARMUP:-10}" \
    "$N" "${GPU_BENCH_TIMEOUT_TORCH:-240}"
  if [[ -n "${R[l124_tps]:-}" && -n "${R[t124_tps]:-}" ]]; then
    R[ratio_torch]="$(fmt "$("$PYTHON" -c "print(${R[l124_tps]} / ${R[t124_tps]})")" .2f)x"
    [[ "${R[l124_B]}" == "${R[t124_B]}" ]] || R[ratio_torch]+=" (different batch sizes: Loom ${R[l124_B]}, PyTorch ${R[t124_B]})"
    record "ratio loom/pytorch tokens/s ($m)" INFO "${R[ratio_torch]}"
  fi

  L="${GPU_BENCH_1B_LAYERS:-24}" C="${GPU_BENCH_1B_HIDDEN:-2048}" NH="${GPU_BENCH_1B_HEADS:-16}"
  T="${GPU_BENCH_1B_SEQ:-2048}" B="${GPU_BENCH_1B_BATCH:-4}" W="${GPU_BENCH_1B_WARMUP:-3}" N="${GPU_BENCH_1B_ITERS:-10}"
  m="GPT 1.3B"
  [[ "$L/$C/$NH" == 24/2048/16 ]] || m="GPT L=$L C=$C NH=$NH"
  R[model_1b]="$m"
  local prec
  for prec in ${GPU_BENCH_1B_PRECISIONS:-bf16 fp8}; do
    case "$prec" in
      bf16) bench_loom l1b_bf16 "bench $m loom bf16" "$L" "$C" "$NH" "$T" "$B" "$W" "$N" "${GPU_BENCH_TIMEOUT_1B:-150}" --bf16 ;;
      fp8) bench_loom l1b_fp8 "bench $m loom fp8 (hybrid)" "$L" "$C" "$NH" "$T" "${R[l1b_bf16_B]:-$B}" "$W" "$N" \
             "${GPU_BENCH_TIMEOUT_1B:-150}" --bf16 --fp8-format hybrid ;;
      *) record "bench $m $prec" FAIL "unknown precision (bf16, fp8)" ;;
    esac
  done
  if [[ -n "${R[l1b_bf16_ms]:-}" && -n "${R[l1b_fp8_ms]:-}" ]]; then
    R[ratio_fp8]="$(fmt "$("$PYTHON" -c "print(${R[l1b_bf16_ms]} / ${R[l1b_fp8_ms]})")" .2f)x"
    [[ "${R[l1b_bf16_B]}" == "${R[l1b_fp8_B]}" ]] || R[ratio_fp8]+=" (different batch sizes)"
    record "ratio fp8/bf16 speed ($m)" INFO "${R[ratio_fp8]} (BF16 ms/iter / FP8 ms/iter; MFU of both against the BF16 peak)"
  fi
  if [[ "${GPU_BENCH_TORCH_1B:-0}" == 1 ]]; then
    bench_torch t1b "bench $m pytorch bf16" "$L" "$C" "$NH" "$T" "${R[l1b_bf16_B]:-$B}" "${GPU_BENCH_TORCH_WARMUP:-10}" \
      "$N" "${GPU_BENCH_TIMEOUT_TORCH:-240}"
  fi
}

# ---- stage: kernels (optional): where one training iteration's GPU time goes -------------------------------
stage_kernels() {
  loom_ready kernels || return
  local ncu t c res prec
  local L="${GPU_KERNELS_LAYERS:-12}" C="${GPU_KERNELS_HIDDEN:-768}" NH="${GPU_KERNELS_HEADS:-12}"
  local T="${GPU_KERNELS_SEQ:-1024}" B="${GPU_KERNELS_BATCH:-${R[l124_B]:-${GPU_BENCH_124M_BATCH:-16}}}"
  ncu="$(command -v ncu)"
  for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do [[ -x "$c" ]] && ncu="${ncu:-$c}"; done
  if ! $DRY && [[ ! -x "$ncu" ]]; then record kernels SKIP "ncu not found"; return; fi
  for prec in ${GPU_KERNELS_PRECISIONS:-bf16}; do
    local key="kernels_L${L}_C${C}_$prec" pflags=(--bf16) csv
    [[ "$prec" == fp8 ]] && pflags=(--bf16 --fp8-format hybrid)
    [[ "$L/$C/$NH/$T/$prec" == 12/768/12/1024/bf16 ]] && key=kernels_124m
    csv="$LOGDIR/$key.csv"
    t="$(budget_for "${GPU_KERNELS_TIMEOUT:-150}" 40)"
    if ((t == 0)); then record "kernels $prec" SKIP "no time left"; continue; fi
    # One iteration (the 3rd: warm caches and plans), every kernel timed once by ncu at the card's own
    # clocks. ncu serialises kernels, so the sum is GPU busy time without overlap.
    run_cmd "$csv" "$t" "${ncu:-ncu}" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
      --csv --print-units base "$LOOM" train --device cuda --mock-data --vocab-size 50257 --num-layers "$L" \
      --hidden-size "$C" --num-attention-heads "$NH" --seq-length "$T" --max-position-embeddings "$T" \
      --micro-batch-size "$B" --global-batch-size "$B" --train-iters 4 --lr 6e-4 --log-interval 1 --hidden-dropout 0 \
      --attention-dropout 0 --eval-iters 0 "${pflags[@]}" --profile --profile-step-start 2 --profile-step-end 3
    if $DRY; then record "kernels $prec" SKIP "dry run"; continue; fi
    if ((RC != 0)); then record "kernels $prec" FAIL "$(why_failed "$csv")"; continue; fi
    res="$("$PYTHON" "$PARSE" kernels "$csv" --out "$LOGDIR/$key.txt")"
    [[ -n "${OUT:-}" ]] && cp "$LOGDIR/$key.txt" "$OUT/" 2>/dev/null
    record "kernels $prec" "$([[ "$(jget "$res" ok)" == True ]] && echo PASS || echo FAIL)" \
      "GPT L=$L C=$C NH=$NH T=$T B=$B $prec, one iteration: $(jget "$res" total_ms) ms GPU time over $(jget "$res" kernels) kernels; top: $(jget "$res" top)"
  done
}

# ---- stage: profile (optional) ------------------------------------------------------------------------
stage_profile() {
  loom_ready profile || return
  local nsys="${NSYS:-}" t c
  if [[ -z "$nsys" ]]; then
    nsys="$(command -v nsys)"
    for c in /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys; do [[ -x "$c" ]] && nsys="${nsys:-$c}"; done
  fi
  if ! $DRY && [[ ! -x "$nsys" ]]; then record profile SKIP "nsys not found (set NSYS)"; return; fi
  t="$(budget_for "${GPU_PROFILE_TIMEOUT:-120}" 30)"
  if ((t == 0)); then record profile SKIP "no time left"; return; fi
  run_cmd "$LOGDIR/profile.log" "$t" "${nsys:-nsys}" profile -o "$LOGDIR/loom_gpt2_124m" --force-overwrite true \
    --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx,cublas "$LOOM" train --device cuda \
    --mock-data --vocab-size 50257 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --micro-batch-size "${R[l124_B]:-${GPU_BENCH_124M_BATCH:-16}}" --train-iters 10 --lr 6e-4 --log-interval 1 \
    --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --bf16 --profile --profile-step-start 5 \
    --profile-step-end 8
  if $DRY; then record profile SKIP "dry run"; return; fi
  if ((RC != 0)) || [[ ! -f "$LOGDIR/loom_gpt2_124m.nsys-rep" ]]; then
    record profile FAIL "$(why_failed "$LOGDIR/profile.log")"
    return
  fi
  t="$(budget_for 60 15)"
  ((t > 0)) && run_cmd "$LOGDIR/profile_kernels.log" "$t" "$nsys" stats --report cuda_gpu_kern_sum --format csv \
    "$LOGDIR/loom_gpt2_124m.nsys-rep"
  record profile PASS "$(rel "$LOGDIR")/loom_gpt2_124m.nsys-rep (iterations 5-7); top kernels in profile_kernels.log"
}

# ---- run ----------------------------------------------------------------------------------------------
say "Loom GPU check: stages '$STAGES', budget ${BUDGET}s, build $(rel "$BUILD"), arch $ARCH$($DRY && echo ', DRY RUN')"
stage_gpu  # always: the summary names the GPU
for st in $STAGES; do
  case "$st" in
    gpu) ;;
    deps) stage_deps ;;
    build) stage_build ;;
    test | sanitize | train | bench | kernels | profile)
      if ! $GPU_OK && ! $DRY; then record "$st" SKIP "no GPU visible"; continue; fi
      if $BUILD_FAILED; then record "$st" SKIP "the build failed"; continue; fi
      "stage_$st" ;;
    *) record "$st" FAIL "unknown stage (gpu deps build test sanitize train bench kernels profile)" ;;
  esac
done
finish
! cut -f2 "$ROWS" | grep -qx FAIL
