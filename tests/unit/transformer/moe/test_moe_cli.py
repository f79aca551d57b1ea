"""The MoE command line: Megatron's rules reported with the flags' names, and the flags reaching the config."""
import pytest

from megatron.training.arguments import ArgumentsError, _parse, validate_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --disable-bias-linear --transformer-impl local").split()


def _args(extra, world_size=1):
    args = _parse(BASE + extra.split())
    args.world_size, args.rank = world_size, 1
    return args


def _problems(extra, world_size=1):
    with pytest.raises(ArgumentsError) as err:
        validate_args(_args(extra, world_size))
    return err.value.problems


def test_moe_rules_name_the_flags_and_are_reported_together():
    problems = _problems("--num-experts 6 --expert-model-parallel-size 4 --moe-router-topk 1 "
                         "--moe-router-enable-expert-bias --moe-pad-expert-input-to-capacity "
                         "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-overlap "
                         "--tensor-model-parallel-size 2 --moe-layer-freq [1,0,1]", world_size=4)
    text = "\n".join(problems)
    for piece in (
        "--num-experts (6) must be divisible by --expert-model-parallel-size (4)",
        "--moe-router-topk = 1 with the softmax score function needs --moe-router-pre-softmax",
        "--moe-router-enable-expert-bias (aux-loss-free balancing) needs --moe-router-score-function 'sigmoid'",
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
        "--moe-shared-expert-overlap works only with the alltoall token dispatcher",
        "--num-experts with --tensor-model-parallel-size (2) > 1 needs --sequence-parallel",
        "--moe-layer-freq has 3 entries but --num-layers is 4",
        "--expert-tensor-parallel-size (2) x --expert-model-parallel-size (4) x --pipeline-model-parallel-size (1) "
        "= 8 must divide the world size (4)",
    ):
        assert piece in text, (piece, text)


def test_rejected_and_accepted_moe_flags():
    problems = "\n".join(_problems("--num-experts 4 --moe-token-dispatcher-type flex --moe-enable-deepep "
                                   "--moe-use-upcycling --moe-extended-tp"))
    assert "--moe-token-dispatcher-type flex: the flex dispatcher (DeepEP) is not wired here" in problems
    assert "--moe-enable-deepep is a Megatron-LM flag this framework does not implement yet" in problems
    assert "--moe-extended-tp is a Megatron-LM flag" in problems and "--expert-tensor-parallel-size instead" in problems
    args = validate_args(_args("--num-experts 4 --moe-permute-fusion --moe-per-layer-logging"))
    assert args.moe_permute_fusion and args.moe_ffn_hidden_size == args.ffn_hidden_size


def test_moe_flags_reach_the_transformer_config():
    from megatron.training.arguments import core_transformer_config_from_args

    args = validate_args(_args("--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 1e-3 "
                               "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                               "--moe-router-bias-update-rate 0.01 --moe-grouped-gemm --moe-layer-freq 2 "
                               "--moe-ffn-hidden-size 48 --moe-expert-capacity-factor -1 --moe-layer-recompute "
                               "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall", world_size=2))
    with pytest.warns(UserWarning, match="moe_layer_recompute is deprecated"):
        config = core_transformer_config_from_args(args)
    assert config.num_moe_experts == 8 and config.moe_router_topk == 2 and config.moe_grouped_gemm
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_bias_update_rate == 0.01 and config.moe_ffn_hidden_size == 48
    assert config.moe_layer_freq == 2 and config.expert_model_parallel_size == 2
    assert config.moe_expert_capacity_factor is None  # negative: dropless
    assert config.recompute_granularity == "selective" and "moe" in config.recompute_modules


def test_legacy_save_with_expert_tp_other_than_tp_is_refused():
    problems = "\n".join(_problems("--num-experts 4 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 "
                                   "--ckpt-format torch --save /tmp/unused", world_size=4))
    assert "--ckpt-format torch with --expert-tensor-parallel-size (2) != --tensor-model-parallel-size (1)" in problems
    validate_args(_args("--num-experts 4 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 "
                        "--ckpt-format torch_dist --save /tmp/unused --save-interval 5", world_size=4))
