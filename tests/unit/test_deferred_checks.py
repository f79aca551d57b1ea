"""The deferred NaN/Inf check queue: grouping by predicate, first failure wins, two-iteration lag."""
import pytest
import torch

from megatron.core.deferred_checks import DeferredChecks, not_finite


def _queue():
    queue = DeferredChecks()
    queue.enabled, queue.device_types = True, ("cpu",)
    return queue


def test_flush_raises_the_first_failure_in_queue_order():
    queue = _queue()
    assert queue.should_defer(torch.tensor(1.0)) and not DeferredChecks().should_defer(torch.tensor(1.0))
    queue.add(torch.tensor([1.0, 2.0]), lambda: "norms fine", predicate=not_finite)
    queue.add(torch.tensor(3.0), lambda: "loss fine", predicate=torch.isnan)
    queue.add(torch.tensor([0.0, float("inf"), 1.0]), lambda: "bucket 2 inf", predicate=not_finite)
    queue.add(torch.tensor(float("nan")), lambda: "loss nan", predicate=torch.isnan)
    queue.add(torch.tensor([False, True]), lambda: "flag set")
    with pytest.raises(RuntimeError, match="^bucket 2 inf$"):
        queue.flush()
    assert queue.pending() == 0
    queue.add(torch.tensor([1.0]), lambda: "fine", predicate=torch.isinf)
    queue.flush()
    # Verdicts are evaluated per predicate group; the earliest queued failure still wins across groups.
    queue.add(torch.tensor([1.0]), lambda: "norm fine", predicate=not_finite)
    queue.add(torch.tensor(float("nan")), lambda: "loss nan, queued first", predicate=torch.isnan)
    queue.add(torch.tensor([float("inf")]), lambda: "norm inf, queued later", predicate=not_finite)
    with pytest.raises(RuntimeError, match="^loss nan, queued first$"):
        queue.flush()


def test_step_lags_two_iterations_and_flush_takes_everything():
    queue = _queue()
    queue.step()
    queue.add(torch.tensor(float("nan")), lambda: "iteration 1 nan", predicate=torch.isnan)
    queue.step()  # iteration 2 starts: iteration 1's checks stay queued
    assert queue.pending() == 1
    queue.add(torch.tensor(0.0), lambda: "iteration 2 fine", predicate=torch.isnan)
    with pytest.raises(RuntimeError, match="iteration 1 nan"):
        queue.step()  # iteration 3 starts: iteration 1's checks are read
    assert queue.pending() == 1
    queue.add(torch.tensor(float("inf")), lambda: "iteration 3 inf", predicate=torch.isinf)
    with pytest.raises(RuntimeError, match="iteration 3 inf"):
        queue.flush()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_verdicts_travel_through_pinned_memory_and_an_event():
    queue = DeferredChecks()
    queue.enabled = True
    loss = torch.tensor(float("nan"), device="cuda")
    assert queue.should_defer(loss) and not queue.should_defer(torch.tensor(1.0))
    queue.add(torch.ones(3, device="cuda"), lambda: "fine", predicate=not_finite)
    queue.add(loss, lambda: "cuda nan", predicate=torch.isnan)
    queue.add(torch.zeros(2, device="cuda"), lambda: "flag set")  # a third predicate group
    torch.cuda.set_sync_debug_mode("error")  # launching the evaluation must not wait for the GPU
    try:
        queue.step()  # evaluation launched, nothing read yet
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert queue.pending() == 3
    with pytest.raises(RuntimeError, match="cuda nan"):
        queue.step()
