"""Loss scalers for fp16 training: a constant scale, or Megatron's dynamic scale with hysteresis.

The scale lives in a 1-element fp32 tensor on the training device so that `scale_loss` stays on the
device; `inv_scale` is computed in double precision and rounded once, as Megatron does.
"""
from abc import ABC, abstractmethod
from typing import Any, Dict, Optional

import torch


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class MegatronGradScaler(ABC):
    """Holds the loss scale; `update(found_inf)` is called once per step after the inf/nan check."""

    def __init__(self, initial_scale: float, device: Optional[torch.device] = None):
        if not initial_scale > 0.0:
            raise ValueError(f"initial loss scale ({initial_scale}) must be > 0: fix --loss-scale/--initial-loss-scale")
        self._device = torch.device(device) if device is not None else _default_device()
        self._scale = torch.tensor([initial_scale], dtype=torch.float, device=self._device)

    @property
    def scale(self) -> torch.Tensor:
        """Current loss scale, a 1-element fp32 tensor."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, computed in double and rounded to fp32."""
        return self._scale.double().reciprocal().float()

    def to(self, device) -> "MegatronGradScaler":
        """Move the scaler's tensors to `device` (the device of the params it serves)."""
        self._device = torch.device(device)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(self._device))
        return self

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """React to this step's overflow check."""

    @abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        """Checkpointable state (tensors and numbers only)."""

    @abstractmethod
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore from `state_dict()`."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (`--loss-scale`)."""

    def update(self, found_inf: bool) -> None:
        """The scale never changes."""

    def state_dict(self) -> Dict[str, Any]:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Nothing to restore."""


class DynamicGradScaler(MegatronGradScaler):
    """Dynamic loss scale.

    An overflowing step resets the growth counter and uses up one unit of hysteresis; when the
    hysteresis is used up, every further overflow multiplies the scale by `backoff_factor` (not
    below `min_scale`). After `growth_interval` consecutive clean steps the scale is multiplied by
    `growth_factor` and the hysteresis is refilled.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: Optional[torch.device] = None,
    ):
        super().__init__(initial_scale, device)
        errors = []
        if not 0.0 < min_scale <= initial_scale:
            errors.append(
                f"--min-loss-scale ({min_scale}) must be > 0 and <= --initial-loss-scale ({initial_scale})"
            )
        if not growth_factor > 1.0:
            errors.append(f"growth factor ({growth_factor}) must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            errors.append(f"backoff factor ({backoff_factor}) must be in (0, 1)")
        if not growth_interval > 0:
            errors.append(f"--loss-scale-window ({growth_interval}) must be > 0")
        if not hysteresis > 0:
            errors.append(f"--hysteresis ({hysteresis}) must be > 0")
        if errors:
            raise ValueError("invalid dynamic loss scaler: " + "; ".join(errors))
        self.min_scale = torch.tensor([min_scale], dtype=torch.float, device=self._device)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float, device=self._device)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float, device=self._device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Back off after `hysteresis` overflows; grow after `growth_interval` clean steps."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's keys: `scale` (tensor), `growth_tracker`, `hysteresis_tracker`."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the scale (moved to this scaler's device) and the trackers."""
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float)
        self._scale = scale.reshape(1).to(self._device)  # [] or [1] -> [1]
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
