"""Pretrain BERT: Megatron's hooks (model_provider, get_batch, loss_func, forward_step, datasets) + pretrain.

Samples come from `BERTMaskedWordPieceDataset` over a sentence-split corpus (`tools/preprocess_data.py
--split-sentences`); the loss is the masked-token LM loss plus, with the binary head, the sentence-order
loss, logged as `lm loss` and `sop loss` (Megatron's 2-tuple loss path: each microbatch's mean).
"""
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.enums import ModelType
from megatron.core.models.bert import bert_layer_specs
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.spec_utils import import_module
from megatron.training.initialize import shutdown_distributed
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import average_losses_across_data_parallel_group, get_blend_and_blend_per_split

BATCH_KEYS = ["text", "types", "labels", "is_random", "loss_mask", "padding_mask"]


def model_provider(pre_process=True, post_process=True, vp_stage: Optional[int] = None) -> BertModel:
    """Build the BERT model of this pipeline stage (TE-layout spec; `--spec local` for the local spec)."""
    args = get_args()
    print_rank_0("building BERT model ...")
    config = core_transformer_config_from_args(args)
    if args.spec is None:
        layer_spec = bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
    elif args.spec[0] == "local":
        print_rank_0("Using Local spec for transformer layers")
        layer_spec = bert_layer_specs.get_bert_layer_local_spec()
    else:
        layer_spec = import_module(args.spec)
    return BertModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, num_tokentypes=2 if args.bert_binary_head else 0,
        add_binary_head=args.bert_binary_head,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights, parallel_output=True,
        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def get_batch(data_iterator):
    """(tokens, types, sentence_order, loss_mask, lm_labels, padding_mask), broadcast over TP."""
    data = next(data_iterator) if data_iterator is not None else None
    data_b = tensor_parallel.broadcast_data(BATCH_KEYS, data, torch.int64)
    return (data_b["text"].long(), data_b["types"].long(), data_b["is_random"].long(), data_b["loss_mask"].float(),
            data_b["labels"].long(), data_b["padding_mask"].long())


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-token mean LM loss (+ sentence-order cross entropy with the binary head)."""
    lm_loss_, sop_logits = output_tensor
    loss_mask = loss_mask.float()
    lm_loss = torch.sum(lm_loss_.float().view(-1) * loss_mask.reshape(-1)) / loss_mask.sum()  # [b, s] -> [b*s]
    if sop_logits is None:
        averaged = average_losses_across_data_parallel_group([lm_loss])
        return lm_loss, {"lm loss": averaged[0]}
    sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    averaged = average_losses_across_data_parallel_group([lm_loss, sop_loss])
    return lm_loss + sop_loss, {"lm loss": averaged[0], "sop loss": averaged[1]}


def forward_step(data_iterator, model: BertModel):
    """Run the model on the next batch; return its outputs and the loss function to apply."""
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def core_bert_dataset_config_from_args(args) -> BERTMaskedWordPieceDatasetConfig:
    """`BERTMaskedWordPieceDatasetConfig` from the data flags (Megatron's fixed masking settings)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob, masking_max_ngram=3, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Train/valid/test BERT datasets, read on TP rank 0 of every pipeline stage (all stages need the mask)."""
    config = core_bert_dataset_config_from_args(get_args())
    print_rank_0("> building train, validation, and test datasets for BERT ...")
    datasets = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, train_val_test_num_samples,
        lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()
    print_rank_0("> finished creating BERT datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "BertWordPieceLowerCase"})
    shutdown_distributed()
