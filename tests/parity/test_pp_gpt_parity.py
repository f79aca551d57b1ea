"""A tiny GPTModel trained through the pipeline schedules vs the same model in one process.

Every layout (PP=2/4 1F1B, interleaved VP=2, uneven first/last stages, tied and untied embeddings,
TP=2 combined with PP at world 4 and 8, FP8 GEMMs with the tensorwise recipe) starts from the weights
of one reference model (sliced per stage and TP rank), runs two iterations of forward/backward through
`get_forward_backward_func()` with DDP + `finalize_model_grads` (overlapped grad reduction with
`grad_sync_func` in some layouts), and a plain SGD step in between. Losses of both iterations and the
gradients of the second must match the reference to 1e-6 relative (fp32; only the summation order of
tied-embedding and TP reductions differs; the FP8 case is compared with the single-process FP8 model,
its weight gradients going into DDP's main_grad through the FP8 linear's sink).
"""
import functools

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness import run_on_ranks, tp_slice
from tests.unit.transformer.model_setup import apply_plan

VOCAB, SEQ, MBS, HIDDEN, HEADS = 128, 16, 2, 32, 4
LR, ITERATIONS = 0.5, 2

CASES_4 = [
    dict(name="pp4-1f1b-untied-dealloc", pp=4, layers=4, m=4, tied=False, dealloc=True),
    dict(name="pp2-1f1b-tied-overlap", pp=2, layers=4, m=3, tied=True, overlap=True),
    dict(name="pp2-vp2-tied-overlap", pp=2, vp=2, layers=4, m=4, tied=True, overlap=True),
    dict(name="pp4-uneven-tied", pp=4, layers=6, m=5, tied=True, first=1, last=1),
    dict(name="tp2-pp2-tied", tp=2, pp=2, layers=4, m=3, tied=True),
    dict(name="pp2-fp8-tied-overlap", pp=2, layers=4, m=3, tied=True, overlap=True, fp8=True),
]
CASES_8 = [
    dict(name="tp2-pp4-untied-dealloc", tp=2, pp=4, layers=4, m=4, tied=False, dealloc=True),
    dict(name="tp2-sp-pp2-vp2-tied", tp=2, pp=2, vp=2, layers=4, m=4, tied=True, sp=True),
]


def _config(case, **parallel):
    return TransformerConfig(
        num_layers=case["layers"],
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_layers_in_first_pipeline_stage=case.get("first"),
        num_layers_in_last_pipeline_stage=case.get("last"),
        deallocate_pipeline_outputs=case.get("dealloc", False),
        fp8="hybrid" if case.get("fp8") else None,
        fp8_recipe="tensorwise",
        gradient_accumulation_fusion=bool(case.get("fp8")),
        **parallel,
    )


def _reference_model(case):
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    config = _config(dict(case, first=None, last=None))
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=case["tied"])
    return apply_plan(model)[0]


