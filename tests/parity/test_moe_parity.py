"""Mixture-of-experts GPT models under expert / tensor / pipeline / data parallelism vs one process (fp32, CPU).

One world-4 launch runs every layout in turn (EP=4, EP=2 x TP=2 with expert TP 1 and 2, EP=2 x PP=2, EP=2 with
the distributed optimizer, capacity factors with both drop policies and padding; the allgather and the alltoall
dispatcher; SequentialMLP and GroupedMLP experts; aux / seq-aux / z losses, sigmoid routing with expert bias,
shared experts). Each starts from the single-process reference's weights and trains three steps through
Megatron's schedule, DDP, `finalize_model_grads` and optimizer (SGD, no momentum, no weight decay, no clipping),
so each step's parameter change is -lr times the gradient.

How weights and gradients are compared: both models are mapped to the global (checkpoint) layout through their
`sharded_state_dict()` (stacked layers, the expert axis, TP/ETP offsets, gated fc1 halves, GroupedMLP's
transposed experts), so the mapping itself is under test too. The parallel run's weights are loaded from the
reference's global tensors that way; after every step every rank reports its pieces of the global parameters
(copies of a piece on several ranks must agree).

Data: every data-parallel rank gets its own micro-batches; the reference runs all of them as separate
micro-batches (`DP x M` of them), so each router sees the same tokens as in the parallel run and the
auxiliary losses, the capacity and the drops are the same. With sequence parallelism the router of each TP rank
sees half the sequence: the balancing losses combine over TP (and capacity is not tested there). The per-token
loss case runs without TP: Megatron multiplies each rank's auxiliary losses by its local token count, which
under sequence parallelism is 1/TP of the sequence, so there its auxiliary gradients shrink by TP.

Tolerances: loss <= 1e-6 relative, parameter change (= gradient) <= 1e-5 relative per tensor (L2 norm of the
difference over the L2 norm of the reference change). Only the order of float sums differs (all-to-all vs
local sums, split GEMMs); the worst seen is ~3e-6 (printed with -s).
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_on_ranks

VOCAB, SEQ, MBS, HIDDEN, HEADS, LAYERS, FFN = 64, 8, 2, 16, 4, 2, 24
STEPS, MICRO, LR, DP_MAX = 3, 2, 0.5, 4
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5

BASE = dict(num_experts=4, topk=2, balancing="aux_loss", aux=1e-2, z=1e-3, shared=None, grouped=False,
            score="softmax", bias=False, capacity=None, pad=False, drop="probs", freq=1, overlap=False, recompute=None,
            per_token=False)
CASES = [
    dict(name="ep4-alltoall", ep=4, dispatcher="alltoall", num_experts=8),
    dict(name="ep4-allgather-grouped", ep=4, dispatcher="allgather", grouped=True, num_experts=8),
    dict(name="ep2-tp2-etp1-alltoall-seqaux", ep=2, tp=2, etp=1, dispatcher="alltoall", balancing="seq_aux_loss"),
    dict(name="ep2-tp2-etp1-allgather", ep=2, tp=2, etp=1, dispatcher="allgather"),
    dict(name="ep2-tp2-etp2-alltoall-grouped-shared", ep=2, tp=2, etp=2, dispatcher="alltoall", grouped=True,
         shared=16),
    dict(name="ep2-tp2-etp2-allgather", ep=2, tp=2, etp=2, dispatcher="allgather"),
    dict(name="ep2-pp2-alltoall-freq2", ep=2, pp=2, dispatcher="alltoall", freq=2, layers=4),
    dict(name="ep2-distopt-grouped-sigmoid-bias", ep=2, dispatcher="alltoall", grouped=True, distopt=True,
         score="sigmoid", bias=True, balancing="none", shared=16),
    dict(name="ep2-capacity-probs-alltoall", ep=2, dispatcher="alltoall", capacity=1.0),
    dict(name="ep2-capacity-position-allgather", ep=2, dispatcher="allgather", capacity=0.5, drop="position"),
    dict(name="ep2-capacity-pad-alltoall", ep=2, dispatcher="alltoall", capacity=1.0, pad=True),
    dict(name="ep2-tp2-etp1-shared-overlap-recompute-moe", ep=2, tp=2, etp=1, dispatcher="alltoall", shared=16,
         overlap=True, recompute=["moe"]),
    dict(name="ep4-grouped-recompute-moe-act-shared", ep=4, dispatcher="alltoall", grouped=True, shared=16,
         num_experts=8, recompute=["moe_act", "shared_experts"]),
    dict(name="ep2-per-token-loss-alltoall", ep=2, dispatcher="alltoall", per_token=True, balancing="seq_aux_loss"),
]


def _case(case):
    full = dict(BASE, tp=1, etp=None, pp=1, distopt=False, layers=LAYERS)
    full.update(case)
    return full


def _config(case, parallel=True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, pp = (case["tp"], case["pp"]) if parallel else (1, 1)
    return TransformerConfig(
        num_layers=case["layers"], hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        num_moe_experts=case["num_experts"], moe_router_topk=case["topk"],
        moe_router_load_balancing_type=case["balancing"], moe_aux_loss_coeff=case["aux"],
        moe_z_loss_coeff=case["z"], moe_shared_expert_intermediate_size=case["shared"],
        moe_grouped_gemm=case["grouped"], moe_router_score_function=case["score"],
        moe_router_enable_expert_bias=case["bias"], moe_expert_capacity_factor=case["capacity"],
        moe_pad_expert_input_to_capacity=case["pad"], moe_token_drop_policy=case["drop"],
        moe_token_dispatcher_type=case["dispatcher"], moe_layer_freq=case["freq"], init_method_std=0.2,
        moe_shared_expert_overlap=case["overlap"] and parallel,
        recompute_granularity="selective" if case["recompute"] and parallel else None,
        recompute_modules=list(case["recompute"]) if case["recompute"] and parallel else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
        expert_model_parallel_size=case["ep"] if parallel else 1,
        expert_tensor_parallel_size=(case["etp"] or tp) if parallel else 1,
        calculate_per_token_loss=case["per_token"],
    )


def _model(config, pre_process=True, post_process=True):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config, spec, VOCAB, SEQ, pre_process=pre_process, post_process=post_process,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _batches(case):
    """batches[step][dp_rank][micro] for the largest DP size; a run with DP=d uses ranks' shares of it."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(DP_MAX * MICRO):
            mask = (torch.rand(MBS, SEQ, generator=gen) > 0.2).float()
            mask[0, 0] = 1.0
            step.append(dict(tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                             labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), loss_mask=mask,
                             position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)))
        out.append(step)
    return out


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)  # [b, s] -> [b*s]
    mask = loss_mask.reshape(-1)  # [b, s] -> [b*s]
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


