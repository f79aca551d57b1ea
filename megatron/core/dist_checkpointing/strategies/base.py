"""Strategy objects (Megatron Core's names): what `save`/`load` accept as `sharded_strategy` and
`common_strategy`, and the registry of default strategies (`get_default_strategy`). Only the `torch_dist`
sharded backend and the `torch` common backend exist here.

Design note (registry by module name): a backend registers its strategies when its module is imported
(`strategies/torch.py` does so for torch_dist). `get_default_strategy` imports that module by name from the
table `_BACKEND_MODULES`, so this module, which the backends import, never imports them.
"""
import importlib
from collections import defaultdict
from enum import Enum
from typing import Any, DefaultDict, Dict, Optional, Tuple

from megatron.core.dist_checkpointing.mapping import CheckpointingException

SUPPORTED_SHARDED_BACKENDS = ("torch_dist",)


class StrategyAction(Enum):
    """What a default strategy is registered for."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


default_strategies: DefaultDict[str, Dict[Tuple[str, int], Any]] = defaultdict(dict)
"""{action value: {(backend, version): strategy}}."""

_BACKEND_MODULES = {"torch_dist": "megatron.core.dist_checkpointing.strategies.torch",
                    "torch": "megatron.core.dist_checkpointing.strategies.torch"}


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy: Any) -> None:
    """Make `strategy` the default for (`action`, `backend`, `version`)."""
    default_strategies[action.value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The default strategy for (`action`, `backend`, `version`); CheckpointingException naming the three when
    there is none (the zarr and tensorstore backends of Megatron are not implemented here)."""
    if backend in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[backend])
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError:
        raise CheckpointingException(
            f"no default strategy for {(action.value, backend, version)}: the backends here are torch_dist "
            f"(sharded, version 1) and torch (common, version 1)") from None


class LoadStrategyBase:
    """Base of the load strategies."""

    backend = "torch_dist"

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise CheckpointingException when a checkpoint of `loaded_backend` cannot be read by this strategy."""
        if loaded_backend != self.backend:
            raise CheckpointingException(f"a {self.backend} strategy cannot load a {loaded_backend} checkpoint")

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise CheckpointingException for a backend version this strategy does not read (only 1 exists)."""
        if loaded_version != 1:
            raise CheckpointingException(f"{self.backend} checkpoints of version {loaded_version} are not supported")

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are read from DCP bytes items."""
        return True


class SaveStrategyBase:
    """Base of the save strategies: names the backend and version written."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are stored inside DCP as bytes items."""
        return True


class SaveShardedStrategy(SaveStrategyBase):
    """Names the sharded backend and version that `save` writes."""

    def __init__(self, backend: str, version: int):
        if backend not in SUPPORTED_SHARDED_BACKENDS:
            raise CheckpointingException(
                f"sharded backend {backend!r} is not implemented; choose one of {SUPPORTED_SHARDED_BACKENDS}"
            )
        super().__init__(backend, version)


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save strategy that can return an AsyncRequest (all torch_dist strategies can)."""


class LoadShardedStrategy(LoadStrategyBase):
    """Marks the sharded backend `load` reads; the format comes from `metadata.json`."""


class SaveCommonStrategy(SaveStrategyBase):
    """Writes `common.pt` with torch.save."""

    def __init__(self, backend: str = "torch", version: int = 1):
        if backend != "torch":
            raise CheckpointingException(f"common backend {backend!r} is not implemented; use 'torch'")
        super().__init__(backend, version)


class LoadCommonStrategy(LoadStrategyBase):
    """Reads `common.pt` with the restricted unpickler."""

    backend = "torch"


def backend_of(strategy) -> Optional[str]:
    """The backend a strategy (object or (backend, version) tuple) names."""
    if strategy is None:
        return None
    if isinstance(strategy, tuple):
        return strategy[0]
    return getattr(strategy, "backend", None)


__all__ = [
    "StrategyAction", "default_strategies", "register_default_strategy", "get_default_strategy",
    "LoadStrategyBase", "SaveStrategyBase", "SaveShardedStrategy", "AsyncSaveShardedStrategy",
    "LoadShardedStrategy", "SaveCommonStrategy", "LoadCommonStrategy", "backend_of",
]
