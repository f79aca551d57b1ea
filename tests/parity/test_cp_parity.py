"""Context parallelism vs one process (fp32, gloo, CPU): losses and every gradient.

One launch at world size 4 loops over the layouts below, re-initialising parallel_state for each: CP=4 and
CP=2 (with TP=2, +SP, and with DP=2) with every `cp_comm_type`, documents (`--reset-attention-mask` style
packed params) and packed THD sequences under CP, CP=2 x PP=2 through the 1F1B schedule, CP=2 x DP=2 with
the distributed optimizer and per-token loss through the no-pipelining schedule. Each rank starts from the
reference model's weights (TP-sliced), runs forward and backward on its CP chunk, and returns its gradients;
the parent compares them with the single-process model on the whole batch. The reference for documents is
the explicit dense [s, s] mask through the local spec (an independent path), for THD every sequence run
on its own.

Tolerance: 1e-5 of each gradient's largest entry (the task's bound); losses 1e-6 relative. Only the order of
floating-point sums differs (the online-softmax merge, CP/TP reductions); the worst seen is printed.

Two more checks in the same launch: attention dropout under ring attention (math path, fp64) has exactly the
gradient of its own forward (a central difference along a random direction with the same dropout masks);
with --reset-attention-mask every pipeline stage (PP=4, the middle ones too) reads the batch and receives the
documents (`get_gpt_batch_with_documents`, `pretrain_gpt.is_dataset_built_on_rank`).
"""
import functools

import numpy as np
import torch
import torch.nn.functional as F

from tests.harness import run_on_ranks

VOCAB, SEQ, MBS, HIDDEN, HEADS, GROUPS, LAYERS = 96, 32, 2, 32, 8, 2, 2
GRAD_TOL, LOSS_TOL = 1e-5, 1e-6

# name, parallel sizes, cp_comm_type, data kind ("plain", "docs", "thd"), model kind, extra. Without
# --calculate-per-token-loss each CP rank minimises its own token mean (as in Megatron), which equals the
# global mean only when every CP chunk has as many loss tokens: that case uses a full loss mask.
CASES = [
    ("cp4-p2p", dict(cp=4), "p2p", "plain", "llama", {}),
    ("cp4-all_gather-docs", dict(cp=4), "all_gather", "docs", "llama", {}),
    ("cp4-a2a", dict(cp=4), "a2a", "plain", "llama", {}),
    ("cp4-a2a+p2p", dict(cp=4, hcp=[2, 2]), "a2a+p2p", "docs", "llama", {}),
    ("cp4-p2p-docs", dict(cp=4), "p2p", "docs", "gpt", {}),
    ("cp4-a2a-docs", dict(cp=4), "a2a", "docs", "llama", {}),
    ("cp4-all_gather", dict(cp=4), "all_gather", "plain", "gpt", {}),
    ("cp4-p2p-thd", dict(cp=4), "p2p", "thd", "llama", {}),
    ("cp2-dp2-p2p", dict(cp=2), "p2p", "plain", "gpt", {}),
    ("cp2-dp2-all_gather-docs", dict(cp=2), "all_gather", "docs", "llama", {}),
    ("cp2-dp2-a2a-thd", dict(cp=2), "a2a", "thd", "llama", {}),
    ("cp2-dp2-a2a+p2p", dict(cp=2, hcp=[2, 1]), "a2a+p2p", "plain", "llama", {}),
    ("cp2-tp2-p2p", dict(cp=2, tp=2), "p2p", "plain", "llama", {}),
    ("cp2-tp2-sp-p2p-docs", dict(cp=2, tp=2, sp=True), "p2p", "docs", "llama", {}),
    ("cp2-tp2-sp-all_gather", dict(cp=2, tp=2, sp=True), "all_gather", "plain", "gpt", {}),
    ("cp2-tp2-a2a-docs", dict(cp=2, tp=2), "a2a", "docs", "llama", {}),
    ("cp2-tp2-sp-a2a+p2p", dict(cp=2, tp=2, sp=True, hcp=[1, 2]), "a2a+p2p", "plain", "llama", {}),
    ("cp2-tp2-p2p-docs-full-recompute", dict(cp=2, tp=2), "p2p", "docs", "llama", dict(recompute=True)),
    ("cp1-docs", dict(cp=1), None, "docs", "llama", {}),
    ("cp1-thd", dict(cp=1), None, "thd", "gpt", {}),
    ("cp2-pp2-p2p-1f1b", dict(cp=2, pp=2), "p2p", "plain-full-mask", "gpt", dict(schedule=True)),
    ("cp2-dp2-distopt-per-token-docs", dict(cp=2), "p2p", "docs", "llama",
     dict(schedule=True, distopt=True, per_token=True)),
    ("cp2-pp2-a2a-per-token-docs", dict(cp=2, pp=2), "a2a", "docs", "llama", dict(schedule=True, per_token=True)),
]
THD_LENGTHS = [8, 16, 8]  # packed row of 32 tokens, every length a multiple of 2 x CP (4 x 2)