# ----- the global (checkpoint) view of a model --------------------------------------------------------------
def global_pieces(module):
    """[(key, global_shape, index, data, is_main)] of every tensor in module.sharded_state_dict()."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    sharded = module.sharded_state_dict()
    apply_factories(sharded)
    return [(v.key, tuple(v.global_shape), v.global_slice(), v.data.detach().clone().float(),
             is_main_replica(v.replica_id)) for v in nested_values(sharded) if isinstance(v, ShardedTensor)]


def to_numpy(pieces):
    """Pieces with numpy data (torch tensors sent between processes would be shared through file
    descriptors of the sending process, which exits)."""
    return [(key, shape, index, data.numpy(), main) for key, shape, index, data, main in pieces]


def assemble(pieces_per_rank):
    """Global tensors from the main replicas; checks every other copy of a piece equals the main one."""
    tensors, copies = {}, []
    for pieces in pieces_per_rank:
        for key, shape, index, data, main in pieces:
            data = torch.as_tensor(data)
            tensors.setdefault(key, torch.zeros(shape))
            if main:
                tensors[key][index] = data
            else:
                copies.append((key, index, data))
    for key, index, data in copies:
        diff = (tensors[key][index] - data).abs().max().item()
        assert diff <= 1e-6 * (1 + data.abs().max().item()), f"replicas of {key} disagree by {diff}"
    return tensors


def load_global(module, global_tensors):
    """Set `module`'s weights from global tensors through its sharded_state_dict (factories merged back)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    def fill(built):
        if isinstance(built, list):
            return [fill(b) for b in built]
        return global_tensors[built.key][built.global_slice()].clone()

    state = {}
    for name, value in module.sharded_state_dict().items():
        if isinstance(value, ShardedTensor):
            state[name] = fill(value)
        elif isinstance(value, ShardedTensorFactory):
            state[name] = value.merge_fn(fill(value.build()))
        elif isinstance(value, ShardedObject):
            state[name] = None
    module.load_state_dict(state, strict=True)


