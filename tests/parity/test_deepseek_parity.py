"""DeepSeek-style GPT models (multi-latent attention, multi-token prediction, the V3 routing recipe) under
tensor / pipeline / expert parallelism vs one process (fp32, CPU, gloo), in ONE world-4 launch.

Cases: MLA with TP=2 (q LoRA + latent norms + YaRN, sequence parallel; and full-rank q without SP), MTP with
PP=2 (standard attention with tied embeddings: the MTP stage's embedding copy; MLA with two depths, untied),
and a tiny DeepSeek-V3-shaped model with EP=2 x TP=2 (MLA, sigmoid scores with expert bias, group-limited
top-k, seq-aux loss, a shared expert, the first layer dense via a moe_layer_freq list, one MTP depth).

Each case trains three steps through Megatron's schedule, DDP, `finalize_model_grads` and SGD on the reduced gradients in float64 (lr 0.5, no
momentum), so each step's parameter change is -lr x gradient; before every step the parallel model is loaded with
the reference's weights of that step (and expert biases), so each step compares gradients at equal weights
(without that, the ~1e-7 weight drift of float sums makes the smallest MTP gradients differ by ~4e-5); weights are compared in the global (checkpoint) layout through `sharded_state_dict()`, as in
`test_moe_parity.py` (whose helpers are reused). The reference runs all DP x M micro-batches, with the MoE and
MTP auxiliary losses scaled by 1 / (DP x M) like the main loss. Tolerances: loss <= 1e-6 relative, parameter
change <= 1e-5 relative per tensor.
"""
import copy
import functools

import torch
import torch.nn.functional as F

from tests.harness import run_on_ranks
from tests.parity.test_moe_parity import _loss_func, _relative, load_global, to_numpy

VOCAB, SEQ, MBS, HIDDEN, HEADS, FFN = 64, 8, 2, 16, 4, 24
STEPS, MICRO, LR, WORLD = 3, 2, 0.5, 4
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5

MLA = dict(q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=6,
           rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.8, qk_layernorm=True)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_router_num_groups=2, moe_router_group_topk=1,
           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
           moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=16, moe_ffn_hidden_size=12,
           moe_token_dispatcher_type="alltoall", moe_layer_freq=[0, 1])
CASES = [
    dict(name="mla-tp2-sp", tp=2, mla=MLA),
    dict(name="mla-tp2-full-rank-q-no-sp", tp=2, sp=False, mla=dict(MLA, q_lora_rank=None, qk_layernorm=False)),
    dict(name="mtp-pp2-tied", pp=2, mtp=1, tied=True),
    dict(name="mla-mtp2-pp2-untied", pp=2, mtp=2, mla=MLA, layers=2),
    dict(name="deepseek-v3-ep2-tp2", tp=2, ep=2, mla=MLA, moe=MOE, mtp=1),
]


def _case(case):
    full = dict(tp=1, pp=1, ep=1, sp=None, mla=None, moe=None, mtp=None, tied=False, layers=2)
    full.update(case)
    if full["sp"] is None:
        full["sp"] = full["tp"] > 1
    return full


def global_pieces(module):
    """[(key, global_shape, index, float64 data, is_main)] of every tensor in module.sharded_state_dict() (as
    test_moe_parity's, without rounding to fp32: the weight changes are compared in float64)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    sharded = module.sharded_state_dict()
    apply_factories(sharded)
    return [(v.key, tuple(v.global_shape), v.global_slice(), v.data.detach().clone().double(),
             is_main_replica(v.replica_id)) for v in nested_values(sharded) if isinstance(v, ShardedTensor)]


def assemble(pieces_per_rank):
    """Global float64 tensors from the main replicas; every other copy of a piece must equal the main one."""
    tensors, copies = {}, []
    for pieces in pieces_per_rank:
        for key, shape, index, data, main in pieces:
            data = torch.as_tensor(data)
            tensors.setdefault(key, torch.zeros(shape, dtype=torch.float64))
            if main:
                tensors[key][index] = data
            else:
                copies.append((key, index, data))
    for key, index, data in copies:
        diff = (tensors[key][index] - data).abs().max().item()
        assert diff <= 1e-9 * (1 + data.abs().max().item()), f"replicas of {key} disagree by {diff}"
    return tensors


def _config(case, parallel=True):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    tp, pp, ep = (case["tp"], case["pp"], case["ep"]) if parallel else (1, 1, 1)
    kwargs = dict(
        num_layers=case["layers"], hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        use_cpu_initialization=True, pipeline_dtype=torch.float64, params_dtype=torch.float64, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        init_method_std=0.2, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=tp > 1 and case["sp"], expert_model_parallel_size=ep,
        mtp_num_layers=case["mtp"], mtp_loss_scaling_factor=0.3,
    )
    kwargs.update(case["moe"] or {})
    if case["mla"] is None:
        return TransformerConfig(**kwargs)
    return MLATransformerConfig(**kwargs, **case["mla"])


def _model(case, config, pre_process=True, post_process=True):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    if case["moe"]:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention,
                                        normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if case["mtp"] else None
    return GPTModel(config, spec, VOCAB, SEQ, pre_process=pre_process, post_process=post_process,
                    position_embedding_type="rope", share_embeddings_and_output_weights=case["tied"],
                    mtp_block_spec=mtp_spec)


def _batches():
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(WORLD * MICRO):
            mask = (torch.rand(MBS, SEQ, generator=gen) > 0.2).float()
            mask[:, :2] = 1.0
            step.append(dict(tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                             labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), loss_mask=mask,
                             position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()))
        out.append(step)
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _update_expert_biases(model, config):
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    for module in model.modules():
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias.copy_(get_updated_expert_bias(
                module.local_tokens_per_expert.unsqueeze(0), module.expert_bias.unsqueeze(0),
                config.moe_router_bias_update_rate)[0])
            module.local_tokens_per_expert.zero_()


def _reference(case):
    """(losses per step, [global tensors after step 0..STEPS]) of one process over all DP x M micro-batches."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    torch.manual_seed(3)
    config = _config(case, parallel=False)
    model = _model(case, config)
    model.train()
    dp = WORLD // (case["tp"] * case["pp"])
    data = _batches()
    snapshots, losses = [assemble([global_pieces(model)])], []
    for step in range(STEPS):
        model.zero_grad()
        batches = data[step][: dp * MICRO]
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / len(batches))
        MTPLossAutoScaler.set_loss_scale(torch.ones(1) / len(batches))
        total = torch.zeros(2)
        for batch in batches:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           loss_mask=batch["loss_mask"])
            loss, num_tokens, report = _loss_func(batch["loss_mask"], output)
            (loss / num_tokens / len(batches)).backward()
            total += report["lm loss"]
        losses.append((total[0] / total[1]).item())
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= LR * param.grad
            _update_expert_biases(model, config)
        snapshots.append(assemble([global_pieces(model)]))
    return losses, snapshots


