#!/bin/bash

# Runs the "345M" parameter model
#
# Megatron-LM's examples/pretrain_gpt_distributed.sh, launched with mpirun and `loom train` instead of
# torchrun and pretrain_gpt.py, shrunk to a tiny model (2 layers, hidden 64, 4 heads, seq 64, 24
# iterations) that two CPU ranks train in seconds. The 345M sizes are in the comments below each block.
# Paths come from the environment (DATA_PATH, VOCAB_FILE, MERGE_FILE, CHECKPOINT_PATH); the run writes
# only to CHECKPOINT_PATH (and to the dataset index cache, DATA_PATH/cache/, as Megatron does).
# The first ~12 iterations are skipped while the FP16 loss scale comes down from 2^32 (Megatron does the
# same), so 24 iterations leave a dozen with an lm loss.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2                 # 8 in Megatron-LM: one rank per GPU (here: per CPU rank)
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_345m}
VOCAB_FILE=${VOCAB_FILE:-gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-gpt2-merges.txt}
DATA_PATH=${DATA_PATH:-my-gpt2_text_document}

# torchrun needed these to start and rendezvous its processes. mpirun starts every rank itself and Loom
# takes rank, world size and local rank from it, so they are kept for reference but not used.
DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    --num-layers 2 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 64 \
    --max-position-embeddings 64 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --lr 0.00015 \
    --train-iters 24 \
    --lr-decay-iters 16 \
    --lr-decay-style cosine \
    --min-lr 1.0e-5 \
    --weight-decay 1e-2 \
    --lr-warmup-fraction .01 \
    --clip-grad 1.0 \
    --fp16
"
# 345M: --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
#       --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 64
#       --train-iters 500000 --lr-decay-iters 320000

DATA_ARGS="
    --data-path $DATA_PATH \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --tokenizer-type GPT2BPETokenizer \
    --data-impl mmap \
    --split 949,50,1
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 12 \
    --eval-interval 12 \
    --eval-iters 2
"
# 345M: --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10

# torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
#     $GPT_ARGS \
#     $DATA_ARGS \
#     $OUTPUT_ARGS \
#     --distributed-backend nccl \
#     --save $CHECKPOINT_PATH \
#     --load $CHECKPOINT_PATH
mpirun --allow-run-as-root --oversubscribe -np $WORLD_SIZE loom train \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend nccl \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH
