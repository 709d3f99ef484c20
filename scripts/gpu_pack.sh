#!/usr/bin/env bash
# Builds Loom for the GPU machine HERE (the dev machine, which has nvcc but no GPU) and packs what a GPU run
# needs into one archive, so the GPU machine's scarce time goes to running, not to compiling:
#
#   out/gpuprebuilt.tar.xz  ->  (unpacked on the GPU machine into out/gpuprebuilt/)
#     build/loom, build/tests/test_backend    RPATH $ORIGIN/lib:$ORIGIN/../lib (DT_RPATH, so it also
#                                              covers the libraries' own dependencies); symbols kept
#     build/lib/*.so*                          every shared library they load that is not the C library
#                                              or a CUDA driver/toolkit library (oneDNN, ICU, yaml-cpp,
#                                              SentencePiece, protobuf-lite, libgomp, libstdc++, ...)
#     data/text_document.{bin,idx}             a small GPT-2-tokenised dataset: State of the Union
#                                              text, 1-4 sentences a document (many end-of-document tokens
#                                              inside a 128-token sequence), for --reset-attention-mask
#                                              and the loss-falls checks (mock tokens are uniform noise)
#     data/encoder.json, data/vocab.bpe        the GPT-2 vocabulary that dataset was made with
#     data/oob_document.{bin,idx}              the same with NullTokenizer ids up to 1100, for the
#                                              embedding's out-of-range check (--vocab-size 1000)
#
# The GPU build (build-gpu-pack/, Release): CUDA for LOOM_CUDA_ARCH only (default 90), no MPI and no NCCL
# (single-process GPU runs; OpenMPI's runtime plugins and libnccl would have to travel too, and libnccl
# alone is over 200 MB), -march=x86-64-v3 for the host code (the GPU machine's CPU is not this one).
#
# On the GPU machine (the device tool, carry ["out/gpuprebuilt.tar.xz"]):
#   mkdir -p out/gpuprebuilt && tar -xJf out/gpuprebuilt.tar.xz -C out/gpuprebuilt &&
#   GPU_BUILD_DIR=out/gpuprebuilt/build GPU_CHECK_STAGES="gpu test sanitize train bench" \
#   GPU_TRAIN_DATA=out/gpuprebuilt/data bash scripts/gpu_check.sh
#
# Usage: bash scripts/gpu_pack.sh          (build + pack; a rebuild only compiles what changed)
#        GPU_PACK_BUILD=0 bash scripts/gpu_pack.sh   (pack the existing build only)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${GPU_PACK_BUILD_DIR:-build-gpu-pack}"
ARCH="${LOOM_CUDA_ARCH:-90}"
STAGE="out/gpuprebuilt"
ARCHIVE="out/gpuprebuilt.tar.xz"
log() { echo "[gpu_pack] $*"; }

command -v patchelf >/dev/null || { echo "[gpu_pack] needs patchelf (bash scripts/setup.sh installs it)" >&2; exit 1; }

if [[ "${GPU_PACK_BUILD:-1}" == 1 ]]; then
  # NCCL_LIBRARY=OFF: a value find_library will not search again, and false for CMake's if().
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLOOM_NATIVE=OFF -DCMAKE_CXX_FLAGS="-march=x86-64-v3" \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DNCCL_LIBRARY=OFF >/dev/null
  cmake --build "$BUILD" -j"$(nproc)" --target loom test_backend
fi
ldd "$BUILD/loom" | grep -q libcudart || { echo "[gpu_pack] $BUILD/loom was built without CUDA" >&2; exit 1; }

rm -rf "$STAGE"
mkdir -p "$STAGE/build/tests" "$STAGE/build/lib" "$STAGE/data"
cp "$BUILD/loom" "$STAGE/build/loom"
cp "$BUILD/tests/test_backend" "$STAGE/build/tests/test_backend"

# Libraries: what ld.so resolves here, minus the C library family (the GPU machine's glibc is newer) and
# the CUDA driver/toolkit (the GPU machine's own, matching its driver).
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libcuda\.|libcudart\.|libcublas|libnccl|libnvidia)'
for bin in "$STAGE/build/loom" "$STAGE/build/tests/test_backend"; do
  ldd "$bin" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [[ -f "$STAGE/build/lib/$name" ]] || cp -L "$path" "$STAGE/build/lib/$name"
  done
done
if ldd "$STAGE/build/loom" | grep -q "not found"; then
  echo "[gpu_pack] unresolved libraries: $(ldd "$STAGE/build/loom" | grep 'not found')" >&2
  exit 1
fi
# Libraries stripped; the binaries keep their symbol tables (function names in a crash backtrace).
strip --strip-unneeded "$STAGE"/build/lib/*.so* 2>/dev/null || true
# shellcheck disable=SC2016  # $ORIGIN is for ld.so, not the shell
patchelf --force-rpath --set-rpath '$ORIGIN/lib:$ORIGIN/../lib' "$STAGE/build/loom" "$STAGE/build/tests/test_backend"
for l in "$STAGE"/build/lib/*.so*; do patchelf --force-rpath --set-rpath '$ORIGIN' "$l"; done

# Datasets (made with the freshly built loom on this machine's CPU).
LOOM="$BUILD/loom"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
[[ -s data/sotu.txt ]] || { echo "[gpu_pack] data/sotu.txt missing: run scripts/setup.sh" >&2; exit 1; }
# Documents of one to four sentences (about 20 to 120 tokens) from the first ~600 KB of text.
head -c 600000 data/sotu.txt | /usr/bin/python3 -c '
import json, random, re, sys
r = random.Random(7)
sents = [s for s in re.split(r"(?<=[.!?]) +", " ".join(sys.stdin.read().split())) if s]
i = 0
while i < len(sents):
    n = r.randint(1, 4)
    print(json.dumps({"text": " ".join(sents[i:i + n])}))
    i += n' >"$TMP/sotu.jsonl"
"$LOOM" preprocess --input "$TMP/sotu.jsonl" --output-prefix "$TMP/text" --tokenizer-type GPT2BPETokenizer \
  --vocab-file data/encoder.json --merge-file data/vocab.bpe --append-eod --workers 1 >/dev/null
cp "$TMP/text_text_document.bin" "$STAGE/data/text_document.bin"
cp "$TMP/text_text_document.idx" "$STAGE/data/text_document.idx"
cp data/encoder.json data/vocab.bpe "$STAGE/data/"
# Ids 0..1099 for a --vocab-size 1000 model: roughly one token in eleven is out of range.
/usr/bin/python3 -c '
import json, random
r = random.Random(7)
for _ in range(200):
    print(json.dumps({"text": " ".join(str(r.randrange(1100)) for _ in range(300))}))' >"$TMP/oob.jsonl"
"$LOOM" preprocess --input "$TMP/oob.jsonl" --output-prefix "$TMP/oob" --tokenizer-type NullTokenizer \
  --vocab-size 1100 --append-eod --workers 1 >/dev/null
cp "$TMP/oob_text_document.bin" "$STAGE/data/oob_document.bin"
cp "$TMP/oob_text_document.idx" "$STAGE/data/oob_document.idx"

tar -cJf "$ARCHIVE" -C "$STAGE" .
log "$ARCHIVE: $(du -h "$ARCHIVE" | cut -f1) ($(du -sh "$STAGE" | cut -f1) unpacked; $(ls "$STAGE/build/lib" | wc -l) libraries)"
