#!/bin/bash
# Megatron-DeepSpeed's examples_deepspeed ds_pretrain_gpt_125M*.sh, launched with mpirun and
# `loom train` instead of the deepspeed launcher and pretrain_gpt.py, and shrunk to a tiny model
# (2 layers, hidden 64, 4 heads, seq 64, ~6 iterations) that two CPU ranks train in seconds. The flags,
# the ds_config template and the deepspeed_options are the original's. The GPT-3 125M values are in the
# comments.
#
# Paths come from the environment: DATA_PATH, VOCAB_FILE, MERGE_FILE (the data), OUTPUT_HOME (the
# ds_config json and the log; default "output" as in the original), CHECKPOINT_PATH and TENSORBOARD_DIR
# (default under OUTPUT_HOME). Nothing is written anywhere else (except the dataset index cache,
# DATA_PATH/cache/, as Megatron does).
dir=`pwd`
###############################################################################
### Main configs
## GPT-3 models use 2K sequence length/context window
seq_len=64                        # 2048

## GPT-3 Small 125M, shrunk: 12 layers, hidden 768, 12 heads, global batch 256
model_size=0.125
num_layers=2
hidden_size=64
num_attn_heads=4
global_batch_size=8
lr=6.0e-4
min_lr=1.0e-6
init_std=0.02
###############################################################################
### Training duration configs
## The main termination condition: 3072 tokens = 6 iterations of 8 x 64 tokens (GPT-3: 300B tokens).
train_tokens=3072                 # $((300 * 1000000000))

## train_samples is another termination condition and also affect the number of
## data samples to be indexed. Set large enough not to terminate by train_samples
## (here 8 iterations: the token limit stops the run first).
train_samples=64                  # $(( 300 * 1000000000 * 2 / ${seq_len} ))

## Another wall-clock time termination condition in minutes. Set it large
## enough to avoid undesired early termination.
exit_duration=30000000
###############################################################################
### lr configs
## lr warmup and decay duration (the original: 3B warmup tokens, decay over the train tokens).
lr_warmup_tokens=1024             # $((3000 * 1000000))
lr_decay_tokens=${train_tokens}
lr_decay_style="cosine"
###############################################################################
### Parallelism configs
## Model parallelism, 1 is no MP
mp_size=1

## Pipeline parallelism. To disable PP, set pp_size to 1 and no_pp to true.
pp_size=1
no_pp="true"

## ZeRO-based data parallelism, stage=0 will disable ZeRO
zero_stage=1

## Total number of GPUs (here: CPU ranks).
num_gpus=2                        # 8
num_gpus_pernode=2
num_node=1

## Data parallel size.
dp_size=$(( ${num_gpus} / ${pp_size} / ${mp_size} ))

## Micro batch size per GPU
## Make sure that batch_size <= global_batch_size*pp_size*mp_size/num_gpus
batch_size=2
###############################################################################
### Misc configs
log_interval=1                    # 100
eval_iters=2                      # 100
eval_interval=3                   # 1000
estimated_train_iter=$((${train_tokens} / ${seq_len} / ${global_batch_size}))
save_interval=3                   # 1000

## Activation checkpointing saves GPU memory, but reduces training speed
activation_checkpoint="true"
# activation_checkpoint="false"

## Whether or not log optimizer states (norms, max abs values) to tensorboard.
## This is not required for training and might save GPU memory when turned off.
log_optimizer_state="true"
###############################################################################
### Output and data configs
current_time=$(date "+%Y.%m.%d_%H.%M.%S")
host="${HOSTNAME}"
seed=1234
num_workers=0

VOCAB_PATH=${VOCAB_FILE:-${dir}/dataset/gpt2-vocab.json}
MERGE_PATH=${MERGE_FILE:-${dir}/dataset/gpt2-merges.txt}
DATA_BLEND=${DATA_PATH:-${dir}/dataset/my-gpt2_text_document}

prescale_grad="true"
jobname="gpt_${model_size}B_tok${train_tokens}"
jobname="${jobname}_lr${lr}_min${min_lr}_w${lr_warmup_tokens}_d${lr_decay_tokens}_${lr_decay_style}"
jobname="${jobname}_gbs${global_batch_size}_mbs${batch_size}_g${num_gpus}"
if [[ $zero_stage -gt 0 ]]; then
    jobname="${jobname}_z${zero_stage}"
    prescale_grad="false"
fi
if [[ $mp_size -gt 1 ]]; then
    jobname="${jobname}_mp${mp_size}"
fi
if [ "${no_pp}" = "false" ]; then
    jobname="${jobname}_pp${pp_size}"
fi
jobname="${jobname}_seed${seed}"

