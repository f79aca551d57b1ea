"""validate_args: one error listing every problem, the exit helper, derived values and args_defaults."""
import pytest
import torch

from megatron.training.arguments import (
    ArgumentsError,
    _parse,
    _print_args,
    exit_on_arguments_error,
    validate_args,
)
from megatron.training.arguments.validate import _validate_communication

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
        "--seq-length 32 --micro-batch-size 2 --train-iters 10").split()


def _args(extra="", world_size=1, rank=1):
    args = _parse(BASE + extra.split())
    args.world_size, args.rank = world_size, rank
    return args


def _problems(extra="", world_size=1, defaults=None):
    with pytest.raises(ArgumentsError) as err:
        validate_args(_args(extra, world_size), defaults)
    return err.value.problems


def test_multi_problem_command_line_raises_once_listing_everything():
    args = _parse(BASE + "--num-attention-heads 12 --tensor-model-parallel-size 8 --kv-channels 8 --save /tmp/ck "
                  "--num-layer 3 --retro-add-retriever --use-custom-fsdp --ckpt-format zarr".split())
    args.world_size, args.rank = 8, 1
    with pytest.raises(ArgumentsError) as err:
        validate_args(args)
    problems, text = err.value.problems, str(err.value)
    assert len(problems) == 6, text
    expected = [
        "--num-attention-heads (12) must be divisible by --tensor-model-parallel-size (8): choose a TP size that "
        "divides 12.",
        "--save (/tmp/ck) needs --save-interval",
        "unrecognized argument --num-layer 3: did you mean --num-layers?",
        "--retro-add-retriever is a Megatron-LM flag this framework does not implement yet",
        "--use-custom-fsdp is a Megatron-LM flag this framework does not implement yet: Megatron FSDP is not "
        "implemented; use --use-torch-fsdp2 instead.",
        "--ckpt-format zarr:",
    ]
    for piece in expected:
        assert piece in text, piece
    assert text.count("\n") == len(problems) and isinstance(err.value, ValueError)
    assert not hasattr(args, "_unknown_args")


def test_exit_helper_prints_every_problem_and_exits_2(capsys):
    err = ArgumentsError(["--a (1) is wrong: fix it.", "--b (2) is wrong: fix it too."])
    with pytest.raises(SystemExit) as exit_info:
        exit_on_arguments_error(err, prog="pretrain_gpt.py")
    assert exit_info.value.code == 2
    out, stderr = capsys.readouterr()
    assert out == "" and "Traceback" not in stderr
    assert stderr.splitlines() == [
        "pretrain_gpt.py: error: invalid command line (2 problems):",
        "  - --a (1) is wrong: fix it.",
        "  - --b (2) is wrong: fix it too.",
    ]


def test_derived_values_and_args_defaults(capsys):
    args = validate_args(_args("--swiglu --bf16 --tensor-model-parallel-size 2 --recompute-activations "
                               "--disable-bias-linear --tokenizer-type NullTokenizer", world_size=8),
                         {"tokenizer_type": "GPT2BPETokenizer", "num_layers": 99, "vocab_size": 128})
    assert args.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64 == 128
    assert args.kv_channels == 16 and args.data_parallel_size == 4 and args.global_batch_size == 8
    assert args.params_dtype is torch.bfloat16 and args.accumulate_allreduce_grads_in_fp32 is True
    assert args.recompute_granularity == "selective" and args.apply_rope_fusion is False
    assert args.bias_gelu_fusion is False and args.add_qkv_bias is False
    assert args.tokenizer_type == "NullTokenizer" and args.num_layers == 4 and args.vocab_size == 128
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.skipped_train_samples) == (0, 0, 0)
    assert args.virtual_pipeline_model_parallel_size is None and args.overlap_p2p_comm is False
    assert args.encoder_seq_length == 32 and args.dataloader_type == "single" and args.use_dist_ckpt is True

    args = validate_args(_args("--fp16 --position-embedding-type rope --global-batch-size 16 "
                               "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
                               "--data-path prefix", world_size=4))
    assert args.ffn_hidden_size == 256 and args.params_dtype is torch.half and args.sequence_parallel is False
    assert args.check_for_nan_in_loss_and_grad is False and args.apply_rope_fusion is True
    assert args.virtual_pipeline_model_parallel_size == 2 and args.microbatch_group_size_per_vp_stage == 2
    assert args.add_qkv_bias is True and args.split == "969, 30, 1" and args.main_grads_dtype is torch.float32
    assert args.data_parallel_size == 2 and args.global_batch_size == 16
    assert validate_args(_args("--group-query-attention --num-query-groups 2 --use-rotary-position-embeddings "
                               "--rotary-interleaved")).position_embedding_type == "rope"
    assert capsys.readouterr().out == ""  # rank 1 prints nothing

    first = vars(validate_args(_args("--bf16 --swiglu --recompute-activations --data-path p", world_size=2))).copy()
    again = validate_args(_args("--bf16 --swiglu --recompute-activations --data-path p", world_size=2))
    assert vars(validate_args(again)) == first  # validating a validated namespace changes nothing


