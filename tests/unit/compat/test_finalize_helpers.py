"""Megatron's private helpers of `finalize_model_grads` that user code imports, on 2 gloo ranks (one launch)."""
import importlib
from types import SimpleNamespace

import torch

from tests.harness import run_on_ranks


class _Chunk(torch.nn.Module):
    """A model chunk with a tied word embedding and a learned position embedding, grads = rank + 1."""

    def __init__(self, rank):
        super().__init__()
        self.share_embeddings_and_output_weights = True
        self.word = torch.nn.Parameter(torch.zeros(3))
        self.embedding = torch.nn.Module()
        self.embedding.position_embeddings = torch.nn.Embedding(2, 2)
        self.norm = torch.nn.LayerNorm(4)
        for param in self.parameters():
            param.main_grad = torch.full_like(param, float(rank + 1))
        self.norm.weight.sequence_parallel = True

    def shared_embedding_or_output_weight(self):
        return self.word


def _check_helpers():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron.core import parallel_state
    # `megatron.core.distributed.finalize_model_grads` is the function (as in Megatron); the module is in sys.modules
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    # ... and importing the submodule first does not turn the package's `finalize_model_grads` into it
    from megatron.core.distributed import finalize_model_grads as function

    assert function is fmg.finalize_model_grads

    rank = dist.get_rank()
    config = SimpleNamespace(mtp_num_layers=None, sequence_parallel=True, qk_layernorm=False)

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    chunk = _Chunk(rank)
    assert fmg._get_shared_word_embedding_weight(chunk, config) is chunk.word
    assert fmg._get_position_embedding_weight(chunk) is chunk.embedding.position_embeddings.weight
    fmg._allreduce_word_embedding_grads([chunk], config)  # embedding group = first and last stage
    assert chunk.word.main_grad.tolist() == [3.0, 3.0, 3.0]
    fmg._allreduce_position_embedding_grads([chunk], config)  # only the first stage holds it: nothing to do
    assert torch.all(chunk.embedding.position_embeddings.weight.main_grad == rank + 1)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    fmg._allreduce_embedding_grads([chunk], config, embd_group=pp_group, pos_emb_group=pp_group, pp_group=pp_group)
    assert chunk.word.main_grad.tolist() == [6.0, 6.0, 6.0]
    assert torch.all(chunk.embedding.position_embeddings.weight.main_grad == 3.0)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    chunk = _Chunk(rank)
    fmg._allreduce_layernorm_grads([chunk], config)  # sequence-parallel norm weight summed over TP
    assert torch.all(chunk.norm.weight.main_grad == 3.0)
    assert torch.all(chunk.norm.bias.main_grad == rank + 1)  # not marked sequence_parallel
    config.sequence_parallel = False
    fmg._allreduce_layernorm_grads([chunk], config)  # without SP (and q/k norms) nothing is reduced
    assert torch.all(chunk.norm.weight.main_grad == 3.0)
    parallel_state.destroy_model_parallel()

    full = torch.arange(8.0).view(4, 2)
    plain = torch.ones(2)
    assert fmg._reshard_if_dtensor(full, plain) is full
    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    restored = fmg._reshard_if_dtensor(fmg._unshard_if_dtensor(sharded) * 2, sharded)
    assert restored.placements == sharded.placements
    torch.testing.assert_close(restored.to_local(), full[2 * rank: 2 * rank + 2] * 2)
    return True


def test_finalize_model_grads_private_helpers_on_two_ranks():
    assert run_on_ranks(_check_helpers, 2) == [True, True]
