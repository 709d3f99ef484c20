# OPENBLAS_CORETYPE for the PyTorch side of the benchmarks; sourced by bench/run_bench.sh and
# bench/llama_bench.sh (needs PYTHON and THREADS set). Loom is compared with PyTorch at its best: OpenBLAS
# 0.3.21 (Debian 12) does not recognise every recent CPU and then falls back to generic kernels when
# OPENBLAS_CORETYPE is unset, so by default ("auto") a short fp32 matmul probe times each candidate kernel
# set and the fastest is used. BENCH_TORCH_CORETYPE=unset|SkylakeX|Haswell|... forces one.

# The env(1) prefix that runs a command with OPENBLAS_CORETYPE=$1 ("unset": removed from the environment).
torch_env_for() {
  if [[ "$1" == unset ]]; then echo "env -u OPENBLAS_CORETYPE"; else echo "env OPENBLAS_CORETYPE=$1"; fi
}

# pick_torch_coretype TAG: resolves BENCH_TORCH_CORETYPE (auto -> the fastest probed) and sets TORCH_ENV,
# the prefix array for PyTorch commands. Probe times are logged as "[TAG] probe: ...".
pick_torch_coretype() {
  local tag=$1 core ms best_core=unset best_ms=""
  if [[ "${BENCH_TORCH_CORETYPE:-auto}" == auto ]]; then
    for core in unset SkylakeX Haswell; do
      ms="$($(torch_env_for "$core") OMP_NUM_THREADS="$THREADS" "$PYTHON" -c '
import os, time, torch
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
a, b = torch.randn(2048, 768), torch.randn(768, 3072)
a @ b
t = time.perf_counter()
for _ in range(5): a @ b
print(f"{(time.perf_counter() - t) / 5 * 1e3:.2f}")' 2>/dev/null || echo "")"
      echo "[$tag] probe: torch fp32 matmul 2048x768x3072 with OPENBLAS_CORETYPE=$core: ${ms:-failed} ms"
      if [[ -n "$ms" ]] && { [[ -z "$best_ms" ]] || awk -v a="$ms" -v b="$best_ms" 'BEGIN{exit !(a<b)}'; }; then
        best_core=$core best_ms=$ms
      fi
    done
    BENCH_TORCH_CORETYPE=$best_core
  fi
  read -r -a TORCH_ENV <<<"$(torch_env_for "$BENCH_TORCH_CORETYPE")"
}