@pytest.mark.parametrize("extra, world_size, pieces", [
    ("--tensor-model-parallel-size 3", 4, ["= 3 must divide the world size (4)"]),
    ("--global-batch-size 6", 4,
     ["--global-batch-size (6) must be divisible by --micro-batch-size (2) x data-parallel"]),
    ("--pipeline-model-parallel-size 3", 3, ["--num-layers (4, 4 counting embedding/loss) must be divisible by "
                                             "--pipeline-model-parallel-size (3)"]),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication", 2,
     ["needs --pipeline-model-parallel-size (2) > 2"]),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 5 "
     "--overlap-p2p-communication-warmup-flush", 2, ["does not match", "needs an interleaved pipeline"]),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|t*3|t", 2, ["layout"]),
    ("--overlap-param-gather --fp16 --bf16 --fp16-lm-cross-entropy", 1,
     ["--overlap-param-gather needs --use-distributed-optimizer", "--fp16 and --bf16 are exclusive"]),
    ("--train-samples 100 --lr-warmup-fraction 0.1 --lr-warmup-iters 3 --lr 1e-4 --min-lr 1e-3", 1,
     ["--train-iters (10) and --train-samples (100) are exclusive", "--lr-warmup-iters (3) is for iteration-based",
      "--lr-warmup-fraction (0.1) cannot be combined", "--min-lr (0.001) must not exceed --lr (0.0001)"]),
    ("--mock-data --data-path x --swiglu --squared-relu --hidden-size 16 --num-attention-heads 3", 1,
     ["choose one data source", "--swiglu and --squared-relu are exclusive", "gives an FFN size of 0",
      "--hidden-size (16) must be divisible by --num-attention-heads (3)"]),
    ("--use-torch-fsdp2 --use-distributed-optimizer --recompute-granularity full --seq-length 128", 1,
     ["FSDP2 already shards", "--untie-embeddings-and-output-weights", "needs --recompute-method",
      "--max-position-embeddings (64) must be >= --seq-length (128)"]),
    ("--ckpt-format torch_dcp --save ck --save-interval 5 --tensor-model-parallel-size 2 "
     "--use-distributed-optimizer", 2,
     ["--ckpt-format torch_dcp with --save cannot store this run: --tensor-model-parallel-size is 2",
      "cannot store this run: --use-distributed-optimizer: its optimizer state lives outside"]),
    ("--multi-latent-attention --rotary-interleaved --group-query-attention --num-query-groups 2 "
     "--qk-pos-emb-head-dim 5 --mtp-num-layers 1 --position-embedding-type learned_absolute", 1,
     ["--rotary-interleaved cannot be combined with --multi-latent-attention",
      "--group-query-attention cannot be combined with --multi-latent-attention",
      "--qk-pos-emb-head-dim (5) must be even", "--mtp-num-layers needs --position-embedding-type rope or none"]),
    ("--batch-size 4 --warmup 10 --retro-project-dir x --yaml-cfg x.yaml --ddp-num-buckets 2 --ddp-bucket-size 10", 2,
     ["--batch-size (4) was removed from Megatron-LM; use --micro-batch-size", "--warmup (10) was removed",
      "--retro-project-dir (x) is a Megatron-LM flag this framework does not implement yet",
      "--yaml-cfg x.yaml: cannot read the file",
      "--ddp-num-buckets (2) and --ddp-bucket-size (10) are exclusive"]),
])
def test_validation_rules(extra, world_size, pieces):
    text = "\n".join(_problems(extra, world_size))
    for piece in pieces:
        assert piece in text, f"{piece!r} not in:\n{text}"


