"""Storage strategies of distributed checkpoints (only `torch_dist`, on torch.distributed.checkpoint)."""
