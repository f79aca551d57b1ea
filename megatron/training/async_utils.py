"""Megatron-LM's `megatron.training.async_utils`: the process-wide queue of asynchronous checkpoint saves
(`--async-save`), over the same queue the `torch_dist` saves of this framework use
(`checkpointing_dist.get_async_queue`), so requests scheduled here are finalized by the training loop too."""
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.training import checkpointing_dist
from megatron.training.global_vars import get_args


def schedule_async_save(async_request: AsyncRequest) -> None:
    """Start `async_request` (e.g. what `dist_checkpointing.save(..., async_sharded_save=True)` returned) in the
    background; it is finalized by `maybe_finalize_async_save`."""
    checkpointing_dist.get_async_queue().schedule_async_request(async_request)


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Finalize the scheduled saves that finished (all of them, waiting, with `blocking`); `terminate` then closes
    the queue. Nothing to do without --async-save. Collective."""
    if not get_args().async_save:
        return
    checkpointing_dist.maybe_finalize_async_save(blocking=blocking, terminate=terminate)


def is_empty_async_queue() -> bool:
    """True when no scheduled save is left to finalize (the same answer on every rank)."""
    return checkpointing_dist.is_empty_async_queue()


__all__ = ["schedule_async_save", "maybe_finalize_async_save", "is_empty_async_queue"]
