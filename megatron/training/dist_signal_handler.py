"""Catch a signal (SIGTERM by default) and let every rank agree that one was received.

`--exit-signal-handler` installs a `DistributedSignalHandler`; the training loop polls
`signals_received()` (an all-gather of one flag per rank) and, if any rank got the signal, saves a
checkpoint and exits. The handler only sets a flag, so it is safe at any point of the iteration.
"""
import signal

import torch


def get_world_size() -> int:
    """World size, or 1 when torch.distributed is not initialized."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def get_device(local_rank=None) -> torch.device:
    """The device collectives of the default group run on (cuda for nccl, cpu for gloo)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":
            if local_rank is None:
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cuda", local_rank)
    return torch.device("cpu")


def all_gather_item(item, dtype, group=None, async_op=False, local_rank=None):
    """Gather one scalar from every rank of `group` into a Python list."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [item]
    device = get_device(local_rank)
    if group is not None:
        group_size = group.size()
    else:
        group_size = get_world_size()
    tensor = torch.tensor([item], device=device, dtype=dtype)
    output = [torch.zeros(1, dtype=tensor.dtype, device=tensor.device) for _ in range(group_size)]
    torch.distributed.all_gather(output, tensor, group, async_op)
    return [elem.item() for elem in output]


class DistributedSignalHandler:
    """Context manager that records whether `sig` arrived, restoring the previous handler on release."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._signal_received = False
        self.released = True
        self.original_handler = None

    def signals_received(self):
        """One bool per rank: whether that rank received the signal (a collective: all ranks call it)."""
        return all_gather_item(self._signal_received, dtype=torch.int32)

    def __enter__(self):
        self._signal_received = False
        self.released = False
        self.original_handler = signal.getsignal(self.sig)

        def handler(signum, frame):
            self._signal_received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.release()

    def release(self) -> bool:
        """Restore the original handler; False when already released."""
        if self.released:
            return False
        signal.signal(self.sig, self.original_handler)
        self.released = True
        return True
