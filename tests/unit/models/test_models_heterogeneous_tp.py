"""A heterogeneous GPT model (no-op attention, linear replacements, per-layer GQA groups and MLP sizes) at TP=2
on gloo against the single-process model of identical init: Llama-style and GPT-style (biases, LayerNorm),
with and without sequence parallelism, two SGD steps each; then the TP=2 model's torch_dist checkpoint loaded
at TP=1 (the per-layer keys reshard).

Tolerances as in tests/parity/test_tp_gpt_parity.py: loss 1e-6 and gradients 1e-5 relative (the TP run only
sums in another order: split GEMMs, all-reduces). Also at PP=2: each stage builds its own blocks (the spec is
sliced by the stage's layer offset) and saves them under their global layer index.
"""
import tempfile

import torch

from tests.harness import run_on_ranks
from tests.unit.models.test_models_heterogeneous import BLOCKS, batch, heterogeneous_config, heterogeneous_model
from tests.unit.transformer.model_setup import init_single_rank

STEPS, LR = 2, 0.1
CASES = [("llama", True, False), ("llama-sp", True, True), ("gpt", False, False), ("gpt-sp", False, True)]


def _full_grad(param, grad, group, tp):
    """The full gradient of a TP-split param (strided fc1 shards re-interleaved)."""
    import torch.distributed as dist

    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return grad.clone()
    shards = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(shards, grad.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(tp)], dim=dim)


def _train(llama, sp, tp, group=None):
    """STEPS SGD steps; per step (loss, {name: full gradient as a numpy array})."""
    from megatron.core.tensor_parallel.mappings import all_reduce_tensor

    model = heterogeneous_model(heterogeneous_config(llama=llama, tensor_model_parallel_size=tp, sequence_parallel=sp))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, position_ids, labels = batch(step)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        grads = {}
        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False) and tp > 1:
                all_reduce_tensor(param.grad, group)
            grads[name] = _full_grad(param, param.grad, group, tp).numpy()
        history.append((loss.item(), grads))
        optimizer.step()
    return history


def _rank_body(directory):
    import torch.distributed as dist

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group = ps.get_tensor_model_parallel_group()
    results = {name: _train(llama, sp, 2, group) for name, llama, sp in CASES}
    model = heterogeneous_model(heterogeneous_config(tensor_model_parallel_size=2))
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return (results if dist.get_rank() == 0 else None), _pipeline_stage_layers()


def _pipeline_stage_layers():
    """PP=2 over the first four blocks: {global layer number: {param name: shape}} and the sharded keys of
    this stage's layers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from tests.unit.models.test_models_heterogeneous import BLOCKS, SEQ, VOCAB

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = heterogeneous_config(BLOCKS[:4], pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    model = GPTModel(config, get_gpt_heterogeneous_layer_spec(config), vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    layers = {layer.layer_number: {n: tuple(p.shape) for n, p in layer.named_parameters()}
              for layer in model.decoder.layers}
    keys = sorted(v.key for k, v in model.sharded_state_dict().items() if k.startswith("decoder.layers."))
    return layers, keys


def _rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-12)


def test_tp2_matches_single_process_and_checkpoint_reshards():
    from megatron.core import dist_checkpointing

    directory = tempfile.mkdtemp(prefix="heterogeneous_tp2_")
    ranks = run_on_ranks(_rank_body, 2, directory, timeout=300)
    results = ranks[0][0]
    init_single_rank()
    whole = heterogeneous_model(heterogeneous_config(BLOCKS[:4]))
    want = {layer.layer_number: {n: tuple(p.shape) for n, p in layer.named_parameters()} for layer in whole.decoder.layers}
    for rank, (_, (layers, keys)) in enumerate(ranks):
        assert sorted(layers) == [2 * rank + 1, 2 * rank + 2], f"PP rank {rank} builds layers {sorted(layers)}"
        assert all(layers[n] == want[n] for n in layers), f"PP rank {rank}: layer shapes differ from the JSON's"
        assert {k.split(".")[2] for k in keys} == {str(n - 1) for n in layers}, keys
    for name, llama, sp in CASES:
        reference = _train(llama, False, 1)
        for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(results[name], reference)):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"{name} step {step}: loss {loss} vs {ref_loss}"
            assert grads.keys() == ref_grads.keys()
            for key, grad in grads.items():
                error = _rel(torch.from_numpy(grad), torch.from_numpy(ref_grads[key]))
                assert error <= 1e-5, f"{name} step {step}: gradient of {key} off by {error:.1e}"
    reference = heterogeneous_model(heterogeneous_config())
    resharded = heterogeneous_model(heterogeneous_config(), seed=77)
    resharded.load_state_dict(dist_checkpointing.load(resharded.sharded_state_dict(), directory))
    for (key, want), got in zip(reference.state_dict().items(), resharded.state_dict().values()):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), key
