"""A tiny GPTModel trained through Megatron's schedules, DDP and optimizer: the DP=1 reference and a
TP x PP x DP (distributed optimizer) run that starts from the reference's weights.

Used by tests/parity/test_dp_parity.py inside one multi-rank launch.
"""
import functools

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness import tp_slice

VOCAB, SEQ, MBS, HIDDEN, HEADS, LAYERS = 128, 16, 2, 32, 4, 4
MICROBATCHES, STEPS, LR = 4, 3, 0.1


def _config(tp=1, pp=1, sp=False):
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
    )


def batches():
    """STEPS global batches of MICROBATCHES microbatches each."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(MICROBATCHES):
            mask = (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()
            step.append(dict(
                tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                loss_mask=mask,
                position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),
            ))
        out.append(step)
    return out


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _optimizer(ddp, distributed):
    # SGD with momentum, not Adam: Adam's g/sqrt(v) turns the ~1e-7 rounding of gradient entries that
    # nearly cancel (a different summation order across DP) into O(lr) parameter differences, which
    # hides the parallel layout behind optimizer noise. The toy-model suite covers Adam at 1e-6.
    opt_config = OptimizerConfig(
        optimizer="sgd", lr=LR, sgd_momentum=0.9, clip_grad=1.0, use_distributed_optimizer=distributed
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    for group in optimizer.param_groups:
        group["weight_decay"] = opt_config.weight_decay * group["wd_mult"]
    return optimizer


def _train(ddp, optimizer, config, data, dp_group):
    """STEPS iterations through get_forward_backward_func; returns the global loss per step (last stage)."""
    forward_backward = get_forward_backward_func()
    losses = []
    for step_batches in data:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=_forward_step, data_iterator=iter(step_batches), model=ddp,
            num_microbatches=len(step_batches), seq_length=SEQ, micro_batch_size=MBS,
        )
        optimizer.step()
        if reports:
            total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
            dist.all_reduce(total, group=dp_group)
            losses.append((total[0] / total[1]).item())
    return losses


def reference(single_groups):
    """DP=1 (TP=PP=1) run on every rank over groups of one; returns (initial state, losses, final params)."""
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    config = _config()
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=True)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(), model,
        grad_comm_pgs=single_groups.grad, model_comm_pgs=single_groups.model,
    )
    config.finalize_model_grads_func = functools.partial(finalize_model_grads, pg_collection=single_groups.finalize)
    config.no_sync_func = ddp.no_sync
    optimizer = _optimizer(ddp, distributed=False)
    losses = _train(ddp, optimizer, config, batches(), single_groups.dp)
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    return initial, losses, final


def _reference_name(module, name):
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(module.decoder.layers[int(parts[2])].layer_number - 1)
    if parts[0] == "output_layer":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def parallel_run(initial, ddp_kwargs, tp, pp, sp=False):
    """Train a TP x PP stage from the reference's initial weights (parallel_state must be initialised);
    returns (losses on the last stage or None, {reference name: (this rank's param, reference slice fn)})."""
    model_parallel_cuda_manual_seed(11)
    config = _config(tp=tp, pp=pp, sp=sp)
    model = GPTModel(
        config, get_gpt_layer_local_spec(), VOCAB, SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tp_slice(param, initial[_reference_name(model, name)]))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_kwargs), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = _optimizer(ddp, distributed=ddp_kwargs.get("use_distributed_optimizer", False))
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    data = [step[dp_rank::dp_size] for step in batches()]
    losses = _train(ddp, optimizer, config, data, parallel_state.get_data_parallel_group())
    if ddp.use_forward_hook:
        ddp.disable_forward_pre_hook(param_sync=True)
    params = {_reference_name(model, name): (param.detach().clone(), param) for name, param in model.named_parameters()}
    return (losses if parallel_state.is_pipeline_last_stage() else None), params


def compare_params(params, final):
    """Largest relative difference of this rank's (sliced) params against the reference's final params."""
    worst = 0.0
    for ref_name, (value, param) in params.items():
        expected = tp_slice(param, final[ref_name])
        worst = max(worst, ((value - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item())
    return worst
