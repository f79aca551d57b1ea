"""`tensor_parallel.random`: the RNG tracker and CheckpointWithoutOutput, single process.

Megatron semantics checked here (0.13.1 `megatron/core/tensor_parallel/random.py`):
- `CudaRNGStatesTracker.add(name, seed)` raises when the seed is taken ("seed N already exists") or the
  name is taken ("cuda rng state NAME already exists"); the seed is recorded before the name is checked.
  `get_states()` is a new dict holding the tracker's own state objects, `set_states(d)` adopts d itself
  without checking it, `reset()` forgets everything, `fork(name)` runs with that stream, stores where it
  ended and restores the outer stream; unknown names raise ("... is not added"). Nested forks continue
  each stream where it was.
- `model_parallel_cuda_manual_seed(seed)` seeds the default device generator with `seed` and registers
  'data-parallel-rng' = seed, 'model-parallel-rng' = seed + 2718 + tp_rank, 'expert-parallel-rng' =
  seed + 1024 + 100 * ep_rank + expert_tp_rank. The global tracker is created by the first caller and kept
  (whatever later callers ask for) unless `force_reset`; the inference tracker ignores add/set_states and
  its fork switches nothing.
- `CheckpointWithoutOutput` frees the output's storage and refills it in backward without changing the
  tensor's metadata or version, so consumers that saved the output (or views of it) get the right
  gradients, and the RNG streams are those of the forward.
Without CUDA the tracked generator is the default CPU generator.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-tracked generator")


@pytest.fixture(autouse=True)
def _fresh_tracker():
    initialize_rng_tracker(force_reset=True)
    saved = torch.get_rng_state()
    yield
    torch.set_rng_state(saved)
    initialize_rng_tracker(force_reset=True)


def _stream(seed, n=6):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=generator)


def test_tracker_add_get_set_reset():
    tracker = CudaRNGStatesTracker()
    assert not tracker.is_initialized()
    tracker.set_states({"state1": 1234})  # unchecked, as in Megatron
    assert tracker.get_states()["state1"] == 1234 and tracker.is_initialized()
    tracker.reset()
    assert tracker.get_states() == {} and not tracker.is_initialized()
    tracker.add("state2", 1111)
    with pytest.raises(Exception, match="seed 1111 already exists"):
        tracker.add("state3", 1111)
    with pytest.raises(Exception, match="cuda rng state state2 already exists"):
        tracker.add("state2", 111)
    with pytest.raises(Exception, match="seed 111 already exists"):  # recorded before the name check
        tracker.add("state4", 111)
    assert set(tracker.get_states()) == {"state2"}
    torch.manual_seed(1111)
    assert torch.equal(tracker.get_states()["state2"], torch.get_rng_state())
    states = tracker.get_states()
    assert states is not tracker.states_ and states["state2"] is tracker.states_["state2"]
    adopted = {"state2": states["state2"]}
    tracker.set_states(adopted)
    assert tracker.states_ is adopted
    with tracker.fork("state2"):
        torch.rand(3)
    assert adopted["state2"] is not states["state2"], "fork stores the advanced state into the adopted dict"
    with pytest.raises(Exception, match="cuda rng state nope is not added"):
        with tracker.fork("nope"):
            pass


def test_fork_streams_restore_and_nest():
    tracker = CudaRNGStatesTracker()
    tracker.add("state1", 1234)
    tracker.add("state2", 5678)
    torch.manual_seed(42)
    before = torch.get_rng_state()
    with tracker.fork("state1"):
        a = torch.rand(2)
        with tracker.fork("state2"):
            b = torch.rand(2)
            with tracker.fork("state1"):
                c = torch.rand(2)
            d = torch.rand(2)
        e = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before), "the default stream is restored"
    assert torch.equal(torch.cat([a, c, e]), _stream(1234)), "state1 continues where it was in the nested fork"
    assert torch.equal(torch.cat([b, d]), _stream(5678, 4))
    with tracker.fork("state1"):
        assert torch.equal(torch.rand(2), _stream(1234, 8)[6:])
    outer, inner = tracker.fork("state1"), tracker.fork("state2")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="is not the same as the desired state name state1"):
        outer.__exit__(None, None, None)


def test_model_parallel_cuda_manual_seed_names_and_seeds():
    parallel_state.set_tensor_model_parallel_rank(3)
    parallel_state.set_expert_model_parallel_rank(1)
    parallel_state.set_expert_tensor_parallel_rank(2)
    model_parallel_cuda_manual_seed(7)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    assert set(states) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    for name, seed in (("data-parallel-rng", 7), ("model-parallel-rng", 7 + 2718 + 3),
                       ("expert-parallel-rng", 7 + 1024 + 100 * 1 + 2)):
        with tracker.fork(name):
            assert torch.equal(torch.rand(6), _stream(seed)), name
    assert torch.equal(torch.rand(6), _stream(7)), "the default generator is seeded with the seed itself"
    model_parallel_cuda_manual_seed(8)  # re-seeding resets the tracker: no duplicate-name error
    assert get_cuda_rng_tracker() is tracker and tracker.seeds_ == {8, 8 + 2718 + 3, 8 + 1024 + 102}


def test_first_caller_decides_the_tracker_kind():
    tracker = get_cuda_rng_tracker()
    assert type(tracker) is CudaRNGStatesTracker
    assert get_cuda_rng_tracker(inference_rng_tracker=True) is tracker, "later callers get the existing tracker"
    model_parallel_cuda_manual_seed(3, inference_rng_tracker=True)
    assert get_cuda_rng_tracker() is tracker and set(tracker.get_states()) == {
        "data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    inference = get_cuda_rng_tracker()
    assert inference is not tracker and inference.is_inference_rng_tracker
    model_parallel_cuda_manual_seed(3)
    inference.set_states({"x": 1})
    assert inference.get_states() == {}, "the inference tracker ignores add and set_states"
    before = torch.get_rng_state()
    with inference.fork("anything"):
        torch.rand(2)
    assert not torch.equal(before, torch.get_rng_state()), "its fork switches no stream"
    initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)
    assert type(get_cuda_rng_tracker()) is CudaRNGStatesTracker, "without Transformer Engine: the native one"


class _ViewSavingLinear(torch.autograd.Function):
    """Saves views (row halves) of its input, like grouped GEMMs do."""

    @staticmethod
    def forward(ctx, inp, weight):
        rows = inp.reshape(-1, inp.shape[-1])  # [s, b, h] -> [s*b, h]
        ctx.save_for_backward(*torch.tensor_split(rows, 2, dim=0), weight)
        ctx.shape = inp.shape
        return (rows @ weight.t()).reshape(*inp.shape[:-1], weight.shape[0])  # [s*b, o] -> [s, b, o]

    @staticmethod
    def backward(ctx, grad):
        *halves, weight = ctx.saved_tensors
        assert all(h.untyped_storage().size() > 0 for h in halves), "saved views point at freed storage"
        rows, grad_rows = torch.cat(halves), grad.reshape(-1, grad.shape[-1])  # [s, b, o] -> [s*b, o]
        return (grad_rows @ weight).reshape(ctx.shape), grad_rows.t() @ rows


CONSUMERS = {
    "mul_saves_output": lambda x, inp, w: x * inp,
    "linear_saves_output": lambda x, inp, w: F.linear(x, w),
    "saves_views_of_output": lambda x, inp, w: _ViewSavingLinear.apply(x, w),
    "result_changed_in_place": lambda x, inp, w: (x * inp).mul_(3.0).add_(1.0),
}


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
def test_checkpoint_without_output_matches_plain_autograd(consumer):
    use = CONSUMERS[consumer]
    model_parallel_cuda_manual_seed(11)
    torch.manual_seed(0)
    inp0, w0 = torch.randn(3, 2, 8), torch.randn(8, 8)

    def function(t):
        with get_cuda_rng_tracker().fork():
            return F.dropout(F.gelu(t), 0.25)

    results = []
    for checkpointed in (False, True):
        model_parallel_cuda_manual_seed(11)
        torch.manual_seed(5)
        inp, w = inp0.clone().requires_grad_(), w0.clone().requires_grad_()
        if checkpointed:
            ckpt = CheckpointWithoutOutput()
            x = ckpt.checkpoint(function, inp)
            y = use(x, inp, w)
            ckpt.discard_output_and_register_recompute(y)
            assert x.untyped_storage().size() == 0, "the output's storage is freed"
        else:
            x = function(inp)
            y = use(x, inp, w)
        after = torch.rand(3)
        version = x._version
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        if checkpointed:
            assert x.untyped_storage().size() > 0 and x._version == version, "refilled without a version bump"
            ckpt._recompute(None)  # a second trigger is a no-op
        results.append((y.detach(), x.detach().clone(), inp.grad, w.grad if w.grad is not None else torch.zeros(1),
                        after, get_cuda_rng_tracker().get_states()["model-parallel-rng"]))
    for got, want in zip(*results):
        assert torch.equal(got, want), consumer
