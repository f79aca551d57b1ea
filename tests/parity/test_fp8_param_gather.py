"""`--fp8-param-gather` with the distributed optimizer on gloo: a tiny FP8 GPT (hybrid, tensorwise) trained 3
steps at DP=2 equals DP=1; the FP8 weights are all-gathered as uint8 FP8 bytes and used by the forward as
they are, the fp32 master weights stay unquantized in the optimizer, the FP8 bytes are the weights' only copy
in the model (no fp32 storage; the state dict holds the dequantized FP8 values and loads into a model without
FP8), and training resumes bit for bit from a model state dict plus the optimizer state gathered on DP rank 0.

Two launches (DP=1 and DP=2), each training with and without FP8 parameters. References written here:
- FP8 parameters at DP=1 vs the FP8 GEMMs without FP8 parameters at DP=1: with tensorwise scaling both
  quantize the same fp32 values with the same amax, so the losses agree to fp32 rounding;
- DP=2 vs DP=1 with FP8 parameters: the master weights differ by the order of the gradient sums (~1e-7),
  which may move a value across an FP8 rounding boundary: looser bound on the FP8 weights.
"""
import contextlib

import torch

from megatron.core.fp8.params import held_bytes, is_fp8_primary, weight_values
from tests.harness import run_on_ranks

VOCAB, SEQ, BATCH, STEPS, LR = 128, 16, 4, 3, 0.05


def _config(fp8_param):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, fp8="hybrid", fp8_recipe="tensorwise",
                             fp8_param=fp8_param)


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(STEPS)]


def _build(fp8_param, seed=7, optimizer="sgd"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit.transformer.model_setup import apply_plan, seed_all

    seed_all(seed)
    config = _config(fp8_param)
    model = apply_plan(GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ))[0]
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        fp8_param_gather=fp8_param), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer=optimizer, lr=LR, sgd_momentum=0.9, clip_grad=1.0,
                                                       use_distributed_optimizer=True), [ddp])
    return model, ddp, optimizer


def _steps(model, ddp, optimizer, batches):
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    dp_size, dp_rank = dp_group.size(), dist.get_rank(dp_group)
    losses = []
    halves = range(2) if dp_size == 1 else [dp_rank]
    for tokens, labels in batches:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        for count, half in enumerate(halves):
            # one half of the batch per DP rank, or both halves as two microbatches at DP=1 (FP8 scales the
            # activations per forward: the same halves quantize alike in both layouts)
            with ddp.no_sync() if count < len(halves) - 1 else contextlib.nullcontext():
                loss = model(tokens.chunk(2)[half], torch.arange(SEQ).expand(BATCH // 2, SEQ), None,
                             labels=labels.chunk(2)[half]).mean() / len(halves)
                loss.backward()
            step_loss += loss.detach()
        ddp.finish_grad_sync()
        optimizer.step()
        dist.all_reduce(step_loss, group=dp_group)
        losses.append(step_loss.item() / dp_size)
    return losses


def _train(fp8_param):
    model, ddp, optimizer = _build(fp8_param)
    return model, ddp, optimizer, _steps(model, ddp, optimizer, _batches())


def _check_fp8_params(model, ddp, optimizer):
    fp8_weights = [p for p in model.parameters() if getattr(p, "fp8_param", False)]
    assert len(fp8_weights) == 8, len(fp8_weights)  # QKV, proj, fc1, fc2 of 2 layers; embedding/head stay fp32
    fp8_buckets = [b for buffer in ddp.buffers for b in buffer.buckets if b.fp8_param_range is not None]
    assert len(fp8_buckets) == 8 and all(b.fp8_param_data.dtype == torch.uint8 for b in fp8_buckets)
    state = model.state_dict()
    names = {p: name for name, p in model.named_parameters()}
    for weight in fp8_weights:
        copy = weight.fp8_weight_copy
        assert copy.data.dtype == torch.float8_e4m3fn and copy.data.shape == weight.shape
        assert is_fp8_primary(weight) and weight.untyped_storage().nbytes() == weight.element_size()  # FP8 only
        assert torch.equal(state[names[weight]], copy.dequantized(weight.dtype))  # the state dict: FP8 values
        main = optimizer.model_param_to_main_param[weight]
        assert main.dtype == torch.float32
    held = sum(held_bytes(w) for w in fp8_weights) / sum(w.numel() * w.element_size() for w in fp8_weights)
    assert held <= 0.55 / 2, held  # fp32 model: 1 byte per value of 4
    # the masters are not FP8 values: some shard differs from the dequantized weight it was quantized into
    assert any(not torch.equal(optimizer.model_param_to_main_param[w], weight_values(w).view(-1)[
        optimizer._get_model_param_range_map(w)["param"].start:optimizer._get_model_param_range_map(w)["param"].end])
        for w in fp8_weights)


def _check_resume():
    """Adam, FP8 parameters: train a step, save (model state dict, distributed-optimizer state gathered on DP
    rank 0), load into a fresh model and optimizer (other initial weights), train one more step each: the same
    loss and weights, bit for bit."""
    batches = _batches()
    model, ddp, optimizer = _build(True, optimizer="adam")
    _steps(model, ddp, optimizer, batches[:1])
    model_state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    optimizer_state, param_state = optimizer.state_dict(), optimizer.get_parameter_state_dp_zero()
    fresh, fresh_ddp, fresh_optimizer = _build(True, seed=8, optimizer="adam")
    fresh.load_state_dict(model_state, strict=True)
    fresh_optimizer.load_state_dict(optimizer_state)
    fresh_optimizer.load_parameter_state_from_dp_zero(param_state)
    assert _steps(fresh, fresh_ddp, fresh_optimizer, batches[1:2]) == _steps(model, ddp, optimizer, batches[1:2])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items() if torch.is_tensor(v))


