#!/usr/bin/env bash
# End-to-end test: three published-style launch scripts (Megatron-LM's pretrain_gpt_distributed.sh,
# Megatron-DeepSpeed's ds_pretrain_gpt_125M*.sh with a ds_config.json, and a SLURM batch script) run
# with `mpirun ... loom train` / `srun loom train` on two CPU ranks, each followed by the equivalent
# plain `loom train` command (explicit flags, no --deepspeed). The iteration lines' "lm loss" values
# (and the validation losses) of the script's run and of the plain run must be the same strings.
# The test also checks each script's Loom notes and that it wrote its checkpoints and TensorBoard files,
# and nothing in the directory it was started from.
#
#   bash tests/e2e/launch_scripts/run_launch_scripts.sh <path to loom binary>
#
# Exits 0 (PASS), 1 (FAIL) or 77 (skipped: no GPT-2 vocabulary, text or mpirun). About 30 s on 2 cores.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
NAME="launch_scripts"

fail() { echo "FAIL: $NAME: $*"; exit 1; }
skip() { echo "SKIP: $NAME: $*"; exit 77; }

[[ $# -eq 1 ]] || { echo "usage: $0 <path to loom binary>" >&2; exit 2; }
LOOM_BIN="$1"

VOCAB="$ROOT/data/encoder.json"
MERGES="$ROOT/data/vocab.bpe"
TEXT="$ROOT/data/sotu.txt"
for f in "$VOCAB" "$MERGES" "$TEXT"; do
  [[ -s "$f" ]] || skip "$f not found (run scripts/setup.sh)"
done
command -v mpirun >/dev/null 2>&1 || skip "mpirun not found"
PYTHON="${PYTHON:-/usr/bin/python3}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3 || true)"
[[ -n "$PYTHON" ]] || skip "python3 not found"
[[ -x "$LOOM_BIN" && -f "$LOOM_BIN" ]] || fail "loom binary '$LOOM_BIN' not found or not executable"
LOOM_BIN="$(cd "$(dirname "$LOOM_BIN")" && pwd)/$(basename "$LOOM_BIN")"

MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np 2)
export OMP_NUM_THREADS=1
# Launcher variables from an enclosing job would change how Loom finds its rank; the runs here get
# theirs from mpirun (and SLURM_NTASKS for the fake srun, set below).
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
unset SLURM_PROCID SLURM_LOCALID SLURM_NTASKS SLURM_NPROCS SLURM_JOB_ID
unset DATA_PATH VOCAB_FILE MERGE_FILE CHECKPOINT_PATH TENSORBOARD_DIR OUTPUT_HOME

TMP="$(mktemp -d "${TMPDIR:-/tmp}/loom_launch_scripts.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)

# ---- data ---------------------------------------------------------------------------------------
# The first 20 addresses of data/sotu.txt, one document per sentence (~1200 documents, ~52k tokens).
# One document per address would leave the test part of the scripts' --split 949,50,1 empty (it needs
# >= 500 documents), which Loom refuses (Megatron would build no test set).
mkdir -p "$TMP/data"
"$PYTHON" - "$TEXT" "$TMP/data/sotu.jsonl" <<'PY'
import json, re, sys
paras = [p.strip() for p in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if p.strip()][:20]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for p in paras:
        for s in re.split(r"(?<=[.!?])\s+", p):
            if s.strip():
                f.write(json.dumps({"text": s.strip()}) + "\n")
PY
"$LOOM_BIN" preprocess --input "$TMP/data/sotu.jsonl" --output-prefix "$TMP/data/sotu" --json-keys text \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --append-eod --workers 1 >"$TMP/preprocess.log" 2>&1 ||
  { cat "$TMP/preprocess.log"; fail "loom preprocess failed"; }
DATA="$TMP/data/sotu_text_document"
[[ -s "$DATA.bin" && -s "$DATA.idx" ]] || fail "loom preprocess wrote no $DATA.bin/.idx"
# shellcheck disable=SC2054  # 949,50,1 is one argument
DATA_ARGS=(--data-path "$DATA" --split 949,50,1 --tokenizer-type GPT2BPETokenizer
           --vocab-file "$VOCAB" --merge-file "$MERGES")