def _parallel_run(case, reference_snapshots):
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(case["tp"], case["pp"], expert_model_parallel_size=case["ep"],
                                             create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(5)
        config = _config(case)
        model = _model(case, config, pre_process=parallel_state.is_pipeline_first_stage(),
                       post_process=parallel_state.is_pipeline_last_stage())
        load_global(model, reference_snapshots[0])
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(bucket_size=200), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        dp_rank = parallel_state.get_data_parallel_rank()
        data = _batches()
        losses, snapshots = [], [to_numpy(global_pieces(model))]
        for step in range(STEPS):
            load_global(model, reference_snapshots[step])  # every step's gradient at the reference's weights
            ddp.zero_grad_buffer()
            mine = data[step][dp_rank * MICRO:(dp_rank + 1) * MICRO]
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(mine), model=ddp, num_microbatches=MICRO,
                seq_length=SEQ, micro_batch_size=MBS)
            with torch.no_grad():  # SGD on the reduced gradients (the optimizer's grad norm is fp32-only)
                for param in ddp.module.parameters():
                    grad = getattr(param, "main_grad", None)
                    if grad is not None:
                        param -= LR * grad
            if reports:
                total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
                dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
                losses.append((total[0] / total[1]).item())
            snapshots.append(to_numpy(global_pieces(model)))
        return dict(losses=losses or None, snapshots=snapshots)
    finally:
        parallel_state.destroy_model_parallel()


def _worker(cases, snapshots):
    return [_parallel_run(case, case_snapshots) for case, case_snapshots in zip(cases, snapshots)]


def _check(case, reference, per_rank, report):
    ref_losses, ref_snapshots = reference
    previous = assemble([r["snapshots"][0] for r in per_rank])
    assert set(previous) == set(ref_snapshots[0]), case["name"]
    for key, tensor in previous.items():
        assert torch.allclose(tensor, ref_snapshots[0][key]), f"{case['name']}: initial {key} differs"
    losses = [r["losses"] for r in per_rank if r["losses"] is not None]
    assert losses, case["name"]
    for got in losses:
        for step, (g, w) in enumerate(zip(got, ref_losses)):
            assert abs(g - w) <= LOSS_TOL * abs(w), f"{case['name']} step {step}: loss {g} vs {w}"
    worst, changed = 0.0, 0
    for step in range(1, STEPS + 1):
        current = assemble([r["snapshots"][step] for r in per_rank])
        for key in current:
            want = ref_snapshots[step][key] - ref_snapshots[step - 1][key]
            if want.abs().max() == 0:
                continue
            changed += 1
            rel = _relative(current[key] - ref_snapshots[step - 1][key], want)
            worst = max(worst, rel)
            assert rel <= GRAD_TOL, f"{case['name']} step {step} {key}: relative gradient difference {rel:.2e}"
    assert changed, case["name"]
    report[case["name"]] = worst


def test_deepseek_parity_world4():
    cases = [_case(c) for c in CASES]
    references = [_reference(c) for c in cases]
    for case, (_, snapshots) in zip(cases, references):
        keys = set(snapshots[0])
        if case["mla"]:
            assert any(k.endswith("self_attention.linear_kv_down_proj.weight") for k in keys), case["name"]
        if case["mtp"]:
            assert any(k.startswith("mtp.layers.0.eh_proj") for k in keys), case["name"]
    results = run_on_ranks(_worker, WORLD, cases, [copy.deepcopy(r[1][:STEPS]) for r in references], timeout=300)
    report = {}
    for index, case in enumerate(cases):
        _check(case, references[index], [r[index] for r in results], report)
    print("worst relative gradient difference per case:", {k: f"{v:.1e}" for k, v in report.items()})
