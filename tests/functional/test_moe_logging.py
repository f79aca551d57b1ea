"""MoE loss logging through `pretrain` (Megatron 0.13.1's `track_moe_metrics` call in the training log): with a
TensorBoard writer, `load_balancing_loss` and `z_loss` join the log line and the scalars (mean over MoE layers of
the per-layer values, each the mean over the iteration's microbatches), and `--moe-per-layer-logging` writes
`moe/<name>_layer_<i>`. The reference recomputes every layer's switch aux loss and z-loss in the test from the
router inputs captured during training, with the formulas written here. One in-process run, a few seconds."""
import re

import pytest
import torch

from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

EXPERTS, TOPK, LAYERS, MICROBATCHES, ITERATIONS = 4, 2, 2, 2, 2
FLAGS = (
    f"--num-layers {LAYERS} --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    f"--micro-batch-size 2 --global-batch-size {2 * MICROBATCHES} --mock-data --tokenizer-type NullTokenizer "
    f"--vocab-size 4095 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --seed 11 "
    f"--lr 1e-3 --train-iters {ITERATIONS} --transformer-impl local --disable-bias-linear --swiglu "
    f"--normalization RMSNorm --position-embedding-type rope --num-experts {EXPERTS} --moe-router-topk {TOPK} "
    "--moe-ffn-hidden-size 48 --ffn-hidden-size 48 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
    "--moe-per-layer-logging --tensorboard-log-interval 1"
).split()
ITERATION_RE = re.compile(r"\] iteration\s+(\d+)/")
VALUE_RE = re.compile(r" (load_balancing_loss|z_loss): ([0-9.E+-]+) \|")


def _reference_losses(logits):
    """(switch aux loss / coeff, z-loss / coeff) of router logits [T, E], as Megatron defines them."""
    tokens = logits.shape[0]
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(logits, TOPK, dim=-1).indices
    tokens_per_expert = torch.zeros(EXPERTS, dtype=logits.dtype).scatter_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=logits.dtype))
    aux = (probs.sum(0) * tokens_per_expert).sum() * EXPERTS / (TOPK * tokens * tokens)
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return aux.item(), z.item()


def _worker(tb_dir):
    import io
    import contextlib

    captured, registered = [], []

    def hook(model):
        if registered:
            return
        for chunk in [model]:
            for name, module in chunk.named_modules():
                if name.endswith("mlp.router"):
                    layer = int(name.split("layers.")[1].split(".")[0])

                    def capture(mod, inputs, layer=layer):
                        if mod.training and torch.is_grad_enabled():
                            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
                            captured.append((layer, x @ mod.weight.detach().double().t()))
                    module.register_forward_pre_hook(capture)
        registered.append(True)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code, _ = run_pretrain_in_process([*FLAGS, "--tensorboard-dir", tb_dir], hook=hook)
    reset_training_state()
    assert code is None
    return out.getvalue(), [(layer, _reference_losses(logits)) for layer, logits in captured]


def _tensorboard_scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_dir)
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_moe_losses_in_log_line_and_tensorboard_per_layer(tmp_path):
    pytest.importorskip("tensorboard")
    output, reference = run_on_ranks(_worker, 1, str(tmp_path))[0]
    assert len(reference) == ITERATIONS * MICROBATCHES * LAYERS
    per_iteration = len(reference) // ITERATIONS
    expected = {}
    for iteration in range(1, ITERATIONS + 1):
        block = reference[(iteration - 1) * per_iteration:iteration * per_iteration]
        layers = {}
        for layer, (aux, z) in block:
            layers.setdefault(layer, []).append((aux, z))
        expected[iteration] = {layer: (sum(a for a, _ in v) / MICROBATCHES, sum(z for _, z in v) / MICROBATCHES)
                               for layer, v in layers.items()}
    lines = {}
    for line in output.splitlines():
        match = ITERATION_RE.search(line)
        if match:
            values = dict((name, float(value)) for name, value in VALUE_RE.findall(line))
            lines[int(match[1])] = (values.get("load_balancing_loss"), values.get("z_loss"))
    assert sorted(lines) == list(range(1, ITERATIONS + 1)), output[-2000:]
    scalars = _tensorboard_scalars(str(tmp_path))
    for iteration, layers in expected.items():
        aux_mean = sum(a for a, _ in layers.values()) / LAYERS
        z_mean = sum(z for _, z in layers.values()) / LAYERS
        assert lines[iteration][0] == pytest.approx(aux_mean, rel=1e-5), (iteration, lines, layers)
        assert lines[iteration][1] == pytest.approx(z_mean, rel=1e-5), (iteration, lines, layers)
        assert scalars["load_balancing_loss"][iteration] == pytest.approx(aux_mean, rel=1e-5)
        assert scalars["z_loss"][iteration] == pytest.approx(z_mean, rel=1e-5)
        for layer, (aux, z) in layers.items():
            assert scalars[f"moe/load_balancing_loss_layer_{layer}"][iteration] == pytest.approx(aux, rel=1e-5)
            assert scalars[f"moe/z_loss_layer_{layer}"][iteration] == pytest.approx(z, rel=1e-5)