def _config(kind, layers=LAYERS, tp=1, pp=1, cp=1, sp=False, cp_comm_type=None, hcp=None, per_token=False,
            recompute=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1, pipeline_dtype=torch.float32,
              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
              sequence_parallel=sp, cp_comm_type=cp_comm_type, hierarchical_context_parallel_sizes=hcp,
              calculate_per_token_loss=per_token)
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if kind == "llama":
        kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  num_query_groups=GROUPS, ffn_hidden_size=64)
    return TransformerConfig(**kw)


def _model(config, kind, pre_process=True, post_process=True):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=kind == "gpt",
                    position_embedding_type="rope" if kind == "llama" else "learned_absolute")


def _batch(data, seed=0):
    """tokens, labels, loss mask, positions ([b, s]) and, for documents, the document ids ([b, s])."""
    g = torch.Generator().manual_seed(100 + seed)
    rows = 1 if data == "thd" else MBS
    tokens = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    loss_mask = (torch.rand(rows, SEQ, generator=g) > 0.2).float()
    if data == "plain-full-mask":
        loss_mask = torch.ones_like(loss_mask)
    positions = torch.arange(SEQ).unsqueeze(0).expand(rows, SEQ).contiguous()  # [s] -> [b, s]
    docs = None
    if data == "docs":  # EODs (id 0) at fixed places: documents of lengths 7, 10, 1, 14 and 20, 12
        tokens[0, [6, 16, 17]] = 0
        tokens[1, 19] = 0
        from megatron.training.utils import document_ids_from_tokens

        docs = document_ids_from_tokens(tokens, 0)
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions, docs=docs)


def _thd_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(np.cumsum([0] + THD_LENGTHS), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(THD_LENGTHS),
                           max_seqlen_kv=max(THD_LENGTHS))


# ---------------------------------------------------------------- reference (parent process)

def _reference(kind, data):
    """(initial state, loss, {name: grad}) of the single-process model on the whole batch."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    model = _model(_config(kind), kind)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    batch = _batch(data)
    if data == "thd":
        pieces, start = [], 0
        for length in THD_LENGTHS:  # every packed sequence on its own
            pieces.append(model(batch["tokens"][:, start:start + length], torch.arange(length)[None], None,
                                labels=batch["labels"][:, start:start + length]))
            start += length
        losses = torch.cat(pieces, dim=1)
    else:
        mask = None
        if data == "docs":
            docs = batch["docs"]
            causal = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))
            mask = ~(causal[None] & (docs[:, :, None] == docs[:, None, :]))[:, None]  # True = masked
        losses = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return state, loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------- ranks

def _slice(param, full):
    """This TP rank's part of a full tensor (strided partitions interleaved as the layers split them)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    stride = getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, tp * stride, dim=param.partition_dim)
    return torch.cat([pieces[j * tp + rank] for j in range(stride)], dim=param.partition_dim)


def _layer_name(module, name, tied):
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(module.decoder.layers[int(parts[2])].layer_number - 1)
    if tied and parts[0] == "output_layer":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def _load(model, state, kind):
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_slice(param, state[_layer_name(model, name, kind == "gpt")]))


def _local_batch(data, seed=0):
    """This rank's CP part of the batch and the packed params (documents / THD), like pretrain_gpt."""
    from megatron.core import parallel_state as ps
    from megatron.core.context_parallel.layout import thd_partitioned_indices, thd_positions
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megatron.training.utils import document_packed_seq_params

    batch = _batch(data, seed)
    docs = batch.pop("docs")
    if data == "thd":
        params = _thd_params()
        index = thd_partitioned_indices(params.cu_seqlens_q, SEQ, ps.get_context_parallel_world_size(),
                                        ps.get_context_parallel_rank())
        batch["position_ids"] = thd_positions(torch.arange(SEQ), params.cu_seqlens_q)[None]
        return {k: v[:, index] for k, v in batch.items()}, params, batch["loss_mask"].sum()
    params = document_packed_seq_params(docs) if docs is not None else None
    total = batch["loss_mask"].sum()
    return get_batch_on_this_cp_rank(batch), params, total