# ---- launchers on PATH: loom, and an srun that starts the ranks with mpirun -----------------------
mkdir -p "$TMP/bin"
ln -s "$LOOM_BIN" "$TMP/bin/loom"
cat >"$TMP/bin/srun" <<'EOF'
#!/usr/bin/env bash
# Test stand-in for SLURM's srun: drop srun's own options, start SLURM_NTASKS ranks with mpirun.
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
exec mpirun --allow-run-as-root --oversubscribe -np "${SLURM_NTASKS:-2}" "$@"
EOF
chmod +x "$TMP/bin/srun"
export PATH="$TMP/bin:$PATH"

# ---- helpers ------------------------------------------------------------------------------------
# "lm loss" of every iteration line that has one, in order (skipped fp16 iterations have none).
iter_losses() { sed -n 's/^ \[[^]]*\] iteration .*| lm loss: \([^ |]*\) |.*/\1/p' "$1"; }
# "lm loss value" of every validation/test evaluation, in order.
eval_losses() { sed -n 's/.* lm loss value: \([^ |]*\) |.*/\1/p' "$1"; }
n_iter_lines() { grep -c '^ \[[^]]*\] iteration ' "$1" || true; }

# run_script NAME LOG CMD...: runs a launch script from an empty directory, which must stay empty.
run_script() {
  local name="$1" log="$2"; shift 2
  mkdir -p "$TMP/$name/cwd"
  if ! (cd "$TMP/$name/cwd" && "$@") >"$log" 2>&1; then
    tail -n 40 "$log"; fail "$name: the script exited with an error (log above)"
  fi
  [[ -z "$(ls -A "$TMP/$name/cwd")" ]] ||
    fail "$name: the script wrote into the directory it was started from: $(find "$TMP/$name/cwd" -mindepth 1 -maxdepth 1 -printf '%f ')"
}

# run_plain NAME LOG FLAGS...: the equivalent plain command on 2 ranks.
run_plain() {
  local name="$1" log="$2"; shift 2
  if ! "${MPIRUN[@]}" "$LOOM_BIN" train "$@" >"$log" 2>&1; then
    tail -n 40 "$log"; fail "$name: the plain loom train command failed (log above)"
  fi
}

# compare NAME SCRIPT_LOG PLAIN_LOG: same iteration lm losses (count > 0) and validation losses; sets
# n to the number of lm loss values.
compare() {
  local name="$1" a="$2" b="$3" la lb
  la="$(iter_losses "$a")"; lb="$(iter_losses "$b")"
  [[ -n "$la" ]] || { tail -n 20 "$a"; fail "$name: no 'lm loss:' iteration lines in the script's log"; }
  if [[ "$la" != "$lb" ]]; then
    diff <(echo "$la") <(echo "$lb") | head -n 20 || true
    fail "$name: lm loss of the script's run ($(wc -l <<<"$la") values) differs from the plain command's ($(wc -l <<<"$lb") values)"
  fi
  local va vb
  va="$(eval_losses "$a")"; vb="$(eval_losses "$b")"
  [[ -n "$va" ]] || fail "$name: no validation losses in the script's log"
  [[ "$va" == "$vb" ]] || fail "$name: validation losses differ: script [$(tr '\n' ' ' <<<"$va")] plain [$(tr '\n' ' ' <<<"$vb")]"
  n=$(wc -l <<<"$la")
}

expect_in_log() {  # NAME LOG TEXT...
  local name="$1" log="$2"; shift 2
  local t
  for t in "$@"; do
    grep -qF -- "$t" "$log" || fail "$name: the log lacks '$t'"
  done
}

