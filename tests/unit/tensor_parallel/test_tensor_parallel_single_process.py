"""Tensor-parallel pieces that need no processes: TP=1 layers, CPU init slicing, attributes, helpers."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.process_groups_config import ModelCommProcessGroups, get_tensor_model_parallel_group_if_none
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabUtility,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from megatron.core.utils import init_method_normal


def test_cpu_init_takes_strided_partitions_of_the_master_weight():
    def init(t):
        with torch.no_grad():
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t))

    master = torch.arange(8 * 3, dtype=torch.float).view(8, 3)
    for rank in range(2):
        w = torch.empty(4, 3)
        _initialize_affine_weight_cpu(w, 8, 3, 4, 0, init, stride=2, rank=rank, world_size=2)
        # stride 2: pieces of 2 rows [p0 p1 p2 p3]; rank r holds pieces r and r+2 (e.g. gate_r and up_r)
        assert torch.equal(w, torch.cat([master[2 * rank:2 * rank + 2], master[4 + 2 * rank:6 + 2 * rank]]))
        assert w.partition_stride == 2 and w.partition_dim == 0
        w = torch.empty(8, 1)
        _initialize_affine_weight_cpu(w, 8, 3, 1, 1, init, rank=rank, world_size=3)
        assert torch.equal(w, master[:, rank:rank + 1])


def test_tp1_layers_match_torch_and_skip_init():
    cfg = ModelParallelConfig(use_cpu_initialization=True)
    torch.manual_seed(0)
    col = ColumnParallelLinear(6, 4, config=cfg, init_method=init_method_normal(0.3), bias=True)
    x = torch.randn(3, 2, 6, requires_grad=True)
    y, bias = col(x)
    assert bias is None
    assert torch.allclose(y, F.linear(x, col.weight, col.bias))
    assert "_extra_state" in col.state_dict()  # Transformer Engine compatible keys
    row = RowParallelLinear(4, 6, config=cfg, init_method=init_method_normal(0.3), bias=True, input_is_parallel=False,
                            skip_bias_add=True)
    out, out_bias = row(y)
    assert out_bias is row.bias and torch.allclose(out, F.linear(y, row.weight))
    no_init = ColumnParallelLinear(6, 4, config=ModelParallelConfig(perform_initialization=False), init_method=None,
                                   bias=False)
    assert no_init.weight.tensor_model_parallel and no_init.bias is None
    shared = ColumnParallelLinear(6, 4, config=cfg, init_method=None, bias=False, skip_weight_param_allocation=True)
    out, _ = shared(x, weight=col.weight)
    assert torch.allclose(out, F.linear(x, col.weight))
    with pytest.raises(RuntimeError, match="shape"):
        shared(x, weight=torch.zeros(5, 6))
    with pytest.raises(RuntimeError, match="skip_weight_param_allocation"):
        shared(x)


def test_fused_wgrad_accumulation_without_ddp_and_with_main_grad():
    torch.manual_seed(1)
    x, w = torch.randn(5, 2, 3), torch.randn(4, 3, requires_grad=True)
    w.main_grad = torch.ones(4, 3)
    y = linear_with_grad_accumulation_and_async_allreduce(x, w, None, True, False, False)
    y.sum().backward()
    expected = torch.ones(4, 2 * 5) @ x.reshape(-1, 3)
    assert torch.allclose(w.main_grad, 1 + expected) and w.grad is None
    w2 = torch.randn(4, 3, requires_grad=True)  # no main_grad: plain autograd
    linear_with_grad_accumulation_and_async_allreduce(x, w2, None, True, False, False).sum().backward()
    assert torch.allclose(w2.grad, expected)
    with pytest.raises(ValueError, match="sequence_parallel"):
        linear_with_grad_accumulation_and_async_allreduce(x, w2, None, False, True, True)


def test_cross_entropy_tp1_label_smoothing_formula():
    torch.manual_seed(2)
    logits = (torch.randn(4, 3, 10) * 4).requires_grad_()
    target = torch.randint(0, 10, (4, 3))
    eps = 0.2
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=eps)
    log_p = torch.log_softmax(logits.detach(), dim=-1)
    nll = -log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smoothing = eps * 10 / 9
    assert torch.allclose(loss, (1 - smoothing) * nll - smoothing * log_p.mean(-1), atol=1e-6)
    grad, = torch.autograd.grad(loss.sum(), logits)
    ref = logits.detach().clone().requires_grad_()
    ref_loss = F.cross_entropy(ref.view(-1, 10), target.view(-1), reduction="none", label_smoothing=smoothing)
    ref_grad, = torch.autograd.grad(ref_loss.sum(), ref)
    assert torch.allclose(grad, ref_grad, atol=1e-6)


def test_attribute_helpers_and_utils():
    p = torch.nn.Parameter(torch.zeros(2))
    set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (False, -1, 1)
    q = torch.nn.Parameter(torch.zeros(2))
    p.tensor_model_parallel = True
    copy_tensor_model_parallel_attributes(q, p)
    assert q.tensor_model_parallel and param_is_not_tensor_parallel_duplicate(q)
    assert param_is_not_tensor_parallel_duplicate(torch.nn.Parameter(torch.zeros(1)))  # TP rank 0
    assert VocabUtility.vocab_range_from_global_vocab_size(128, 3, 4) == (96, 128)
    chunks = split_tensor_along_last_dim(torch.arange(12.0).view(2, 6), 3)
    assert [c.shape[-1] for c in chunks] == [2, 2, 2]
    assert get_tensor_model_parallel_group_if_none(None) is None  # no torch.distributed: TP size 1
    with pytest.raises(ValueError, match="unknown process group"):
        ModelCommProcessGroups(tpp=None)
    assert ModelCommProcessGroups(tp=None, pp=None).tp is None


def test_rng_tracker_single_process():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    tracker = get_cuda_rng_tracker()
    model_parallel_cuda_manual_seed(7)
    assert get_cuda_rng_tracker() is tracker, "seeding keeps the tracker object modules may hold"
    states = tracker.get_states()
    assert set(states) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    # The tracked generator is CUDA's wherever CUDA is available, else the CPU's default one.
    on_cuda = torch.cuda.is_available()
    device, get_state = ("cuda", torch.cuda.get_rng_state) if on_cuda else ("cpu", torch.get_rng_state)
    before = get_state()
    with tracker.fork():
        a = torch.rand(4, device=device)
    assert torch.equal(get_state(), before), "fork restores the default stream"
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.rand(4, device=device), a)
    with pytest.raises(ValueError, match="already"):
        tracker.add("model-parallel-rng", 12345)
    with pytest.raises(KeyError):
        with tracker.fork("nope"):
            pass
    # Megatron: the first caller decides the tracker kind; later requests get the existing one.
    assert get_cuda_rng_tracker(inference_rng_tracker=True) is tracker
    model_parallel_cuda_manual_seed(7)
    assert type(get_cuda_rng_tracker()).__name__ == "CudaRNGStatesTracker"
