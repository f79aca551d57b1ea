"""Pretrain T5: Megatron's hooks (model_provider, get_batch, loss_func, forward_step, datasets) + pretrain.

Span-corruption samples from `T5MaskedWordPieceDataset` (needs `--vocab-extra-ids` sentinels); the encoder
has `--encoder-num-layers` layers, the decoder `--num-layers` (which defaults to the encoder's; Megatron never
reads `--decoder-num-layers`); sequence lengths `--encoder-seq-length` / `--decoder-seq-length`. The loss is
`pretrain_gpt.loss_func` (token-weighted, logged as `lm loss`).
"""
from copy import deepcopy
from functools import partial

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.enums import ModelType
from megatron.core.models.T5 import t5_spec
from megatron.core.models.T5.t5_model import T5Model
from megatron.training.initialize import shutdown_distributed
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_blend_and_blend_per_split
from pretrain_gpt import loss_func

BATCH_KEYS = ["text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"]


def check_pipeline_layout(args) -> None:
    """Refuse T5 with pipeline parallelism, as Megatron does without its deprecated encoder-pipeline flag.

    Megatron 0.13.1's `pretrain_t5.py` asserts `--encoder-pipeline-model-parallel-size > 0` whenever
    `--pipeline-model-parallel-size > 1` ("Need to know how to shard the encoder & decoder."); that flag is
    rejected here, so every T5 pipeline layout is refused with the fix.
    """
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: T5 cannot be pipelined. "
            "Megatron-LM 0.13.1 needs --encoder-pipeline-model-parallel-size > 0 to split an encoder-decoder "
            "model over stages (\"Need to know how to shard the encoder & decoder.\"), and that deprecated flag "
            "is not supported here. Fix: use --pipeline-model-parallel-size 1 and scale T5 with "
            "--tensor-model-parallel-size (and --sequence-parallel) and data parallelism.")


def model_provider(pre_process=True, post_process=True, add_encoder=True, add_decoder=True, vp_stage=None) -> T5Model:
    """Build the T5 model (local or Transformer Engine block specs from --transformer-impl)."""
    args = get_args()
    check_pipeline_layout(args)
    print_rank_0("building T5 model ...")
    config = core_transformer_config_from_args(args)
    encoder_config = deepcopy(config)
    encoder_config.num_layers = args.encoder_num_layers
    encoder_layers = encoder_config.num_layers // encoder_config.pipeline_model_parallel_size
    decoder_layers = config.num_layers // config.pipeline_model_parallel_size
    if args.transformer_impl == "local":
        encoder_spec = t5_spec.get_t5_encoder_with_local_block_spec(encoder_layers)
        decoder_spec = t5_spec.get_t5_decoder_with_local_block_spec(decoder_layers)
    else:
        encoder_spec = t5_spec.get_t5_encoder_with_transformer_engine_block_spec(encoder_layers)
        decoder_spec = t5_spec.get_t5_decoder_with_transformer_engine_block_spec(decoder_layers)
    return T5Model(
        config=config, encoder_config=encoder_config, transformer_encoder_layer_spec=encoder_spec,
        transformer_decoder_layer_spec=decoder_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        relative_attention_num_buckets=args.relative_attention_num_buckets,
        relative_attention_max_distance=args.relative_attention_max_distance,
        add_encoder=add_encoder, add_decoder=add_decoder)


def get_batch(data_iterator, use_local: bool):
    """(tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask), broadcast over TP."""
    data = next(data_iterator) if data_iterator is not None else None
    data_b = tensor_parallel.broadcast_data(BATCH_KEYS, data, torch.int64)
    tokens_enc = data_b["text_enc"].long()
    tokens_dec = data_b["text_dec"].long()
    enc_mask, dec_mask, enc_dec_mask = T5MaskedWordPieceDataset.config_attention_mask(
        tokens_enc, tokens_dec, data_b["enc_mask"] < 0.5, data_b["dec_mask"] < 0.5, use_local)
    return (tokens_enc, tokens_dec, data_b["loss_mask"].float(), data_b["labels"].long(), enc_mask, dec_mask,
            enc_dec_mask)


def forward_step(data_iterator, model: T5Model):
    """Run the model on the next batch; return the per-token loss and the loss function to apply to it."""
    args = get_args()
    timers = get_timers()
    timers("batch generator", log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, lm_labels, enc_mask, dec_mask, enc_dec_mask = get_batch(
        data_iterator, args.transformer_impl == "local")
    timers("batch generator").stop()
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask)


def core_t5_dataset_config_from_args(args) -> T5MaskedWordPieceDatasetConfig:
    """`T5MaskedWordPieceDatasetConfig` from the data flags (Megatron's fixed span-corruption settings)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return T5MaskedWordPieceDatasetConfig(
        random_seed=args.seed, sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob, masking_max_ngram=10, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Train/valid/test T5 datasets, read on TP rank 0."""
    config = core_t5_dataset_config_from_args(get_args())
    print_rank_0("> building train, validation, and test datasets for T5 ...")
    datasets = BlendedMegatronDatasetBuilder(
        T5MaskedWordPieceDataset, train_val_test_num_samples,
        lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()
    print_rank_0("> finished creating T5 datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_and_decoder, forward_step,
             args_defaults={"tokenizer_type": "BertWordPieceLowerCase"})
    shutdown_distributed()