expect_checkpoint() {  # NAME DIR ITER
  local name="$1" dir="$2" iter="$3"
  compgen -G "$dir/iter_*" >/dev/null || fail "$name: no iter_* checkpoint directory under $dir"
  [[ -d "$dir/$(printf 'iter_%07d' "$iter")" ]] || fail "$name: no checkpoint of iteration $iter under $dir"
  [[ "$(cat "$dir/latest_checkpointed_iteration.txt" 2>/dev/null)" == "$iter" ]] ||
    fail "$name: $dir/latest_checkpointed_iteration.txt does not say $iter"
}

expect_tensorboard() {  # NAME DIR
  [[ -n "$(find "$2" -name 'events.out.tfevents.*' -size +0 2>/dev/null | head -n 1)" ]] ||
    fail "$1: no events.out.tfevents.* file under $2"
}

expect_tb_tags() {  # NAME DIR TAG...: scalar tags present in the event files (tags are stored as text)
  local name="$1" dir="$2"; shift 2
  local t
  for t in "$@"; do
    find "$dir" -name 'events.out.tfevents.*' -exec grep -aqF -- "$t" {} + ||
      fail "$name: no TensorBoard scalar '$t' under $dir"
  done
}

# ---- a. Megatron-LM examples/pretrain_gpt_distributed.sh ----------------------------------------
name=pretrain_gpt_distributed
D="$TMP/$name"; mkdir -p "$D"
run_script "$name" "$D/script.log" env DATA_PATH="$DATA" VOCAB_FILE="$VOCAB" MERGE_FILE="$MERGES" \
  CHECKPOINT_PATH="$D/checkpoints" bash "$HERE/pretrain_gpt_distributed.sh"
run_plain "$name" "$D/plain.log" "${DATA_ARGS[@]}" \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters 24 \
  --lr 0.00015 --min-lr 1.0e-5 --lr-decay-iters 16 --lr-decay-style cosine --lr-warmup-fraction .01 \
  --weight-decay 1e-2 --clip-grad 1.0 --fp16 \
  --log-interval 1 --eval-interval 12 --eval-iters 2
compare "$name" "$D/script.log" "$D/plain.log"
[[ "$(n_iter_lines "$D/script.log")" == 24 ]] || fail "$name: expected 24 iteration lines"
expect_in_log "$name" "$D/script.log" \
  "--distributed-backend nccl: the ranks compute on the CPU, so their collectives use MPI" \
  "using world size: 2, data-parallel size: 2" \
  "mixed precision: fp16 compute" \
  "on test set | lm loss value:"
expect_checkpoint "$name" "$D/checkpoints" 24
[[ -d "$D/checkpoints/iter_0000012" ]] || fail "$name: no checkpoint of iteration 12 (--save-interval 12)"
echo "PASS: $name: mpirun -np 2 loom train = plain loom train ($n lm loss values identical), checkpoints written"

# ---- b. Megatron-DeepSpeed examples_deepspeed ds_pretrain_gpt_125M*.sh ----------------------------
name=ds_pretrain_gpt
D="$TMP/$name"; mkdir -p "$D"
run_script "$name" "$D/script.log" env DATA_PATH="$DATA" VOCAB_FILE="$VOCAB" MERGE_FILE="$MERGES" \
  OUTPUT_HOME="$D/output" CHECKPOINT_PATH="$D/checkpoints" TENSORBOARD_DIR="$D/tensorboard" \
  bash "$HERE/ds_pretrain_gpt.sh"
# What the ds_config notes say the file decides (ZeRO-1, initial scale 2^11, window 500, hysteresis 2,
# min scale 1, clipping 1.0, micro batch 2 of a global batch 8), as plain flags; the Megatron flags as
# the script gives them; --checkpoint-activations (+ --deepspeed-activation-checkpointing) spelled out.
run_plain "$name" "$D/plain.log" "${DATA_ARGS[@]}" \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --init-method-std 0.02 --micro-batch-size 2 --global-batch-size 8 \
  --train-samples 64 --train-tokens 3072 \
  --lr 6.0e-4 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-tokens 1024 --lr-decay-tokens 3072 \
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 \
  --fp16 --initial-loss-scale 2048 --loss-scale-window 500 --hysteresis 2 --min-loss-scale 1 \
  --use-distributed-optimizer \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --seed 1234 --log-interval 1 --eval-interval 3 --eval-iters 2
