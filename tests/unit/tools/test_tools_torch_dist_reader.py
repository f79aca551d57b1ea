"""tools/checkpoint reads torch_dist checkpoints: a Llama-style tiny model trained one iteration and saved as
torch_dist reads back (layers unstacked, TE norm names mapped to local ones) exactly as the same checkpoint
converted to the legacy layout by `--ckpt-convert-format torch`, and exports to an HF directory."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tools.checkpoint import hf_convert
from tools.checkpoint.legacy_layout import read_legacy_checkpoint
from tools.checkpoint.model_description import from_megatron_args

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --eval-iters 0 --transformer-impl local --seed 5 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --group-query-attention --num-query-groups 2 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --train-iters 1"
).split()


@pytest.fixture(scope="module", autouse=True)
def _destroy_process_group_at_end():
    yield
    reset_training_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_torch_dist_checkpoint_reads_like_its_legacy_conversion(tmp_path):
    save, converted = str(tmp_path / "dist"), str(tmp_path / "conv")
    code, _ = run_pretrain_in_process(FLAGS + ["--save", save, "--save-interval", "1"])
    assert code is None
    code, _ = run_pretrain_in_process(FLAGS + ["--load", save, "--ckpt-convert-format", "torch",
                                               "--ckpt-convert-save", converted])
    assert code == 0
    from_dist, args, iteration, desc = read_legacy_checkpoint(save, from_megatron_args)
    from_legacy, _, _, _ = read_legacy_checkpoint(os.path.join(converted, "torch"), from_megatron_args)
    assert iteration == 1 and desc.swiglu and desc.num_query_groups == 2
    assert sorted(from_dist) == sorted(k for k in from_legacy if not k.endswith("_extra_state"))
    assert "decoder.layers.1.input_layernorm.weight" in from_dist
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in from_dist
    assert all(torch.equal(from_dist[k], from_legacy[k]) for k in from_dist)
    hf_dir = str(tmp_path / "hf")
    hf_convert.main(["megatron-to-hf", "--load-dir", save, "--save-dir", hf_dir])
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    reset_training_state()
