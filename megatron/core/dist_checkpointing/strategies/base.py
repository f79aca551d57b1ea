"""Strategy objects (Megatron Core's names): what `save`/`load` accept as `sharded_strategy` and
`common_strategy`. Only the `torch_dist` sharded backend and the `torch` common backend exist here."""
from typing import Optional

from megatron.core.dist_checkpointing.mapping import CheckpointingException

SUPPORTED_SHARDED_BACKENDS = ("torch_dist",)


class SaveShardedStrategy:
    """Names the backend and version that `save` writes."""

    def __init__(self, backend: str, version: int):
        if backend not in SUPPORTED_SHARDED_BACKENDS:
            raise CheckpointingException(
                f"sharded backend {backend!r} is not implemented; choose one of {SUPPORTED_SHARDED_BACKENDS}"
            )
        self.backend = backend
        self.version = version

    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are stored inside DCP as bytes items."""
        return True


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save strategy that can return an AsyncRequest (all torch_dist strategies can)."""


class LoadShardedStrategy:
    """Marks the backend `load` reads; the format comes from `metadata.json`."""

    backend = "torch_dist"

    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are read from DCP bytes items."""
        return True


class SaveCommonStrategy:
    """Writes `common.pt` with torch.save."""

    def __init__(self, backend: str = "torch", version: int = 1):
        if backend != "torch":
            raise CheckpointingException(f"common backend {backend!r} is not implemented; use 'torch'")
        self.backend = backend
        self.version = version


class LoadCommonStrategy:
    """Reads `common.pt` with the restricted unpickler."""

    backend = "torch"


def backend_of(strategy) -> Optional[str]:
    """The backend a strategy (object or (backend, version) tuple) names."""
    if strategy is None:
        return None
    if isinstance(strategy, tuple):
        return strategy[0]
    return getattr(strategy, "backend", None)
