"""A tiny model with the Megatron attributes data parallelism relies on, and a training loop to compare
data-parallel runs with a single-process reference.

`ToyLM` embeds token ids, runs a few Linear+tanh layers and projects back onto the (tied) embedding,
like a GPT without attention. It exposes `config`, `pre_process`/`post_process`,
`share_embeddings_and_output_weights` and `shared_embedding_or_output_weight()`, and marks the tied
weight `shared_embedding`, as Megatron's LanguageModule does. With `fused_wgrad` the first layer's
weight gradient is added straight into `weight.main_grad` the way Megatron's gradient-accumulation
fusion does ("dummy" returns a zero gradient and flags `grad_added_to_main_grad`, "none" returns None).
"""
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

VOCAB, LAYERS, SEQ = 32, 3, 8


@dataclass
class ToyConfig:
    """The TransformerConfig fields DDP and finalize_model_grads read."""

    calculate_per_token_loss: bool = False
    """Per-token loss: no 1/DP pre-scaling, grads divided by the global token count."""

    sequence_parallel: bool = False
    """Sequence parallelism: TP all-reduce of params marked `sequence_parallel`."""

    timers: Optional[object] = None
    """Timers object (none)."""

    barrier_with_L1_time: bool = False
    """Barrier before level-1 timers."""


class _FusedWgradLinear(torch.autograd.Function):
    """Forward: x @ w.T + b; backward: adds dW into w.main_grad like gradient-accumulation fusion."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode):
        ctx.save_for_backward(x, weight)
        ctx.mode = mode
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # [b, s, h] -> [b*s, h]
        weight.main_grad.add_(grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        grad_weight = None
        if ctx.mode == "dummy":
            weight.grad_added_to_main_grad = True
            grad_weight = torch.zeros_like(weight)
        return grad_out @ weight, grad_weight, grad_out.sum(dim=(0, 1)), None


class ToyLM(torch.nn.Module):
    """Embedding -> LAYERS x (Linear, tanh) -> logits through the tied embedding."""

    def __init__(self, config: ToyConfig, hidden: int = 16, dtype=torch.float32, fused_wgrad: Optional[str] = None):
        super().__init__()
        self.config = config
        self.pre_process = True
        self.post_process = True
        self.share_embeddings_and_output_weights = True
        self.fused_wgrad = fused_wgrad
        self.embedding = torch.nn.Embedding(VOCAB, hidden, dtype=dtype)
        self.embedding.weight.shared_embedding = True
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, dtype=dtype) for _ in range(LAYERS))
        self.final_scale = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.frozen = torch.nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=False)

    def shared_embedding_or_output_weight(self):
        """The word-embedding weight that is also the output projection."""
        return self.embedding.weight

    def forward(self, tokens):
        hidden = self.embedding(tokens)  # [b, s, h]
        for index, layer in enumerate(self.layers):
            if index == 0 and self.fused_wgrad is not None:
                hidden = torch.tanh(_FusedWgradLinear.apply(hidden, layer.weight, layer.bias, self.fused_wgrad))
            else:
                hidden = torch.tanh(layer(hidden))
        hidden = hidden * self.final_scale
        return hidden @ self.embedding.weight.t()  # [b, s, h] -> [b, s, v]


def global_batches(num_steps: int, global_batch: int, seed: int = 1234) -> List[Dict[str, torch.Tensor]]:
    """Fixed token batches (and a loss mask with some zeros) shared by every run."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=gen)
        mask = (torch.rand(global_batch, SEQ, generator=gen) > 0.2).float()
        batches.append({"tokens": tokens, "mask": mask})
    return batches


def microbatch_loss(model, tokens, mask):
    """Masked LM loss of one microbatch as (sum over tokens, number of tokens)."""
    logits = model(tokens[:, :-1])
    # [b, s, v] -> [b*s, v]
    losses = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum(), mask.sum()


