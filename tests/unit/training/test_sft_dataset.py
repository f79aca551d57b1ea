"""SFT dataset and tokenizer: Megatron's sample layout (prompt masked, answers + eod trained, pad after),
checked against the worked example of the spec written out by hand, and the conversation rules."""
import json

import numpy
import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import Split
from megatron.training.datasets.sft_dataset import SFTDataset, SFTLowLevelDataset
from megatron.training.tokenizer.sft_tokenizer import IGNORE_INDEX, render_conversation

PAD, EOD = 0, 1


class _TurnTokenizer:
    """A stand-in SFT tokenizer: user turn -> [11, 12, 13], assistant turn -> [21, 22] (u1 u2 u3 / a1 a2)."""

    pad, eod = PAD, EOD

    def tokenize_conversation(self, messages, return_target=True, add_generation_prompt=False):
        tokens, target = [], []
        for message in messages:
            ids = [11, 12, 13] if message["role"] == "user" else [21, 22]
            tokens += ids
            target += [IGNORE_INDEX] * len(ids) if message["role"] == "user" else ids
        return numpy.array(tokens), numpy.array(target)


def _dataset(tmp_path, seq_length, conversations, create_attention_mask=False, num_samples=None, pack=False):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    config = GPTDatasetConfig(random_seed=1, sequence_length=seq_length, blend=([str(path)], None), split="100,0,0",
                              tokenizer=_TurnTokenizer(), reset_position_ids=pack, reset_attention_mask=pack,
                              eod_mask_loss=False, create_attention_mask=create_attention_mask)
    low = SFTDataset.build_low_level_dataset(str(path), config)
    indices = numpy.arange(len(low), dtype=numpy.int32)
    return SFTDataset(low, str(path), indices, num_samples, Split.train, config)


CONV = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_spec_example_s8(tmp_path):
    sample = _dataset(tmp_path, 8, [CONV])[0]
    assert sample["tokens"].tolist() == [11, 12, 13, 21, 22, EOD, PAD, PAD]
    assert sample["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 21, 22, EOD, PAD, PAD, PAD]
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert sample["position_ids"].tolist() == list(range(8))
    assert "attention_mask" not in sample


def test_truncation_wraparound_and_causal_mask(tmp_path):
    two_turns = CONV + CONV
    dataset = _dataset(tmp_path, 6, [two_turns, CONV], create_attention_mask=True, num_samples=5)
    assert len(dataset) == 5
    sample = dataset[0]
    # 10 tokens truncated to S - 1 = 5, then eod: tokens u1 u2 u3 a1 a2, labels from position 1 on.
    assert sample["tokens"].tolist() == [11, 12, 13, 21, 22, EOD][:6]
    assert sample["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 21, 22, EOD, PAD]
    assert dataset[3]["tokens"].tolist() == dataset[1]["tokens"].tolist()  # idx 3 -> conversation 3 % 2
    mask = sample["attention_mask"]
    assert mask.shape == (1, 6, 6) and torch.equal(mask[0], torch.triu(torch.ones(6, 6, dtype=torch.bool), 1))
    assert dataset[None]["loss_mask"].sum() == 0


def test_packed_conversations(tmp_path):
    # Conversations of 6 (5 + eod) and 11 (10 + eod) tokens into S + 1 = 13 token packs: [6, 6] then [11], [6].
    dataset = _dataset(tmp_path, 12, [CONV, CONV, CONV + CONV, CONV], pack=True)
    assert dataset.packs == [[0, 1], [2], [3]]
    first = dataset[0]
    assert first["tokens"].tolist() == [11, 12, 13, 21, 22, EOD] * 2
    assert first["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 21, 22, EOD, IGNORE_INDEX] + \
        [IGNORE_INDEX, IGNORE_INDEX, 21, 22, EOD, PAD]
    assert first["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]
    assert first["position_ids"].tolist() == list(range(6)) * 2
    assert "attention_mask" not in first
    second = dataset[1]
    assert second["tokens"].tolist() == [11, 12, 13, 21, 22, 11, 12, 13, 21, 22, EOD, PAD]
    assert second["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    assert dataset[4]["tokens"].tolist() == dataset[1]["tokens"].tolist()  # pack 4 % 3


def test_bad_jsonl_lines_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONV}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        SFTLowLevelDataset(str(path))


def test_render_nemotron_h_aligned():
    text = render_conversation([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi?"},
                                {"role": "assistant", "content": "Hello.\n"}])
    assert text == "<SPECIAL_10>System\nBe brief.\n<SPECIAL_11>User\nHi?\n<SPECIAL_11>Assistant\nHello.\n"


def test_sft_eval_reports_mean_of_microbatch_means(monkeypatch):
    from argparse import Namespace

    from megatron.training import evaluation
    from tests.unit.transformer.model_setup import init_single_rank

    init_single_rank()
    loss_dicts = [{"lm loss": torch.tensor([6.0, 2.0])}, {"lm loss": torch.tensor([1.0, 4.0])}]
    # microbatch means 3 and 0.25, then 3 again; token-weighted: (6 + 1 + 6) / (2 + 4 + 2)
    for sft, want in ((True, (3.0 + 0.25 + 3.0) / 3), (False, 13.0 / 8.0)):
        monkeypatch.setattr(evaluation, "get_args", lambda sft=sft: Namespace(sft=sft))
        total = {}
        evaluation._accumulate_eval_losses(loss_dicts, total, torch.device("cpu"))
        evaluation._accumulate_eval_losses(loss_dicts[:1], total, torch.device("cpu"))
        numerator, denominator = total["lm loss"]
        assert (numerator / denominator).item() == pytest.approx(want)
