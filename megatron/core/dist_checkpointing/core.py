"""`metadata.json`: the file that marks (and commits) a distributed checkpoint directory."""
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from megatron.core.dist_checkpointing.mapping import CheckpointingException

CONFIG_FNAME = "metadata.json"


@dataclass
class CheckpointingConfig:
    """Backends that wrote a checkpoint (the content of `metadata.json`)."""

    sharded_backend: str
    """Backend of the sharded tensors ("torch_dist")."""
    sharded_backend_version: int = 1
    """Version of that backend's layout."""
    common_backend: str = "torch"
    """Backend of `common.pt`."""
    common_backend_version: int = 1
    """Version of the common backend's layout."""


def save_config(config: CheckpointingConfig, checkpoint_dir: str) -> None:
    """Write `metadata.json` atomically (temp file, fsync, rename); the last step of a save."""
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(config), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def maybe_load_config(checkpoint_dir: str) -> Optional[CheckpointingConfig]:
    """The checkpoint's config, or None when `metadata.json` is absent or unreadable."""
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return CheckpointingConfig(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """True iff `checkpoint_dir/metadata.json` exists and parses."""
    return maybe_load_config(checkpoint_dir) is not None


def load_config(checkpoint_dir: str) -> CheckpointingConfig:
    """The checkpoint's config; raises CheckpointingException naming `metadata.json` when it is
    missing (e.g. the save was interrupted before its final step) or damaged."""
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointingException(f"checkpoint directory {checkpoint_dir} does not exist")
    if not os.path.isfile(path):
        raise CheckpointingException(
            f"{path} is missing: {checkpoint_dir} is not a complete distributed checkpoint (metadata.json is "
            f"written last, so the save was interrupted or this is another format)"
        )
    config = maybe_load_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(f"{path} is damaged: it is not valid JSON with the checkpoint backends")
    return config