def test_required_flags_and_accepted_flags():
    args = _parse([])
    with pytest.raises(ArgumentsError) as err:
        validate_args(args)
    text = str(err.value)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--max-position-embeddings",
                 "--micro-batch-size", "--seq-length"):
        assert f"{flag} is required" in text
    accepted = ("--no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
                "--no-bias-dropout-fusion --use-flash-attn --transformer-impl local --attention-backend local "
                "--tp-comm-overlap-rs-dgrad --no-one-logger --log-straggler --rotary-interleaved --position-embedding-type rope")
    assert validate_args(_args(accepted)).transformer_impl == "local"


def test_cuda_device_max_connections_rule(monkeypatch):
    args = _args("--tensor-model-parallel-size 2", world_size=2)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    problems = _validate_communication(args, lambda: (9, 0))
    assert len(problems) == 1 and "CUDA_DEVICE_MAX_CONNECTIONS=1" in problems[0] and "9.0" in problems[0]
    assert _validate_communication(args, lambda: (10, 0)) == []
    assert _validate_communication(args, lambda: None) == []
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert _validate_communication(args, lambda: (8, 0)) == []


def test_print_args_format(capsys):
    args = _parse(["--num-layers", "2"])
    args.rank, args.Zeta, args.alpha = 0, 1, "x"
    _print_args("arguments", args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    # 501 Megatron flags, the 4 of the optimisation plan, plus rank, Zeta and alpha; the private _unknown_args
    # is not printed.
    assert body == sorted(body, key=str.lower) and len(body) == 501 + 4 + 3
    assert "  num_layers " + "." * (48 - len("num_layers")) + " 2" in body
    assert "  alpha " + "." * 43 + " x" in body and not any("_unknown_args" in line for line in body)
    args.rank = 3
    _print_args("arguments", args)
    assert capsys.readouterr().out == ""


def test_cuda_graph_rules_name_each_conflicting_flag():
    problems = _problems("--enable-cuda-graph --pipeline-model-parallel-size 2 --recompute-activations "
                         "--cuda-graph-scope attn --cuda-graph-warmup-steps 0", world_size=2)
    text = "\n".join(problems)
    for piece in ("--enable-cuda-graph: --pipeline-model-parallel-size (2) > 1",
                  "--enable-cuda-graph: --hidden-dropout (0.1) and --attention-dropout (0.1) must be 0",
                  "--enable-cuda-graph: activation recompute", "--cuda-graph-scope attn is not supported",
                  "--cuda-graph-warmup-steps (0) must be at least 1"):
        assert piece in text, (piece, text)
    assert "external" in " ".join(_problems("--external-cuda-graph"))
    validate_args(_args("--enable-cuda-graph --hidden-dropout 0 --attention-dropout 0"))


def test_cuda_graph_with_moe_names_the_moe_flag_it_cannot_follow():
    moe = ("--enable-cuda-graph --hidden-dropout 0 --attention-dropout 0 --num-experts 4 --moe-router-topk 2 "
           "--disable-bias-linear ")
    problems = _problems(moe + "--moe-token-dispatcher-type allgather")
    assert len(problems) == 1 and "--num-experts 4" in problems[0] and \
        "--moe-token-dispatcher-type allgather" in problems[0], problems
    validate_args(_args(moe + "--moe-token-dispatcher-type alltoall"))


def test_tp_comm_overlap_needs_sequence_parallel():
    assert any("--tp-comm-overlap overlaps" in p and "--sequence-parallel" in p
               for p in _problems("--tp-comm-overlap --tensor-model-parallel-size 2", world_size=2))
    args = validate_args(_args("--tp-comm-overlap --tensor-model-parallel-size 2 --sequence-parallel", world_size=2))
    assert args.tp_comm_overlap and args.sequence_parallel
