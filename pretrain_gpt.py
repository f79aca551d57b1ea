"""Pretrain a GPT model: Megatron's hooks (model_provider, get_batch, loss_func, forward_step, datasets) + pretrain."""
from functools import partial
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.spec_utils import import_module
from megatron.core.utils import StragglerDetector, get_attr_wrapped_model
from megatron.training.initialize import shutdown_distributed
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import (
    get_blend_and_blend_per_split,
    get_gpt_batch_with_documents,
    is_first_or_last_pipeline_stage,
)

# A loss 10x larger than the largest seen so far counts as a spike (checked with --check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10

stimer = StragglerDetector()  # times get_batch and the forward (--log-straggler)


def model_provider(pre_process=True, post_process=True, vp_stage: Optional[int] = None) -> GPTModel:
    """Build the GPT model of this pipeline stage (layer spec from --spec, --heterogeneous-layers-config-path, the
    MoE block spec with --num-experts, else --transformer-impl)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.spec is not None:
        layer_spec = import_module(args.spec)
    elif args.heterogeneous_layers_config_path is not None:
        layer_spec = get_gpt_heterogeneous_layer_spec(config, use_te, vp_stage=vp_stage)
    elif args.num_experts:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                                qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif use_te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            moe_use_legacy_grouped_gemm=args.moe_use_legacy_grouped_gemm, qk_l2_norm=args.qk_l2_norm)
    else:
        layer_spec = get_gpt_layer_local_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            moe_use_legacy_grouped_gemm=args.moe_use_legacy_grouped_gemm, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        mtp_block_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
        mtp_block_spec=mtp_block_spec,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of this TP/CP rank; Nones on middle stages."""
    return get_gpt_batch_with_documents(data_iterator, vp_stage)[:5]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: Optional[GPTModel] = None):
    """Masked loss SUM and token count; the schedule divides by tokens and microbatches (§ loss chain)."""
    args = get_args()
    losses = output_tensor.view(-1).float()  # [b, s] -> [b*s]
    loss_mask = loss_mask.view(-1).float()  # [b, s] -> [b*s]
    loss = torch.sum(losses * loss_mask)
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine.validate_result(result=loss, rejection_func=torch.isnan,
                                            message="found NaN in local forward loss calculation", fatal=True)
        rerun_state_machine.validate_result(result=loss, rejection_func=torch.isinf,
                                            message="found Inf in local forward loss calculation", fatal=True)
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(rerun_state_machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"),
            message="Spiky loss", fatal=False)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])  # 2 x [] -> [2]
    return loss, num_tokens, {"lm loss": reporting_loss}


def forward_step(data_iterator, model: GPTModel):
    """Run the model on the next batch; return the per-token loss and the loss function to apply to it."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_gpt_batch_with_documents(
            data_iterator, vp_stage)
    timers("batch-generator").stop()
    with stimer:
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                              packed_seq_params=packed_seq_params)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None):
    """Datasets are read on TP rank 0 of the first and last pipeline stages (of every stage with
    --reset-attention-mask: all attention layers need the documents)."""
    stage = is_first_or_last_pipeline_stage(vp_stage) or get_args().reset_attention_mask
    return stage and parallel_state.get_tensor_model_parallel_rank() == 0


def core_gpt_dataset_config_from_args(args):
    """`GPTDatasetConfig` from the data flags."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,  # documents travel as ids: no dense mask needed
        create_attention_mask=args.create_attention_mask_in_dataloader and not args.reset_attention_mask,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train/valid/test GPT datasets (MockGPTDataset with --mock-data, SFTDataset with --sft)."""
    args = get_args()
    config = core_gpt_dataset_config_from_args(args)
    if args.sft:
        from megatron.training.datasets.sft_dataset import SFTDataset

        dataset_type = SFTDataset
    else:
        dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    shutdown_distributed()