def _batches(num_microbatches):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(num_microbatches):
        mask = (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()
        mask[0, 0] = 1.0
        out.append(dict(
            tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
            labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
            loss_mask=mask,
            position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),  # [s] -> [b, s]
        ))
    return out


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)  # [b, s] -> [b*s]
    mask = loss_mask.view(-1)  # [b, s] -> [b*s]
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _reference_name(module, name, tied):
    """Name in the single-stage reference of a stage parameter (layers renumbered globally)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = module.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    if tied and parts[0] == "output_layer":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def _stage_chunks(case, config, reference_state):
    vp = case.get("vp")
    chunks = []
    for vp_stage in range(vp or 1):
        stage = None if vp is None else vp_stage
        model = GPTModel(
            config, get_gpt_layer_local_spec(), VOCAB, SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=case["tied"], vp_stage=stage,
        )
        apply_plan(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(tp_slice(param, reference_state[_reference_name(model, name, case["tied"])]))
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=case.get("overlap", False))
        chunks.append(DistributedDataParallel(config, ddp_config, model, disable_bucketing=vp_stage > 0))
    return chunks


def _train(case, chunks, config, forward_backward):
    losses = []
    batches = _batches(case["m"])
    for _ in range(ITERATIONS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        reports = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=[iter(batches) for _ in chunks] if case.get("vp") else iter(batches),
            model=chunks if case.get("vp") else chunks[0],
            num_microbatches=case["m"],
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        losses.append([float(r["lm loss"][0]) for r in reports])
        if len(losses) < ITERATIONS:
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param -= LR * param.main_grad
    return losses


def _reference_state(case):
    return {k: v.detach().clone() for k, v in _reference_model(case).state_dict().items() if isinstance(v, torch.Tensor)}


def _run_case(case, reference_state):
    tp, pp, vp = case.get("tp", 1), case["pp"], case.get("vp")
    parallel_state.initialize_model_parallel(tp, pp, vp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(11)
    config = _config(case, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                     virtual_pipeline_model_parallel_size=vp, sequence_parallel=case.get("sp", False))
    chunks = _stage_chunks(case, config, reference_state)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks] if vp else chunks[0].no_sync
    if case.get("overlap"):
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if vp else chunks[0].start_grad_sync
    losses = _train(case, chunks, config, get_forward_backward_func())
    grads = []
    for chunk in chunks:
        module = chunk.module
        for name, param in module.named_parameters():
            grads.append((_reference_name(module, name, case["tied"]), getattr(param, "partition_dim", None)
                          if getattr(param, "tensor_model_parallel", False) else None,
                          parallel_state.get_tensor_model_parallel_rank(), tp, param.main_grad.numpy().copy()))
    last = parallel_state.is_pipeline_last_stage()
    parallel_state.destroy_model_parallel()
    return dict(losses=losses if last else None, grads=grads)


def _worker(cases, states):
    return [_run_case(case, state) for case, state in zip(cases, states)]


def _reference(case):
    model = _reference_model(case)
    batches = _batches(case["m"])
    losses = []
    for _ in range(ITERATIONS):
        model.zero_grad()
        iteration = []
        for batch in batches:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss, num_tokens, _ = _loss_func(batch["loss_mask"], output)
            (loss / num_tokens / len(batches)).backward()
            iteration.append(float(loss.detach()))
        losses.append(iteration)
        if len(losses) < ITERATIONS:
            with torch.no_grad():
                for param in model.parameters():
                    param -= LR * param.grad
    return losses, {name: p.grad for name, p in model.named_parameters()}


def _check(case, per_rank):
    ref_losses, ref_grads = _reference(case)
    covered = set()
    for rank, result in enumerate(per_rank):
        if result["losses"] is not None:
            for got, want in zip(result["losses"], ref_losses):
                assert got == pytest.approx(want, rel=1e-6), (case["name"], rank, got, want)
        for name, dim, tp_rank, tp, grad in result["grads"]:
            grad = torch.from_numpy(grad)
            want = ref_grads[name] if dim is None else torch.chunk(ref_grads[name], tp, dim=dim)[tp_rank]
            scale = want.abs().max().item()
            diff = (grad - want).abs().max().item()
            assert diff <= 1e-6 * scale + 1e-7, f"{case['name']} rank {rank} {name}: diff {diff:.3e} scale {scale:.3e}"
            covered.add(name)
    assert covered == set(ref_grads), (case["name"], set(ref_grads) - covered)
    assert sum(r["losses"] is not None for r in per_rank) >= 1


def test_gpt_pipeline_parity_world4():
    results = run_on_ranks(_worker, 4, CASES_4, [_reference_state(c) for c in CASES_4], timeout=400)
    for index, case in enumerate(CASES_4):
        _check(case, [r[index] for r in results])


def test_gpt_pipeline_parity_world8_with_tp():
    results = run_on_ranks(_worker, 8, CASES_8, [_reference_state(c) for c in CASES_8], timeout=400)
    for index, case in enumerate(CASES_8):
        _check(case, [r[index] for r in results])
