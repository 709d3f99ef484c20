#include "loom/train/config.h"

namespace loom {

int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int tp_size) {
  const int64_t multiple = divisible_by * tp_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

void TrainConfig::validate(int world_size) const {
  const auto need = [](bool ok, const char* flag) {
    if (!ok) user_error("missing required flag ", flag);
  };
  need(model.num_layers > 0, "--num-layers");
  need(model.hidden_size > 0, "--hidden-size");
  need(model.num_attention_heads > 0, "--num-attention-heads");
  need(batch.seq_length > 0, "--seq-length");
  need(batch.micro_batch_size > 0, "--micro-batch-size");
  need(batch.train_iters > 0, "--train-iters");
  if (model.hidden_size % model.num_attention_heads != 0)
    user_error("--hidden-size (", model.hidden_size, ") must be divisible by --num-attention-heads (",
               model.num_attention_heads, ")");
  if (model.max_position_embeddings < batch.seq_length)
    user_error("--max-position-embeddings (", model.max_position_embeddings, ") must be >= --seq-length (",
               batch.seq_length, ")");
  const int sources = int(data.mock_data) + int(!data.data_path.empty()) + int(!data.train_data_path.empty());
  if (sources == 0) user_error("no training data: pass --data-path PREFIX (see `loom preprocess`) or --mock-data");
  if (sources > 1) user_error("--mock-data, --data-path and --train-data-path are mutually exclusive");
  if (data.mock_data && !data.vocab_size) user_error("--mock-data needs --vocab-size");
  if (data.vocab_size && *data.vocab_size < 1) user_error("--vocab-size must be >= 1, got ", *data.vocab_size);
  if (!data.mock_data && data.tokenizer.type.empty())
    user_error("--tokenizer-type is required with --data-path (e.g. GPT2BPETokenizer with --vocab-file and "
               "--merge-file)");
  if (data.mock_data && (data.reset_position_ids || data.reset_attention_mask || data.eod_mask_loss))
    user_error("--reset-position-ids, --reset-attention-mask and --eod-mask-loss need documents: use --data-path "
               "(mock data has no end-of-document token)");
  if (data.make_vocab_size_divisible_by < 1)
    user_error("--make-vocab-size-divisible-by must be >= 1, got ", data.make_vocab_size_divisible_by);
  const int mp = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size *
                 parallel.context_parallel_size;
  const int dp = mp > 0 && world_size % mp == 0 ? world_size / mp : 1;
  if (batch.global_batch_size) {
    const int64_t g = *batch.global_batch_size, unit = batch.micro_batch_size * dp;
    if (g < 1) user_error("--global-batch-size must be >= 1, got ", g);
    if (g % unit != 0)
      user_error("--global-batch-size (", g, ") must be divisible by --micro-batch-size (", batch.micro_batch_size,
                 ") x data-parallel size (", dp, ") = ", unit);
  }
  if (optim.lr < 0) user_error("--lr must be >= 0, got ", optim.lr);
  if (optim.min_lr < 0 || optim.min_lr > optim.lr)
    user_error("--min-lr (", optim.min_lr, ") must be in [0, --lr (", optim.lr, ")]");
  if (optim.lr_warmup_iters < 0) user_error("--lr-warmup-iters must be >= 0, got ", optim.lr_warmup_iters);
  const int64_t decay = optim.lr_decay_iters.value_or(batch.train_iters);
  if (decay < 1) user_error("--lr-decay-iters must be >= 1, got ", decay);
  if (optim.lr_decay_style != LRDecayStyle::kConstant && optim.lr_warmup_iters >= decay)
    user_error("--lr-warmup-iters (", optim.lr_warmup_iters, ") must be smaller than --lr-decay-iters (", decay,
               optim.lr_decay_iters ? ")" : ", which defaults to --train-iters)");
  if (optim.weight_decay < 0) user_error("--weight-decay must be >= 0, got ", optim.weight_decay);
  if (!(optim.adam.beta1 >= 0 && optim.adam.beta1 < 1)) user_error("--adam-beta1 must be in [0, 1)");
  if (!(optim.adam.beta2 >= 0 && optim.adam.beta2 < 1)) user_error("--adam-beta2 must be in [0, 1)");
  if (!(optim.adam.eps > 0)) user_error("--adam-eps must be > 0");
  if (optim.clip_grad < 0) user_error("--clip-grad must be >= 0 (0 disables clipping), got ", optim.clip_grad);
  if (logging.log_interval < 1) user_error("--log-interval must be >= 1, got ", logging.log_interval);
}

}  // namespace loom
