"""Pretrain a Mamba / hybrid model: Megatron's `pretrain_mamba.py` hooks (batch, loss and datasets as GPT's)."""
from functools import partial
from typing import Optional

from megatron.core.enums import ModelType
from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.spec_utils import import_module
from megatron.core.utils import StragglerDetector, get_attr_wrapped_model
from megatron.training.initialize import shutdown_distributed
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_gpt_batch_with_documents
from pretrain_gpt import get_batch, loss_func, train_valid_test_datasets_provider

stimer = StragglerDetector()  # times get_batch and the forward (--log-straggler)


def model_provider(pre_process=True, post_process=True, vp_stage: Optional[int] = None) -> MambaModel:
    """Build the Mamba / hybrid model of this pipeline stage from `--spec` (required, as in Megatron)."""
    args = get_args()
    print_rank_0("building Mamba model ...")
    if args.spec is None:
        raise ValueError("pretrain_mamba.py needs --spec: pass --spec megatron.core.models.mamba.mamba_layer_specs "
                         "mamba_stack_spec.")
    config = core_transformer_config_from_args(args)
    stack_spec = import_module(args.spec)
    return MambaModel(
        config=config, mamba_stack_spec=stack_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        hybrid_attention_ratio=args.hybrid_attention_ratio, hybrid_mlp_ratio=args.hybrid_mlp_ratio,
        hybrid_override_pattern=args.hybrid_override_pattern, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base)


def forward_step(data_iterator, model: MambaModel):
    """Run the model on the next batch; return the per-token loss and the loss function to apply to it."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        tokens, labels, loss_mask, attention_mask, position_ids = get_gpt_batch_with_documents(
            data_iterator, vp_stage)[:5]
    timers("batch-generator").stop()
    with stimer:
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask, model=model)


__all__ = ["model_provider", "forward_step", "get_batch", "loss_func", "train_valid_test_datasets_provider"]

if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    shutdown_distributed()
