"""`pretrain_gpt.py` with the CPU-offloaded optimizer and with a heterogeneous (per-layer) model, on CPU.

- Command lines as users run them (subprocesses): `torchrun --nproc-per-node 2` with `--use-distributed-optimizer
  --use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5` (bf16, DP=2), and a
  model from `--heterogeneous-layers-config-path`; both must train (the loss falls), the heterogeneous one with
  the parameter count its config.json gives.
- In this process (world size 1): with clipping off, the offloaded run logs the losses of the run without
  offload bit for bit; it resumes bit for bit from its torch_dist and its legacy (torch) checkpoints, and from a
  torch_dist checkpoint written without offload.
"""
import json

import pytest
import torch.distributed as dist

from tests.functional.cli import reset_training_state, run_pretrain, run_pretrain_in_process
from tests.unit.training.test_arguments_offload_heterogeneous import LLAMA, hf_config

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 4095 --log-interval 10 --eval-iters 0 --seed 7 --bf16 --use-distributed-optimizer").split()
OFFLOAD = "--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5".split()
PER_ITER = 2


@pytest.fixture(scope="module", autouse=True)
def _destroy_process_group_at_end():
    yield
    reset_training_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _losses(result, iterations):
    assert result.returncode == 0, result.output[-4000:]
    assert not result.unmatched_log_lines, result.unmatched_log_lines
    assert [int(x["iteration"]) for x in result.iterations] == iterations
    return [x["loss_values"]["lm loss"] for x in result.iterations]


def test_offload_command_line_trains_dp2():
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
             "--micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 2e-3 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 4095 --log-interval 10 --eval-iters 0 --bf16 "
             "--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload "
             "--optimizer-offload-fraction 0.5 --overlap-cpu-optimizer-d2h-h2d").split()
    losses = _losses(run_pretrain(flags, nproc=2), [10, 20])
    assert losses[-1] < losses[0] - 0.05, losses


def _parameter_count(hidden=64, vocab=4096, heads=4, groups=2):
    """Embedding + untied output layer + final norm + the blocks of hf_config(): a GQA attention with a
    SwiGLU MLP of ffn_mult 1.0 (256), then a no-op attention with an MLP replaced by one linear."""
    head_dim = hidden // heads
    attention = hidden + (heads + 2 * groups) * head_dim * hidden + hidden * hidden
    mlp = hidden + 2 * 256 * hidden + 256 * hidden
    linear = hidden + hidden * hidden
    return 2 * vocab * hidden + hidden + attention + mlp + linear


def test_heterogeneous_command_line_trains(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config()))
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
             "--micro-batch-size 4 --train-iters 20 --lr 3e-3 --mock-data --tokenizer-type NullTokenizer "
             "--vocab-size 4095 --log-interval 10 --eval-iters 0").split()
    result = run_pretrain(flags + LLAMA.split() + ["--heterogeneous-layers-config-path", str(path)])
    losses = _losses(result, [10, 20])
    assert losses[-1] < losses[0] - 0.05, losses
    expected = f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {_parameter_count()}"
    assert expected in result.output, [line for line in result.output.splitlines() if "number of parameters" in line]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four iterations without clipping, saving at 2 and 4: {kind: (save dir, per-microbatch losses)}."""
    runs = {}
    for kind, extra in (("plain", []), ("offload", OFFLOAD), ("offload-torch", OFFLOAD + ["--ckpt-format", "torch"])):
        save = str(tmp_path_factory.mktemp(kind) / "ckpt")
        code, losses = run_pretrain_in_process([*TINY, *extra, "--clip-grad", "0", "--train-iters", "4", "--save",
                                                save, "--save-interval", "2"])
        assert code is None and len(losses) == 4 * PER_ITER
        runs[kind] = (save, losses)
    return runs


def test_offload_equals_plain_and_resumes_bit_for_bit(uninterrupted):
    assert uninterrupted["offload"][1] == uninterrupted["plain"][1]
    assert uninterrupted["offload-torch"][1] == uninterrupted["plain"][1]
    for kind, extra in (("offload", OFFLOAD), ("offload-torch", OFFLOAD + ["--ckpt-format", "torch"]),
                        ("plain", OFFLOAD)):
        save, full = uninterrupted[kind]
        code, resumed = run_pretrain_in_process([*TINY, *extra, "--clip-grad", "0", "--train-iters", "4", "--load",
                                                 save, "--ckpt-step", "2"])
        assert code is None and resumed == full[2 * PER_ITER:], f"resume of the {kind} checkpoint with offload"


def test_heterogeneous_torch_dist_checkpoint_resumes_bit_for_bit(tmp_path):
    from megatron.core import dist_checkpointing

    path, save = tmp_path / "config.json", str(tmp_path / "ckpt")
    path.write_text(json.dumps(hf_config(num_hidden_layers=2, hidden_size=32)))
    flags = [*TINY[:-2], *LLAMA.split(), "--heterogeneous-layers-config-path", str(path), "--train-iters", "4"]
    code, full = run_pretrain_in_process([*flags, "--save", save, "--save-interval", "2"])
    assert code is None and len(full) == 4 * PER_ITER
    stored = dist_checkpointing.load_sharded_metadata(f"{save}/iter_0000002")
    assert stored["decoder.layers.1.mlp.weight"].global_shape == (32, 32)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in stored
    common = dist_checkpointing.load_common_state_dict(f"{save}/iter_0000002")
    assert json.loads(vars(common["args"])["heterogeneous_layers_config_encoded_json"])["block_configs"]
    code, resumed = run_pretrain_in_process([*flags, "--load", save, "--ckpt-step", "2"])
    assert code is None and resumed == full[2 * PER_ITER:]