output_home="${OUTPUT_HOME:-output}"
log_path="${output_home}/log"
checkpoint_path="${CHECKPOINT_PATH:-${output_home}/checkpoint/${jobname}}"
tensorboard_dir="${TENSORBOARD_DIR:-${output_home}/tensorboard}"
tensorboard_path="${tensorboard_dir}/${jobname}_${host}_${current_time}"
mkdir -p ${log_path}
mkdir -p ${checkpoint_path}
mkdir -p ${tensorboard_path}
###############################################################################
data_options=" \
         --vocab-file ${VOCAB_PATH} \
         --merge-file ${MERGE_PATH} \
         --data-path ${DATA_BLEND} \
         --tokenizer-type GPT2BPETokenizer \
         --data-impl mmap"

megatron_options=" \
    --no-gradient-accumulation-fusion \
    --override-opt_param-scheduler \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --tensor-model-parallel-size ${mp_size} \
    --init-method-std ${init_std} \
    --lr-decay-tokens ${lr_decay_tokens} \
    --lr-warmup-tokens ${lr_warmup_tokens} \
    --micro-batch-size ${batch_size} \
    --exit-duration-in-mins ${exit_duration} \
    --global-batch-size ${global_batch_size} \
    --num-layers ${num_layers} \
    --hidden-size ${hidden_size} \
    --num-attention-heads ${num_attn_heads} \
    --seq-length ${seq_len} \
    --max-position-embeddings ${seq_len} \
    --train-tokens ${train_tokens} \
    --train-samples ${train_samples} \
    --lr ${lr} \
    --min-lr ${min_lr} \
    --lr-decay-style ${lr_decay_style} \
    --split 949,50,1 \
    --log-interval ${log_interval} \
    --eval-interval ${eval_interval} \
    --eval-iters ${eval_iters} \
    --save-interval ${save_interval} \
    --weight-decay 0.1 \
    --clip-grad 1.0 \
    --hysteresis 2 \
    --num-workers ${num_workers} \
    --fp16 \
    --seed ${seed} \
    --load ${checkpoint_path} \
    --save ${checkpoint_path} \
    --no-async-tensor-model-parallel-allreduce \
    --tensorboard-queue-size 1 \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    --tensorboard-dir ${tensorboard_path}"

if [ "${activation_checkpoint}" = "true" ]; then
megatron_options="${megatron_options} \
    --checkpoint-activations"
fi

if [ "${log_optimizer_state}" = "true" ]; then
megatron_options="${megatron_options} \
    --log-optimizer-states-to-tensorboard"
fi

## The original keeps ds_config_gpt_TEMPLATE.json next to the script; here the template is a heredoc and
## the config goes to ${output_home}.
config_json="${output_home}/ds_config_gbs${global_batch_size}_mbs${batch_size}_log${log_interval}_zero${zero_stage}.json"
sed "s/GBSIZE/${global_batch_size}/" <<'TEMPLATE' \
    | sed "s/MBSIZE/${batch_size}/" \
    | sed "s/LOG_INTERVAL/${log_interval}/" \
    | sed "s/ZERO_STAGE/${zero_stage}/" \
    | sed "s/PRESCALE_GRAD/${prescale_grad}/" \
      > ${config_json}
{
  "train_batch_size" : GBSIZE,
  "train_micro_batch_size_per_gpu": MBSIZE,
  "steps_per_print": LOG_INTERVAL,

  "zero_optimization": {
    "stage": ZERO_STAGE
  },

  "gradient_clipping": 1.0,
  "prescale_gradients": PRESCALE_GRAD,

  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 11
  },

  "wall_clock_breakdown" : false
}
TEMPLATE

deepspeed_options=" \
    --deepspeed \
    --deepspeed_config ${config_json} \
    --zero-stage ${zero_stage} \
    --pipeline-model-parallel-size ${pp_size}"

if [[ "${no_pp}" = "true" ]]; then
deepspeed_options="${deepspeed_options} \
    --no-pipeline-parallel"
fi

if [ "${activation_checkpoint}" = "true" ]; then
deepspeed_options="${deepspeed_options} \
    --deepspeed-activation-checkpointing"
fi

## The original's loop here, which fixes latest_checkpointed_iteration.txt on every node over ssh (ds_ssh),
## is left out: one node, and no ssh.

# deepspeed --num_gpus=${num_gpus} ${dir}/../../pretrain_gpt.py ${megatron_options} ${data_options} ${deepspeed_options} |& tee ${log_path}/${jobname}_${host}_${current_time}.log
mpirun --allow-run-as-root --oversubscribe -np ${num_gpus} loom train ${megatron_options} ${data_options} ${deepspeed_options} |& tee ${log_path}/${jobname}_${host}_${current_time}.log
exit ${PIPESTATUS[0]}  # added: the launcher's status, not tee's
