"""`get_batch_on_this_tp_rank`: TP rank 0 reads the batch and every TP rank ends up with the same tensors.

The plain causal attention mask is not shipped (the causal layers apply it themselves); with
--reset-attention-mask the per-document mask is.
"""
import argparse

import torch

from tests.harness import run_on_ranks


def _batch_on_tp2(reset_attention_mask):
    from megatron.core import parallel_state as ps
    from megatron.training import global_vars
    from megatron.training.utils import get_batch_on_this_tp_rank

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    global_vars.set_args(argparse.Namespace(
        micro_batch_size=2, seq_length=4, create_attention_mask_in_dataloader=True,
        reset_attention_mask=reset_attention_mask, mtp_num_layers=None))
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 1, 4, 4, generator=generator) > 0.5
    data = {"tokens": torch.randint(0, 9, (2, 4), generator=generator),
            "labels": torch.randint(0, 9, (2, 4), generator=generator),
            "loss_mask": torch.rand(2, 4, generator=generator), "attention_mask": mask,
            "position_ids": torch.arange(4).repeat(2, 1)}
    iterator = iter([data]) if ps.get_tensor_model_parallel_rank() == 0 else None
    batch = get_batch_on_this_tp_rank(iterator)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(batch[key], data[key]), key
    if reset_attention_mask:
        assert torch.equal(batch["attention_mask"], mask)
    else:
        assert batch["attention_mask"] is None
    global_vars.set_args(None)
    ps.destroy_model_parallel()
    return True


def _both():
    return _batch_on_tp2(False) and _batch_on_tp2(True)


def test_tp_batch_broadcast_and_causal_mask_not_shipped():
    assert run_on_ranks(_both, 2, timeout=120) == [True, True]
