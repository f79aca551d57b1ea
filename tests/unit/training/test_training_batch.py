"""`get_batch_on_this_tp_rank`: TP rank 0 reads the batch and every TP rank ends up with the same tensors.

The plain causal attention mask is not shipped (the causal layers apply it themselves); with
--reset-attention-mask neither is the per-document mask: TP rank 0 turns the EOD tokens into document ids
([b, s] int32), which every TP rank receives, and the attention restricts itself to documents.
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
    data["tokens"][0, 1] = data["tokens"][1, 2] = 8  # EODs: documents [2, 2] and [3, 1]
    iterator = iter([data]) if ps.get_tensor_model_parallel_rank() == 0 else None
    global_vars._GLOBAL_TOKENIZER = argparse.Namespace(eod=8)
    batch = get_batch_on_this_tp_rank(iterator)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(batch[key], data[key]), key
    assert batch["attention_mask"] is None
    eods = data["tokens"] == 8
    expected = torch.cumsum(eods.int(), dim=1) - eods.int()
    if reset_attention_mask:
        assert batch["document_ids"].dtype == torch.int32 and torch.equal(batch["document_ids"], expected)
    else:
        assert batch["document_ids"] is None
    global_vars._GLOBAL_TOKENIZER = None
    global_vars.set_args(None)
    ps.destroy_model_parallel()
    return True


def _both():
    return _batch_on_tp2(False) and _batch_on_tp2(True)


def test_tp_batch_broadcast_and_causal_mask_not_shipped():
    assert run_on_ranks(_both, 2, timeout=120) == [True, True]


def test_packed_broadcast_round_trips_every_dtype_at_aligned_offsets():
    from megatron.training.utils import _broadcast_packed

    shapes = {"tokens": ((3, 5), torch.int64), "loss_mask": ((3, 5), torch.float32),
              "attention_mask": ((3, 1, 5, 5), torch.bool), "position_ids": ((3, 5), torch.int64)}
    data = {"tokens": torch.arange(15).view(3, 5), "loss_mask": torch.rand(3, 5),
            "attention_mask": torch.rand(3, 1, 5, 5) > 0.5, "position_ids": torch.arange(5).repeat(3, 1)}
    out = _broadcast_packed(data, shapes, torch.device("cpu"))  # no TP group: the packing alone
    for key, value in data.items():
        assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
    # 60-byte float32 entry and 75-byte mask: the entries after them still start at multiples of 8 bytes
    assert all(t.storage_offset() * t.element_size() % 8 == 0 for t in out.values())


def test_packed_broadcast_names_a_missing_or_misshaped_entry():
    from megatron.training.utils import _broadcast_packed

    shapes = {"tokens": ((2, 4), torch.int64), "labels": ((2, 4), torch.int64)}
    for data, found in (({"tokens": torch.zeros(2, 4, dtype=torch.long)}, "None"),
                        ({"tokens": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 3)}, "(2, 3)")):
        try:
            _broadcast_packed(data, shapes, torch.device("cpu"))
        except RuntimeError as error:
            assert "'labels'" in str(error) and found in str(error) and "--seq-length 4" in str(error)
        else:
            raise AssertionError("a missing or misshaped entry must be reported")
