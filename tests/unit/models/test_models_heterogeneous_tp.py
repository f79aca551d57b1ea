"""A heterogeneous GPT model (no-op attention, linear replacements, per-layer GQA groups and MLP sizes) at TP=2
on gloo against the single-process model of identical init: Llama-style and GPT-style (biases, LayerNorm),
with and without sequence parallelism, two SGD steps each; then the TP=2 model's torch_dist checkpoint loaded
at TP=1 (the per-layer keys reshard).

Tolerances as in tests/parity/test_tp_gpt_parity.py: loss 1e-6 and gradients 1e-5 relative (the TP run only
sums in another order: split GEMMs, all-reduces).
"""
import tempfile

import torch

from tests.harness import run_on_ranks
from tests.unit.models.test_models_heterogeneous import batch, heterogeneous_config, heterogeneous_model
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
    return results if dist.get_rank() == 0 else None


def _rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-12)


def test_tp2_matches_single_process_and_checkpoint_reshards():
    from megatron.core import dist_checkpointing

    directory = tempfile.mkdtemp(prefix="heterogeneous_tp2_")
    results = run_on_ranks(_rank_body, 2, directory, timeout=300)[0]
    init_single_rank()
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
