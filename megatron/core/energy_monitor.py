"""GPU energy measured with NVML (`--log-energy`), Megatron Core's `EnergyMonitor`.

Each rank reads its GPU's cumulative energy counter (`nvmlDeviceGetTotalEnergyConsumption`, millijoules);
`lap()` and `get_total()` sum the ranks' energy with an all-reduce and return joules. Energy spent while
`pause()`d (evaluation) is left out. NVML comes from the `pynvml` module (packages `nvidia-ml-py` or
`pynvml`), imported by `setup()` only. Without a CUDA device or without pynvml, `setup()` logs one info line
saying energy is not available, and `lap()`/`get_total()` return 0.0 (Megatron prints the same zeros).
"""
import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)


def _collectives_device() -> torch.device:
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class EnergyMonitor:
    """Energy of the GPUs of all ranks; every rank calls `lap()` and `get_total()` (collectives)."""

    def __init__(self) -> None:
        self._total_energy = 0
        self._lap_energy = 0
        self._last_energy = 0
        self._handle: Any = None
        self._nvml: Optional[Any] = None

    @property
    def available(self) -> bool:
        """Whether `setup()` found NVML and a GPU to read."""
        return self._nvml is not None

    def setup(self) -> None:
        """Open NVML for this rank's GPU, or log why energy cannot be measured."""
        reason = None
        if not torch.cuda.is_available():
            reason = "no CUDA device"
        else:
            try:
                import pynvml
            except ImportError:
                reason = "the pynvml module is missing (pip install nvidia-ml-py)"
            else:
                try:
                    pynvml.nvmlInit()
                    self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
                    pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
                    self._nvml = pynvml
                except pynvml.NVMLError as error:
                    reason = f"NVML cannot read the energy counter ({error})"
        if reason is not None:
            logger.info("--log-energy: GPU energy is not available here (%s); energy and power are logged as 0.",
                        reason)

    def shutdown(self) -> None:
        """Close NVML."""
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    def _get_energy(self) -> int:
        """The GPU's cumulative energy in millijoules (the last value when NVML errs)."""
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except self._nvml.NVMLError:
            return self._last_energy

    def pause(self) -> None:
        """Stop counting (resume afterwards)."""
        if self._nvml is not None:
            self._lap_energy += self._get_energy() - self._last_energy

    def resume(self) -> None:
        """Start (or restart) counting."""
        if self._nvml is not None:
            self._last_energy = self._get_energy()

    def _sum_over_ranks(self, millijoules: int) -> float:
        value = torch.tensor([millijoules], dtype=torch.int64, device=_collectives_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
        return value.item() / 1000.0

    def lap(self) -> float:
        """Joules used by all GPUs since the previous lap (counted time only); adds them to the total."""
        if self._nvml is None:
            return 0.0
        energy = self._get_energy()
        lap_energy = self._lap_energy + (energy - self._last_energy)
        self._total_energy += lap_energy
        self._lap_energy = 0
        self._last_energy = energy
        return self._sum_over_ranks(lap_energy)

    def get_total(self) -> float:
        """Joules used by all GPUs over every lap so far."""
        if self._nvml is None:
            return 0.0
        return self._sum_over_ranks(self._total_energy)


__all__ = ["EnergyMonitor"]
