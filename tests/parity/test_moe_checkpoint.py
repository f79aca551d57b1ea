"""MoE distributed checkpoints: Megatron's own MoE checkpoint at EP=1 and EP=2, GroupedMLP <-> SequentialMLP at
different EP sizes, and the loss tracker's reductions. One world-2 launch.

- The fixture `ck_moe_shared_expert.tgz` (Megatron-LM 0.13.1: 2 layers, 4 SequentialMLP experts, top-2, alltoall, a
  shared expert, local spec) is loaded with `dist_checkpointing.load(model.sharded_state_dict(), dir)` into the
  same model at EP=1 (DP=2) and EP=2: every model key of the file is requested (none missing, none extra), the
  loaded weights equal the file's tensors exactly, and both layouts give the same loss on one batch.
- A GroupedMLP model saved at EP=2 (expert TP 2 inside a TP=2 layout) loads into a SequentialMLP model at EP=1:
  weights equal, outputs equal.
- `reduce_aux_losses_tracker_across_ranks` sums over the pipeline group and the entry's reduce group.
"""
import os
import tarfile

import pytest
import torch
import torch.nn.functional as F

from tests.harness import repo_root, run_on_ranks
from tests.parity.test_moe_parity import assemble, global_pieces, to_numpy

FIXTURE = os.path.join(repo_root(), "..", "shared", "fixtures", "megatron", "ck_moe_shared_expert.tgz")
SEQ, VOCAB = 64, 4096


def _fixture_config(ep=1, grouped=False, tp=1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, moe_ffn_hidden_size=96,
        num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=64, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, expert_model_parallel_size=ep, moe_grouped_gemm=grouped,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_tensor_parallel_size=tp,
    )


def _model(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(3)

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _loss(model):
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    model.eval()
    with torch.no_grad():
        return model(tokens, position_ids, None, labels=labels).float().mean().item()


def _load_fixture(checkpoint_dir, ep):
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, create_gloo_process_groups=False)
    try:
        model = _model(_fixture_config(ep=ep))
        request = model.sharded_state_dict()
        loaded = dist_checkpointing.load(request, checkpoint_dir)
        # the result also carries the file's common state (args, iteration, ...): keep the model's entries
        model.load_state_dict({key: loaded[key] for key in request}, strict=True)
        return dict(loss=_loss(model), pieces=to_numpy(global_pieces(model)))
    finally:
        parallel_state.destroy_model_parallel()


def _grouped_to_sequential(save_dir):
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(2, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=2,
                                             create_gloo_process_groups=False)
    try:
        torch.manual_seed(1)
        grouped = _model(_fixture_config(ep=1, grouped=True, tp=2))
        dist_checkpointing.save(grouped.sharded_state_dict(), save_dir)
        grouped_pieces, grouped_loss = to_numpy(global_pieces(grouped)), _loss(grouped)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        sequential = _model(_fixture_config(ep=2))
        request = sequential.sharded_state_dict()
        loaded = dist_checkpointing.load(request, save_dir)
        sequential.load_state_dict({key: loaded[key] for key in request}, strict=True)
        return dict(grouped=grouped_pieces, grouped_loss=grouped_loss, sequential=to_numpy(global_pieces(sequential)),
                    sequential_loss=_loss(sequential))
    finally:
        parallel_state.destroy_model_parallel()


def _tracker_reductions():
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    rank = dist.get_rank()
    results = {}
    parallel_state.initialize_model_parallel(1, 2, create_gloo_process_groups=False)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0 + rank), rank + 1, 2)
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    results["pp"] = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1, create_gloo_process_groups=False)
    group = parallel_state.get_tensor_model_parallel_group()
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0 + rank), 1, 2, reduce_group=group)
    moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(1.0 + rank), 1, 2, avg_group=group)
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    results["tp_sum"] = tracker["load_balancing_loss"]["values"].tolist()
    results["tp_avg"] = tracker["z_loss"]["values"].tolist()
    parallel_state.destroy_model_parallel()
    return results


def _worker(fixture_dir, save_dir):
    result = {"tracker": _tracker_reductions(), "interchange": _grouped_to_sequential(save_dir)}
    if fixture_dir is not None:
        result["ep1"] = _load_fixture(fixture_dir, 1)
        result["ep2"] = _load_fixture(fixture_dir, 2)
    return result


def _fixture_tensors(checkpoint_dir):
    import warnings

    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items()
             if hasattr(item, "size") and not key.startswith("optimizer")}
    with warnings.catch_warnings():  # "loading in a single process": intended here
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    return state


def test_moe_checkpoints_world2(tmp_path):
    fixture_dir = None
    if os.path.exists(FIXTURE):
        with tarfile.open(FIXTURE) as archive:
            archive.extractall(tmp_path, filter="data")
        fixture_dir = str(tmp_path / "moe_shared_expert" / "iter_0000004")
    results = run_on_ranks(_worker, 2, fixture_dir, str(tmp_path / "grouped"), timeout=300)
    assert results[0]["tracker"]["pp"] == [1.0, 2.0] == results[1]["tracker"]["pp"]
    assert results[0]["tracker"]["tp_sum"] == [3.0, 0.0] and results[0]["tracker"]["tp_avg"] == [1.5, 0.0]
    interchange = [r["interchange"] for r in results]
    grouped, sequential = assemble([r["grouped"] for r in interchange]), assemble([r["sequential"] for r in interchange])
    assert set(grouped) == set(sequential)
    for key in grouped:
        assert torch.equal(grouped[key], sequential[key]), key
    assert interchange[0]["grouped_loss"] == pytest.approx(interchange[0]["sequential_loss"], rel=1e-6)
    if fixture_dir is None:
        pytest.skip("Megatron fixtures (../shared/fixtures/megatron) not present")
    stored = _fixture_tensors(fixture_dir)
    for name in ("ep1", "ep2"):
        loaded = assemble([r[name]["pieces"] for r in results])
        assert set(loaded) == {k for k in stored if not k.startswith(("rng_state", "rerun"))}, name
        for key, tensor in loaded.items():
            assert torch.equal(tensor, stored[key].float()), (name, key)
    losses = [r[name]["loss"] for r in results for name in ("ep1", "ep2")]
    assert max(losses) - min(losses) <= 1e-6 * abs(losses[0]), losses