compare "$name" "$D/script.log" "$D/plain.log"
[[ "$(n_iter_lines "$D/script.log")" == 6 ]] || fail "$name: expected 6 iterations (--train-tokens 3072 = 6 x 512)"
cfg="$D/output/ds_config_gbs8_mbs2_log1_zero1.json"
[[ -s "$cfg" ]] || fail "$name: the script did not write $cfg"
grep -q '"prescale_gradients": false' "$cfg" || fail "$name: $cfg: prescale_gradients is not false with ZeRO stage 1"
expect_in_log "$name" "$D/script.log" \
  "ds_config $cfg: ZeRO stage 1" \
  "fp16.initial_scale_power 11 = 2048" \
  "fp16.loss_scale_window = 500" \
  "gradient_clipping = 1 (as --clip-grad)" \
  "train_batch_size = 8 (as --global-batch-size)" \
  "data-parallel sharding: optim over 2 ranks" \
  "activation recomputation: full" \
  "--train-tokens 3072: training stops after iteration 6"
! grep -q "wins over" "$D/script.log" ||
  fail "$name: the ds_config overrides a flag (the plain command assumes it does not): $(grep -m1 'wins over' "$D/script.log")"
expect_checkpoint "$name" "$D/checkpoints" 6
expect_tensorboard "$name" "$D/tensorboard"
expect_tb_tags "$name" "$D/tensorboard" "lm loss" "batch-size" "validation ppl" "iteration-time" \
  "optimizer/variance_l2" "optimizer/momentum_abs_max" "optimizer/weight_l2"
compgen -G "$D/output/log/*.log" >/dev/null || fail "$name: no log under OUTPUT_HOME/log (the script's tee)"
echo "PASS: $name: mpirun -np 2 loom train --deepspeed = plain loom train ($n lm loss values identical), ds_config, checkpoints and TensorBoard written"

# ---- c. SLURM batch script (srun) ----------------------------------------------------------------
name=slurm_pretrain_gpt
D="$TMP/$name"; mkdir -p "$D"
run_script "$name" "$D/script.log" env SLURM_NTASKS=2 DATA_PATH="$DATA" VOCAB_FILE="$VOCAB" \
  MERGE_FILE="$MERGES" CHECKPOINT_PATH="$D/checkpoints" TENSORBOARD_DIR="$D/tensorboard" \
  bash "$HERE/slurm_pretrain_gpt.sbatch"
run_plain "$name" "$D/plain.log" "${DATA_ARGS[@]}" \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters 24 \
  --lr 0.00015 --min-lr 1.0e-5 --lr-decay-iters 16 --lr-decay-style cosine --lr-warmup-fraction .01 \
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 1e-2 --clip-grad 1.0 --fp16 \
  --use-distributed-optimizer \
  --log-interval 1 --eval-interval 12 --eval-iters 2
compare "$name" "$D/script.log" "$D/plain.log"
[[ "$(n_iter_lines "$D/script.log")" == 24 ]] || fail "$name: expected 24 iteration lines"
expect_in_log "$name" "$D/script.log" \
  "num zeros:" "params norm:" \
  "(min, max) time across ranks (ms):" "forward-compute" "batch-generator" \
  "data-parallel sharding: optim over 2 ranks" \
  "using world size: 2, data-parallel size: 2"
expect_checkpoint "$name" "$D/checkpoints" 24
expect_tensorboard "$name" "$D/tensorboard"
expect_tb_tags "$name" "$D/tensorboard" "lm loss" "validation ppl" "forward-backward-time" \
  "mem-allocated-bytes" "num-zeros" "params-norm" "world-size"
echo "PASS: $name: srun loom train = plain loom train ($n lm loss values identical), checkpoints and TensorBoard written"

echo "PASS: $NAME: 3 launch scripts in $(( $(date +%s) - start )) s"
