"""--num-distributed-optimizer-instances on the command line: Megatron's rules, checked at validation.

Megatron 0.13.1 asserts these later (DDP: "Partial DistOpt cannot be used without DistOpt";
initialize_model_parallel: the instance count divides DP x CP and the expert DP size); here the same
command lines fail at argument validation, naming the flag. Valid ones reach the DDP config.
"""
import pytest

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.training.arguments import ArgumentsError, _parse, validate_args
from megatron.training.arguments.to_configs import ddp_config_from_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
        "--seq-length 32 --micro-batch-size 2 --train-iters 10").split()


def _validated(extra, world_size):
    args = _parse(BASE + extra.split())
    args.world_size, args.rank = world_size, 1
    return validate_args(args)


def _problems(extra, world_size):
    with pytest.raises(ArgumentsError) as err:
        _validated(extra, world_size)
    return [p for p in err.value.problems if "--num-distributed-optimizer-instances" in p]


def test_valid_instances_reach_the_ddp_config():
    args = _validated("--use-distributed-optimizer --num-distributed-optimizer-instances 2", world_size=4)
    config = ddp_config_from_args(args)
    assert isinstance(config, DistributedDataParallelConfig)
    assert config.num_distributed_optimizer_instances == 2 and config.use_distributed_optimizer
    args = _validated("--use-distributed-optimizer --num-distributed-optimizer-instances 2 "
                      "--tensor-model-parallel-size 2", world_size=8)
    assert args.data_parallel_size == 4


def test_invalid_instances_fail_naming_the_flag():
    assert _problems("--num-distributed-optimizer-instances 0", 4) == [
        "--num-distributed-optimizer-instances (0) must be at least 1."]
    (problem,) = _problems("--num-distributed-optimizer-instances 2", 4)
    assert "needs --use-distributed-optimizer" in problem
    problems = _problems("--use-distributed-optimizer --num-distributed-optimizer-instances 3", 4)
    assert "must divide the data-parallel x context-parallel size (4, world size 4)" in problems[0]
    # DP x CP = 8 is divisible by 8, the expert DP size 8 / EP 2 = 4 is not.
    (problem,) = _problems("--use-distributed-optimizer --num-distributed-optimizer-instances 8 "
                           "--num-experts 4 --expert-model-parallel-size 2", 8)
    assert "must divide the expert data-parallel size (4 = world 8 / (expert TP x EP x PP))" in problem