def single_rank_groups():
    """Process groups of size one for every rank (for an in-launch DP=1 reference); all ranks must call."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mine = groups[dist.get_rank()]
    grad_pgs = SimpleNamespace(dp=mine, dp_cp=mine, intra_dp_cp=mine)
    model_pgs = SimpleNamespace(tp=mine, pp=mine)
    finalize_pgs = SimpleNamespace(tp=mine, pp=mine, dp_cp=mine, embd=None, pos_embd=None)
    return SimpleNamespace(grad=grad_pgs, model=model_pgs, finalize=finalize_pgs, dp=mine)


def build(ddp_kwargs: dict, opt_kwargs: Optional[dict] = None, config=None, dtype=torch.float32, seed=0,
          hidden=16, fused_wgrad=None, groups=None, device="cpu"):
    """Model (same init on every rank), DDP wrapper and Megatron optimizer.

    `groups` (from `single_rank_groups`) builds a DP=1 reference inside a multi-rank launch.
    """
    opt_kwargs = dict(opt_kwargs or {})
    config = config or ToyConfig()
    torch.manual_seed(seed)
    model = ToyLM(config, hidden=hidden, dtype=dtype, fused_wgrad=fused_wgrad).to(device)
    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    pgs = {} if groups is None else {"grad_comm_pgs": groups.grad, "model_comm_pgs": groups.model}
    ddp = DistributedDataParallel(config, ddp_config, model, **pgs)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=opt_kwargs.pop("lr", 1e-2),
        clip_grad=opt_kwargs.pop("clip_grad", 1.0),
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        bf16=dtype == torch.bfloat16,
        **opt_kwargs,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    for group in optimizer.param_groups:
        # What OptimizerParamScheduler does: no weight decay on biases and 1-D params.
        group["weight_decay"] = opt_config.weight_decay * group["wd_mult"]
    return model, ddp, optimizer


def train_steps(ddp, optimizer, batches, num_micro: int, per_token: bool = False, groups=None, probe=None):
    """One optimizer step per batch; this rank uses its DP slice, split into `num_micro` microbatches
    (all but the last inside `no_sync`). Returns the global loss (sum / count) of every step.

    `probe(step, micro)` runs after each microbatch's backward (for checks on communication state).
    """
    dp_group = parallel_state.get_data_parallel_group() if groups is None else groups.dp
    dp_size, dp_rank = dp_group.size(), dist.get_rank(dp_group)
    device = next(ddp.parameters()).device
    losses = []
    for step, batch in enumerate(batches):
        tokens = batch["tokens"].chunk(dp_size)[dp_rank].to(device)
        mask = batch["mask"].chunk(dp_size)[dp_rank].to(device)
        global_count = batch["mask"].sum().to(device)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        pieces = list(zip(tokens.chunk(num_micro), mask.chunk(num_micro)))
        loss_sum = torch.zeros(2, device=device)
        for micro, (tok, msk) in enumerate(pieces):
            with ddp.no_sync() if micro < len(pieces) - 1 else nullcontext():
                total, count = microbatch_loss(ddp, tok, msk)
                # Per-token: finalize_model_grads divides by the global count; else DDP divides by DP.
                scaled = total if per_token else total * dp_size / global_count
                scaled.backward()
            if probe is not None:
                probe(step, micro)
            loss_sum += torch.stack([total.detach(), count])
        finalize_pgs = None if groups is None else groups.finalize
        finalize_model_grads([ddp], num_tokens=mask.sum().clone() if per_token else None, pg_collection=finalize_pgs)
        optimizer.step()
        dist.all_reduce(loss_sum, group=dp_group)
        losses.append((loss_sum[0] / loss_sum[1]).item())
    return losses


def params_of(model) -> Dict[str, torch.Tensor]:
    """A detached fp32 copy of every parameter (for comparing runs)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """Largest per-tensor max|a-b| / max|b| over all parameters."""
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ: {sorted(a)} vs {sorted(b)}")
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer tensors per rank: Adam moments plus fp32 main params that are separate copies."""
    total = 0
    for state in optimizer.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for k, t in state.items() if torch.is_tensor(t) and k != "step")
    for group in getattr(optimizer, "shard_fp32_from_float16_groups", []):
        total += sum(t.numel() * t.element_size() for t in group)
    return total
