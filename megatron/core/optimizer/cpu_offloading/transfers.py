"""Ordering of the host <-> device copies of `HybridDeviceOptimizer` (CUDA streams and events).

With overlap (`--overlap-cpu-optimizer-d2h-h2d`) gradients go to the host on one side stream and updated
params come back on another, so the device optimizer step and the host optimizer steps run while copies are
in flight; without it every copy is issued on the current stream. The host waits only for the gradient
copies of the host optimizer it is about to step (an event per host optimizer), never for the whole device.
On a CPU-only run every copy is synchronous and these helpers do nothing.

Why the copies never race: the side streams first wait for the current stream (gradients are final, the
previous step's uploads are ordered before this step's downloads), and the current stream waits for the
upload stream before anything reads the params again.
"""
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch


class HostDeviceTransfers:
    """Streams and events for the copies between the host optimizers and the params on `device`."""

    def __init__(self, device: torch.device, overlap: bool):
        self.is_cuda = device.type == "cuda"
        self.download_stream: Optional[torch.cuda.Stream] = None
        self.upload_stream: Optional[torch.cuda.Stream] = None
        if self.is_cuda and overlap:
            self.download_stream = torch.cuda.Stream(device=device)
            self.upload_stream = torch.cuda.Stream(device=device)

    @contextmanager
    def _on(self, stream: Optional[torch.cuda.Stream]):
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            yield

    def downloads(self):
        """Context in which device -> host gradient copies are issued."""
        return self._on(self.download_stream) if self.is_cuda else nullcontext()

    def uploads(self):
        """Context in which host -> device parameter copies are issued."""
        return self._on(self.upload_stream) if self.is_cuda else nullcontext()

    def record(self) -> Optional[torch.cuda.Event]:
        """An event after the copies issued so far on the current (download) stream; None on the CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @staticmethod
    def wait_on_host(event: Optional[torch.cuda.Event]) -> None:
        """Block the host until `event` completed (the gradients of one host optimizer arrived)."""
        if event is not None:
            event.synchronize()

    def device_waits_for_uploads(self) -> None:
        """Make the current stream wait for every upload issued on the upload stream."""
        if self.upload_stream is not None:
            torch.cuda.current_stream(self.upload_stream.device).wait_stream(self.upload_stream)


__all__ = ["HostDeviceTransfers"]