def _grads_out(modules, kind, grad_attr="grad"):
    from megatron.core import parallel_state as ps

    out = []
    for module in modules:
        for name, param in module.named_parameters():
            grad = getattr(param, grad_attr)
            part = (getattr(param, "partition_dim", None), getattr(param, "partition_stride", 1)) \
                if getattr(param, "tensor_model_parallel", False) else None
            out.append((_layer_name(module, name, kind == "gpt"), part, ps.get_tensor_model_parallel_rank(),
                        ps.get_tensor_model_parallel_world_size(), grad.detach().numpy().copy()))
    return out


def _direct_case(kind, data, config, state):
    """Forward/backward outside the schedules: grads summed over CP (loss = local sum / global count)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import all_reduce_tensor

    model = _model(config, kind)
    _load(model, state, kind)
    batch, params, total = _local_batch(data)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    loss = (losses * batch["loss_mask"]).sum() / total
    loss.backward()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and config.tensor_model_parallel_size > 1:
            all_reduce_tensor(param.grad, ps.get_tensor_model_parallel_group())
        dist.all_reduce(param.grad, group=ps.get_context_parallel_group())
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=ps.get_context_parallel_group())
    return dict(loss=reported.item(), grads=_grads_out([model], kind))


def _schedule_case(kind, data, config, state, extra):
    """One iteration through get_forward_backward_func with DDP, finalize_model_grads and (optionally) the
    distributed optimizer: DDP reduces over DP x CP, the per-token loss divides by the DP x CP token count."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _model(config, kind, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    _load(model, state, kind)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=extra.get("distopt", False), bucket_size=2000), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = None
    if extra.get("distopt"):  # plain SGD with lr 1: the update is the gradient, read back from the params
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=True), [ddp],
            use_gloo_process_groups=False)
    batch, params, _ = _local_batch(data)

    def forward_step(iterator, chunk):
        item = next(iterator)
        output = chunk(item["tokens"], item["position_ids"], None, labels=item["labels"], packed_seq_params=params)

        def loss_func(output_tensor):
            summed = (output_tensor.float().view(-1) * item["loss_mask"].view(-1)).sum()
            count = item["loss_mask"].sum().to(torch.int)
            return summed, count, {"lm loss": torch.stack([summed.detach(), count.detach().float()])}
        return output, loss_func

    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=ddp,
                                          num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
    loss = None
    if reports:
        total = reports[0]["lm loss"].clone()
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        loss = (total[0] / total[1]).item()
    grads = _grads_out([model], kind, "main_grad")
    if optimizer is not None:  # the distributed optimizer steps from the reduce-scattered shards
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        steps = {n: before[n] - p.detach() for n, p in model.named_parameters()}
        grads = [(name, part, r, t, steps[n].numpy()) for (name, part, r, t, _), (n, _) in
                 zip(grads, model.named_parameters())]
    return dict(loss=loss, grads=grads)


