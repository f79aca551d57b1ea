"""Placeholder modules used by layer specs for the parts a layer does not have."""
import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged; accepts and ignores any constructor or call arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """A module whose call returns the identity function (stands in for bias-dropout-add factories)."""

    def forward(self, *args, **kwargs):
        return super().forward


__all__ = ["IdentityOp", "IdentityFuncOp"]
