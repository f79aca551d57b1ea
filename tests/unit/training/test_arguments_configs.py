"""to_configs: every config field is mapped from args or listed as runtime-only; the mapping's values."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.training.arguments import _parse, validate_args
from megatron.training.arguments import to_configs
from megatron.training.arguments.derive import derived_ffn_hidden_size
from megatron.training.arguments.parser import megatron_actions

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
        "--seq-length 32 --micro-batch-size 2 --train-iters 10").split()


def _validated(extra="", world_size=1):
    args = _parse(BASE + extra.split())
    args.world_size, args.rank = world_size, 1
    return validate_args(args)


def _argument_names():
    """Names an args namespace holds after parse + validate (flags and derived values)."""
    return {a.dest for a in megatron_actions()} | set(vars(_validated()))


@pytest.mark.parametrize("module, cls, renames, runtime_only", [
    ("megatron.core.transformer.transformer_config", "TransformerConfig", "TRANSFORMER_RENAMES",
     "TRANSFORMER_RUNTIME_ONLY"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig", "OPTIMIZER_RENAMES", "OPTIMIZER_RUNTIME_ONLY"),
    ("megatron.core.distributed.distributed_data_parallel_config", "DistributedDataParallelConfig", "DDP_RENAMES",
     "DDP_RUNTIME_ONLY"),
])
def test_every_config_field_is_mapped_or_runtime_only(module, cls, renames, runtime_only):
    config_class = getattr(pytest.importorskip(module), cls)
    renames, runtime_only = getattr(to_configs, renames), getattr(to_configs, runtime_only)
    fields = {f.name for f in dataclasses.fields(config_class)}
    names = _argument_names()
    unmapped = sorted(f for f in fields if f not in names and f not in renames and f not in runtime_only)
    assert not unmapped, f"{cls} fields neither mapped from args nor listed as runtime-only: {unmapped}"
    stale = sorted((set(renames) | set(runtime_only)) - fields)
    assert not stale, f"{cls} tables name fields the class does not have: {stale}"
    assert all(reason for reason in runtime_only.values())


def test_transformer_config_mapping():
    pytest.importorskip("megatron.core.transformer.transformer_config")
    args = _validated("--swiglu --bf16 --group-query-attention --num-query-groups 2 --norm-epsilon 1e-6 "
                      "--apply-layernorm-1p --normalization RMSNorm --tensor-model-parallel-size 2 "
                      "--sequence-parallel --pipeline-model-parallel-size 2 --position-embedding-type rope "
                      "--no-persist-layer-norm --ffn-hidden-size 96", world_size=4)
    config = to_configs.core_transformer_config_from_args(args)
    assert config.activation_func is F.silu and config.gated_linear_unit and config.bias_activation_fusion
    assert config.num_query_groups == 2 and config.layernorm_epsilon == 1e-6
    assert config.layernorm_zero_centered_gamma and config.normalization == "RMSNorm"
    assert config.params_dtype is torch.bfloat16 and config.pipeline_dtype is torch.bfloat16 and config.bf16
    assert config.deallocate_pipeline_outputs and config.batch_p2p_comm and config.persist_layer_norm is False
    assert config.tensor_model_parallel_size == 2 and config.sequence_parallel and config.ffn_hidden_size == 96
    assert config.kv_channels == 16 and config.num_moe_experts is None and config.hidden_dropout == 0.1

    config = to_configs.core_transformer_config_from_args(_validated("--num-query-groups 2 --squared-relu"))
    assert config.num_query_groups == 4  # without --group-query-attention the flag is ignored (becomes heads)
    assert config.activation_func.__name__ == "squared_relu" and not config.bias_activation_fusion
    x = torch.tensor([-1.0, 0.5, 2.0])
    assert torch.allclose(config.activation_func(x), torch.tensor([0.0, 0.25, 4.0]))
    config = to_configs.core_transformer_config_from_args(
        _validated("--openai-gelu --init-method-xavier-uniform --untie-embeddings-and-output-weights "
                   "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1", world_size=2))
    assert torch.allclose(config.activation_func(x), F.gelu(x, approximate="tanh"), atol=1e-6)
    assert config.init_method is torch.nn.init.xavier_uniform_
    assert config.output_layer_init_method is torch.nn.init.xavier_uniform_
    assert config.num_layers_in_first_pipeline_stage == 1 and config.num_layers_in_last_pipeline_stage is None


def test_optimizer_and_ddp_config_mapping():
    pytest.importorskip("megatron.core.optimizer.optimizer_config")
    pytest.importorskip("megatron.core.distributed.distributed_data_parallel_config")
    args = _validated("--bf16 --lr 3e-4 --min-lr 3e-5 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 0.5 "
                      "--use-distributed-optimizer --overlap-grad-reduce --no-check-for-nan-in-loss-and-grad",
                      world_size=64)
    opt = to_configs.optimizer_config_from_args(args)
    assert (opt.lr, opt.min_lr, opt.weight_decay, opt.adam_beta2, opt.clip_grad) == (3e-4, 3e-5, 0.1, 0.95, 0.5)
    assert opt.bf16 and opt.params_dtype is torch.bfloat16 and opt.use_distributed_optimizer
    ddp = to_configs.ddp_config_from_args(args)
    assert ddp.grad_reduce_in_fp32 and not ddp.check_for_nan_in_grad and ddp.overlap_grad_reduce
    assert ddp.use_distributed_optimizer and ddp.bucket_size == max(40_000_000, 1_000_000 * 64)
    assert to_configs.ddp_bucket_size(args, data_parallel_size=2) == 40_000_000
    args.ddp_num_buckets = 4
    assert to_configs.ddp_config_from_args(args, num_parameters=1000).bucket_size == 250
    with pytest.raises(ValueError, match="--ddp-num-buckets"):
        to_configs.ddp_bucket_size(args)
    args = _validated("--ddp-bucket-size 1234 --grad-reduce-in-bf16 --bf16")
    assert to_configs.ddp_config_from_args(args).bucket_size is None  # one bucket without --overlap-grad-reduce
    assert to_configs.ddp_config_from_args(args).grad_reduce_in_fp32 is False
    assert derived_ffn_hidden_size(args) == 256
