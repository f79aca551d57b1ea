"""wandb integration: start a run on the last rank and log checkpoint artifacts after saves.

`wandb` is optional and imported only inside these functions. `WANDB_MODE=offline` works as usual:
the run is written under the save dir and can be synced later.
"""
import os
from pathlib import Path

from megatron.training.checkpoint_args import args_to_plain_dict


def init_wandb(args, save_dir: str):
    """`wandb.init` with the run's name, project and args; returns the `wandb` module (the writer)."""
    import wandb

    os.makedirs(save_dir, exist_ok=True)
    kwargs = {
        "dir": save_dir,
        "name": args.wandb_exp_name,
        "project": args.wandb_project,
        "config": args_to_plain_dict(args),
    }
    entity = getattr(args, "wandb_entity", None)
    if entity:
        kwargs["entity"] = entity
    wandb.init(**kwargs)
    return wandb


def on_save_checkpoint_success(checkpoint_path: str, tracker_filename: str, save_dir: str, iteration: int,
                               writer=None) -> None:
    """Log a reference artifact pointing at the saved checkpoint (`writer` is the active wandb module)."""
    if writer is None or writer.run is None:
        return
    metadata = {"iteration": iteration}
    artifact_name = f"{writer.run.id}-checkpoint"
    artifact = writer.Artifact(artifact_name, type="model", metadata=metadata)
    artifact.add_reference(f"file://{Path(checkpoint_path).resolve()}", checkpoint=True)
    artifact.add_file(tracker_filename)
    writer.run.log_artifact(artifact, aliases=[Path(checkpoint_path).name])
    wandb_tracker = os.path.join(save_dir, f"{artifact_name}.txt")
    with open(wandb_tracker, "w") as f:
        f.write(artifact_name)
