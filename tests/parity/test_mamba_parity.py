"""Hybrid Mamba model (pattern `M*M-`: Mamba, attention, Mamba, MLP) with TP=2 + sequence parallelism, with
PP=2 (tied embeddings across stages) and with CP=2 (load-balanced sequence chunks; the mixer's all-to-all to
head shards) against the same model in one process, in ONE gloo launch of world 2.

Every rank builds the single-process reference and computes its losses and gradients, then builds each parallel
layout from the reference weights. The Mamba mixer's TP layout is not a plain chunk: each rank's `in_proj` rows
are [z_r | x_r | B_r | C_r | dt_r] and its conv channels [x_r | B_r | C_r] (Megatron's per-rank layout), sliced
here from the single-process tensors piece by piece. Losses and gradients must match to 1e-5 (fp32).
"""
import functools

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness import assert_case_reports, run_on_ranks

VOCAB, SEQ, MBS, HIDDEN, MICROBATCHES, PATTERN = 64, 16, 2, 32, 2, "M*M-"
D_INNER, GROUPS, STATE, HEADS = 2 * HIDDEN, 2, 8, 8  # head dim 8
CASES = [dict(name="tp2-sp", tp=2, pp=1, sp=True), dict(name="pp2", tp=1, pp=2, sp=False),
         dict(name="cp2", tp=1, pp=1, sp=False, cp=2)]


def _config(tp=1, pp=1, sp=False, cp=1):
    return TransformerConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                             mamba_state_dim=STATE, mamba_head_dim=8, mamba_num_groups=GROUPS,
                             normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                             pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                             is_hybrid_model=True, context_parallel_size=cp, cp_comm_type="p2p" if cp > 1 else None)


def _build(config):
    return MambaModel(config, mamba_stack_spec, VOCAB, SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage(), hybrid_override_pattern=PATTERN,
                      share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")


def _pieces(name):
    """Sizes of the pieces (each split over TP on its own) of a Mamba tensor, or None for plain tensors."""
    if name.endswith("mixer.in_proj.weight"):
        return [D_INNER, D_INNER, GROUPS * STATE, GROUPS * STATE, HEADS]
    if name.endswith("mixer.conv1d.weight") or name.endswith("mixer.conv1d.bias"):
        return [D_INNER, GROUPS * STATE, GROUPS * STATE]
    return None


def _slice(name, full, dim, tp, rank):
    """This TP rank's part of the single-process tensor `full` (dim None: not split)."""
    if dim is None:
        return full
    sizes = _pieces(name)
    if sizes is None:
        return torch.chunk(full, tp, dim=dim)[rank]
    return torch.cat([torch.chunk(piece, tp, dim=0)[rank] for piece in torch.split(full, sizes, dim=0)], dim=0)


def _batches():
    gen = torch.Generator().manual_seed(5)
    return [dict(tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                 labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                 loss_mask=(torch.rand(MBS, SEQ, generator=gen) < 0.7).float()) for _ in range(MICROBATCHES)]


def _positions():
    return torch.arange(SEQ)[None].expand(MBS, -1)


def _loss(batch, output):
    mask = batch["loss_mask"].view(-1)  # [b, s] -> [b*s]
    loss = torch.sum(output.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"loss": torch.stack([loss.detach(), tokens.detach().float()])}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["tokens"], _positions(), None, labels=batch["labels"]), functools.partial(_loss, batch)


def _reference():
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    model = _build(_config())
    outs = [_loss(b, model(b["tokens"], _positions(), None, labels=b["labels"])) for b in _batches()]
    # The schedule (no --calculate-per-token-loss) averages each microbatch over its tokens, then over microbatches.
    sum(loss / int(t) for loss, t, _ in outs).div(MICROBATCHES).backward()
    losses = [float(loss.detach()) / int(t) for loss, t, _ in outs]
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    parallel_state.destroy_model_parallel()
    return state, losses, grads


def _reference_name(model, name):
    parts = name.split(".")
    if parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + model.decoder.pp_layer_offset)
    if parts[0] == "output_layer":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def _split_dim(param):
    return getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None


def _parallel(case, state):
    parallel_state.initialize_model_parallel(case["tp"], case["pp"])
    model_parallel_cuda_manual_seed(11)
    config = _config(case["tp"], case["pp"], case["sp"])
    model = _build(config)
    tp, rank = case["tp"], parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            ref = _reference_name(model, name)
            param.copy_(_slice(ref, state[ref], _split_dim(param), tp, rank))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(_batches()), model=ddp, num_microbatches=MICROBATCHES,
        seq_length=SEQ, micro_batch_size=MBS)
    last = parallel_state.is_pipeline_last_stage()
    losses = [float(r["loss"][0] / r["loss"][1]) for r in reports] if last else None
    grads = [(_reference_name(model, name), param.main_grad.clone(), _split_dim(param))
             for name, param in model.named_parameters()]
    parallel_state.destroy_model_parallel()
    return dict(losses=losses, grads=grads, tp_rank=rank)


def _context_parallel_case(state):
    """CP=2 outside the schedules: loss = local masked sum / global token count, gradients summed over CP."""
    import torch.distributed as dist

    from megatron.core.utils import get_batch_on_this_cp_rank

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    model_parallel_cuda_manual_seed(11)
    model = _build(_config(cp=2))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[_reference_name(model, name)])
    batch = _batches()[0]
    total = batch["loss_mask"].sum()
    local = get_batch_on_this_cp_rank(dict(batch, positions=_positions().clone()))
    losses = model(local["tokens"], local["positions"], None, labels=local["labels"])
    loss = (losses * local["loss_mask"]).sum() / total
    loss.backward()
    group = parallel_state.get_context_parallel_group()
    grads = []
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)
        grads.append((_reference_name(model, name), param.grad.clone(), None))
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=group)
    parallel_state.destroy_model_parallel()
    return dict(losses=[reported.item()], grads=grads, tp_rank=0)


def _reference_one_batch(state):
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(7)
    model = _build(_config())
    model.load_state_dict(state, strict=False)
    batch = _batches()[0]
    losses = model(batch["tokens"], _positions(), None, labels=batch["labels"])
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    parallel_state.destroy_model_parallel()
    return [loss.item()], grads


def _worker():
    out = []
    for case in CASES:
        state, ref_losses, ref_grads = _reference()
        if case.get("cp", 1) > 1:
            ref_losses, ref_grads = _reference_one_batch(state)
            got = _context_parallel_case(state)
        else:
            got = _parallel(case, state)
        problems = []
        if got["losses"] is not None:
            problems += [f"{case['name']}: loss {g} != {w}" for g, w in zip(got["losses"], ref_losses)
                         if abs(g - w) > 1e-5 * max(1.0, abs(w))]
        for name, grad, dim in got["grads"]:
            want = _slice(name, ref_grads[name], dim, case["tp"], got["tp_rank"])
            diff = (grad - want).abs().max().item()
            if diff > 1e-5 * max(want.abs().max().item(), 1e-3):
                problems.append(f"{case['name']}: grad {name} differs by {diff:.3e}")
        out.append(dict(problems=problems, names={n for n, _, _ in got["grads"]}, ref_names=set(ref_grads),
                        has_losses=got["losses"] is not None))
    return out


def test_hybrid_tp2_sp_pp2_and_cp2_match_one_process():
    results = run_on_ranks(_worker, 2, timeout=400)
    assert_case_reports(CASES, results)