def _check_checkpoint_loads_without_fp8(model):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    state = {key: value for key, value in model.state_dict().items() if torch.is_tensor(value)}
    assert all(value.dtype == torch.float32 for value in state.values())
    plain = GPTModel(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       use_cpu_initialization=True), get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    plain.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(plain.decoder.layers[0].mlp.linear_fc1.weight,
                       weight_values(model.decoder.layers[0].mlp.linear_fc1.weight))


def _rank_body():
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    ps.initialize_model_parallel()
    results = {}
    for fp8_param in (True, False):
        model, ddp, optimizer, losses = _train(fp8_param)
        weights = {name: p.clone().numpy() for name, p in model.state_dict().items() if torch.is_tensor(p)}
        if fp8_param:
            _check_fp8_params(model, ddp, optimizer)
            _check_checkpoint_loads_without_fp8(model)
            _check_resume()
        results[fp8_param] = (losses, weights)
    return results if dist.get_rank() == 0 else None


def _rel(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_fp8_param_gather_dp2_equals_dp1():
    dp1 = run_on_ranks(_rank_body, 1, timeout=300)[0]
    dp2 = run_on_ranks(_rank_body, 2, timeout=300)[0]
    (losses1, weights1), (losses2, weights2) = dp1[True], dp2[True]
    plain_losses = dp1[False][0]
    assert losses1[-1] < losses1[0], losses1
    for got, want in zip(losses1, plain_losses):  # FP8 parameters change where the weight is quantized, not how
        assert abs(got - want) <= 1e-6 * abs(want), (losses1, plain_losses)
    for got, want in zip(losses2, losses1):
        assert abs(got - want) <= 1e-5 * abs(want), (losses2, losses1)
    worst = max(_rel(weight, weights1[name]) for name, weight in weights2.items())
    dp_loss = max(abs(a / b - 1) for a, b in zip(losses2, losses1))
    plain_loss = max(abs(a / b - 1) for a, b in zip(losses1, plain_losses))
    print(f"FP8 params DP=2 vs DP=1: loss {dp_loss:.1e}, weights {worst:.1e}; vs FP8 without FP8 params: loss "
          f"{plain_loss:.1e}")
    assert worst <= 1e-4, worst
    # FP8 parameters hold FP8 values: they differ from the fp32 weights of the run without them
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert _rel(weights1[fc1], dp1[False][1][fc1]) > 1e-3
