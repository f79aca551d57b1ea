"""`_BaseDataParallel`: what every data-parallel wrapper (DDP, FSDP2) offers the training loop.

The wrapper is transparent for checkpoints: `state_dict`, `load_state_dict` and
`state_dict_for_save_checkpoint` delegate to the wrapped module, so keys carry no `module.` prefix.
"""
from contextlib import contextmanager

import torch


class _BaseDataParallel(torch.nn.Module):
    """Base class of data-parallel wrappers; subclasses fill in the communication."""

    def __init__(self, config, module: torch.nn.Module):
        super().__init__()
        self.config = config
        self.module = module

    def forward(self, *inputs, **kwargs):
        """Call the wrapped module."""
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Context in which gradients are accumulated locally, with no communication."""
        try:
            yield
        finally:
            pass

    def start_grad_sync(self, *unused):
        """Launch the gradient collectives (no-op by default)."""

    def finish_grad_sync(self):
        """Wait for (or run) the gradient collectives (no-op by default)."""

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """Launch the parameter all-gathers (no-op by default)."""

    def scale_gradients(self, scaling_factor) -> None:
        """Multiply all gradients by `scaling_factor` (no-op by default)."""

    def zero_grad_buffer(self):
        """Zero the gradients before a new iteration (no-op by default)."""

    def broadcast_params(self):
        """Copy the parameters of data-parallel rank 0 to the other ranks (no-op by default)."""

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state dict (no wrapper prefix)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's checkpoint state dict (its own method when it has one)."""
        if hasattr(self.module, "state_dict_for_save_checkpoint"):
            return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs):
        """The wrapped module's sharded state dict (distributed checkpoints)."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)