def _dropout_gradient_check():
    """Ring attention with dropout (fp64, CP=4): the analytic gradient equals a central difference."""
    from megatron.core import parallel_state as ps
    from megatron.core.context_parallel.attention import context_parallel_attention
    from megatron.core.context_parallel.layout import sequence_layout

    ps.initialize_model_parallel(context_parallel_size=4)
    try:
        group = ps.get_context_parallel_group()
        g = torch.Generator().manual_seed(5)
        full = [torch.randn(SEQ, MBS, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2)]
        index = sequence_layout(None, SEQ // 4, MBS, 4, "cpu").held(ps.get_context_parallel_rank())
        q, k, v = (t[index].requires_grad_() for t in full)
        weight = torch.randn(SEQ, MBS, 4, 8, generator=g, dtype=torch.float64)[index]
        layout = sequence_layout(None, SEQ // 4, MBS, 4, "cpu")

        def loss_at(eps, direction):
            torch.manual_seed(123 + ps.get_context_parallel_rank())
            inputs = [x + eps * d for x, d in zip((q, k, v), direction)]
            out = context_parallel_attention(*inputs, layout, "p2p", group, scale=0.3, dropout_p=0.3)
            return (out * weight).sum()

        zero = [torch.zeros_like(x) for x in (q, k, v)]
        grads = torch.autograd.grad(loss_at(0.0, zero), (q, k, v))
        direction = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (q, k, v)]
        with torch.no_grad():
            numeric = (loss_at(1e-5, direction) - loss_at(-1e-5, direction)) / 2e-5
        analytic = sum((gr * d).sum() for gr, d in zip(grads, direction))
        totals = torch.stack([numeric, analytic])
        import torch.distributed as dist

        dist.all_reduce(totals, group=group)
        return totals.tolist()
    finally:
        ps.destroy_model_parallel()


def _documents_on_every_pipeline_stage():
    """PP=4: with --reset-attention-mask every stage (the middle ones too) reads the batch and gets the
    documents; without it the middle stages get nothing. Returns per stage what arrived."""
    import argparse

    import pretrain_gpt
    from megatron.core import parallel_state as ps
    from megatron.training import global_vars
    from megatron.training.utils import get_gpt_batch_with_documents

    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    seen = {}
    try:
        global_vars._GLOBAL_TOKENIZER = argparse.Namespace(eod=0)
        for reset in (True, False):
            global_vars.set_args(argparse.Namespace(micro_batch_size=MBS, seq_length=SEQ, reset_attention_mask=reset,
                                                    mtp_num_layers=None))
            batch = _batch("docs")
            data = {k: v for k, v in batch.items() if k != "docs"}
            tokens, labels, _, mask, _, params = get_gpt_batch_with_documents(iter([data]))
            seen[reset] = dict(tokens=tokens is not None, labels=labels is not None, mask=mask is not None,
                               built=pretrain_gpt.is_dataset_built_on_rank(),
                               cu=None if params is None else params.cu_seqlens_q.tolist())
    finally:
        global_vars._GLOBAL_TOKENIZER = None
        global_vars.set_args(None)
        ps.destroy_model_parallel()
    return seen


def _worker(cases, states):
    import time

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    results, start = {}, time.time()
    for (name, sizes, comm, data, kind, extra), state in zip(cases, states):
        ps.initialize_model_parallel(tensor_model_parallel_size=sizes.get("tp", 1),
                                     pipeline_model_parallel_size=sizes.get("pp", 1),
                                     context_parallel_size=sizes["cp"],
                                     hierarchical_context_parallel_sizes=sizes.get("hcp"),
                                     create_gloo_process_groups=False)
        try:
            model_parallel_cuda_manual_seed(11)
            config = _config(kind, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes["cp"],
                             sp=sizes.get("sp", False), cp_comm_type=comm, hcp=sizes.get("hcp"),
                             per_token=extra.get("per_token", False), recompute=extra.get("recompute", False))
            run = functools.partial(_schedule_case, extra=extra) if extra.get("schedule") else _direct_case
            results[name] = run(kind, data, config, state)
        finally:
            ps.destroy_model_parallel()
    results["_dropout"] = _dropout_gradient_check()
    results["_stages"] = _documents_on_every_pipeline_stage()
    results["_seconds"] = time.time() - start
    return results


def _compare(name, per_rank, ref_loss, ref_grads):
    worst, covered = 0.0, set()
    for rank, result in enumerate(per_rank):
        got = result[name]
        if got["loss"] is not None:
            assert abs(got["loss"] - ref_loss) <= LOSS_TOL * abs(ref_loss), (name, rank, got["loss"], ref_loss)
        for param_name, part, tp_rank, tp, grad in got["grads"]:
            want = ref_grads[param_name]
            if part is not None:
                dim, stride = part
                pieces = torch.chunk(want, tp * stride, dim=dim)
                want = torch.cat([pieces[j * tp + tp_rank] for j in range(stride)], dim=dim)
            scale = want.abs().max().item()
            err = (torch.from_numpy(grad) - want).abs().max().item() / max(scale, 1e-12)
            worst = max(worst, err)
            assert err <= GRAD_TOL, f"{name} rank {rank} {param_name}: gradient error {err:.2e} (relative to max)"
            covered.add(param_name)
    assert covered == set(ref_grads), (name, set(ref_grads) - covered)
    return worst


def test_context_parallel_matches_single_process():
    references = {(kind, data): _reference(kind, data) for _, _, _, data, kind, _ in CASES}
    states = [references[(kind, data)][0] for _, _, _, data, kind, _ in CASES]
    per_rank = run_on_ranks(_worker, 4, CASES, states, timeout=500)
    print(f"rank work: {per_rank[0]['_seconds']:.1f}s")
    for name, _, _, data, kind, _ in CASES:
        _, ref_loss, ref_grads = references[(kind, data)]
        print(f"{name}: worst gradient error {_compare(name, per_rank, ref_loss, ref_grads):.1e}")
    numeric, analytic = per_rank[0]["_dropout"]
    assert abs(numeric - analytic) <= 1e-6 * max(abs(analytic), 1.0), (numeric, analytic)
    # documents 7, 10, 1, 14 in row 0 and 20, 12 in row 1 (flattened over b * s)
    cu = [0, 7, 17, 18, 32, 52, 64]
    for stage, seen in enumerate(r["_stages"] for r in per_rank):
        assert seen[True] == dict(tokens=stage == 0, labels=stage == 3, mask=False, built=True, cu=cu), (stage, seen)
        middle = stage in (1, 2)
        assert seen[False] == dict(tokens=stage == 0, labels=stage == 3, mask=False, built=not middle, cu=None)