# ----- the single-process reference --------------------------------------------------------------------------
def _reference(case):
    """(losses per step, [global tensors after step 0..STEPS]) of the single process, all DP x M micro-batches."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
        get_updated_expert_bias,
    )

    get_moe_layer_wise_logging_tracker().clear()
    torch.manual_seed(3)
    config = _config(case, parallel=False)
    model = _model(config)
    model.train()
    dp = DP_MAX // (case["tp"] * case["pp"])
    data = _batches(case)
    snapshots, losses = [assemble([global_pieces(model)])], []
    for step in range(STEPS):
        model.zero_grad()
        batches = data[step][: dp * MICRO]
        # per-token loss: every loss (auxiliary ones included) over the global token count, as finalize_model_grads
        # divides; else each micro-batch's mean over its tokens, averaged over the micro-batches
        all_tokens = sum(b["loss_mask"].sum() for b in batches)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / (all_tokens if case["per_token"] else len(batches)))
        total = torch.zeros(2)
        for batch in batches:
            loss, num_tokens, report = _loss_func(batch["loss_mask"], model(
                batch["tokens"], batch["position_ids"], None, labels=batch["labels"]))
            (loss / all_tokens if case["per_token"] else loss / num_tokens / len(batches)).backward()
            total += report["lm loss"]
        losses.append((total[0] / total[1]).item())
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad
            for module in model.modules():
                if getattr(module, "expert_bias", None) is not None:
                    module.expert_bias.copy_(get_updated_expert_bias(
                        module.local_tokens_per_expert.unsqueeze(0), module.expert_bias.unsqueeze(0),
                        config.moe_router_bias_update_rate)[0])
                    module.local_tokens_per_expert.zero_()
        snapshots.append(assemble([global_pieces(model)]))
    return losses, snapshots


# ----- one parallel run (on the ranks) ------------------------------------------------------------------------
def _parallel_run(case, initial):
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        case["tp"], case["pp"], expert_model_parallel_size=case["ep"],
        expert_tensor_parallel_size=case["etp"] or case["tp"], create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(5)
        config = _config(case)
        model = _model(config, pre_process=parallel_state.is_pipeline_first_stage(),
                       post_process=parallel_state.is_pipeline_last_stage())
        load_global(model, initial)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            use_distributed_optimizer=case["distopt"], overlap_grad_reduce=case["distopt"], bucket_size=200), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
            use_distributed_optimizer=case["distopt"]), [ddp], use_gloo_process_groups=False)
        dp_rank = parallel_state.get_data_parallel_rank()
        data = _batches(case)
        losses, snapshots = [], [to_numpy(global_pieces(model))]
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            mine = data[step][dp_rank * MICRO:(dp_rank + 1) * MICRO]
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(mine), model=ddp, num_microbatches=MICRO,
                seq_length=SEQ, micro_batch_size=MBS)
            optimizer.step()
            if reports:
                total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
                dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
                losses.append((total[0] / total[1]).item())
            snapshots.append(to_numpy(global_pieces(model)))
        return dict(losses=losses or None, snapshots=snapshots)
    finally:
        parallel_state.destroy_model_parallel()


def _worker(cases, initials):
    return [_parallel_run(case, initial) for case, initial in zip(cases, initials)]


def _relative(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def _check(case, reference, per_rank, report):
    ref_losses, ref_snapshots = reference
    previous = assemble([r["snapshots"][0] for r in per_rank])
    for key, tensor in previous.items():
        assert torch.allclose(tensor, ref_snapshots[0][key]), f"{case['name']}: initial {key} differs"
    losses = [r["losses"] for r in per_rank if r["losses"] is not None]
    assert losses, case["name"]
    for got in losses:
        for step, (g, w) in enumerate(zip(got, ref_losses)):
            assert abs(g - w) <= LOSS_TOL * abs(w), f"{case['name']} step {step}: loss {g} vs {w}"
    worst = 0.0
    for step in range(1, STEPS + 1):
        current = assemble([r["snapshots"][step] for r in per_rank])
        assert set(current) == set(ref_snapshots[step]), case["name"]
        for key in current:
            want = ref_snapshots[step][key] - ref_snapshots[step - 1][key]
            if want.abs().max() == 0:
                continue
            rel = _relative(current[key] - previous[key], want)
            worst = max(worst, rel)
            assert rel <= GRAD_TOL, f"{case['name']} step {step} {key}: relative gradient difference {rel:.2e}"
        previous = current
    report[case["name"]] = worst


def test_moe_parity_world4():
    cases = [_case(c) for c in CASES]
    references = [_reference(c) for c in cases]
    results = run_on_ranks(_worker, 4, cases, [copy.deepcopy(r[1][0]) for r in references], timeout=300)
    report = {}
    for index, case in enumerate(cases):
        _check(case, references[index], [r[index] for r in results], report)
    print("worst relative gradient difference per case:", {k: f"{v:.1e}" for k, v in report.items()})
