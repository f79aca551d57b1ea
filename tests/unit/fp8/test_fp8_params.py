"""FP8 parameters in one process (`--fp8-param-gather`, distributed optimizer over a group of one).

- the gathered FP8 bytes are the fp32 master quantized with its own amax (not its bf16 copy), and the forward
  takes them as they are (no weight quantization);
- the FP8 copy is the weight's only copy in the model: no bf16 storage (asserted in bytes), the FP8 linears'
  weights hold <= 0.55x the bytes of bf16 weights (1 byte per value; the transposed copy lives only from a
  training forward to its backward);
- `state_dict()` holds the dequantized weights, which load into a model without FP8 exactly; loading them back
  quantizes them into the FP8 copy, and with the optimizer state training resumes bit for bit.
"""
import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.params import Fp8WeightCopy, held_bytes, is_fp8_primary, quantize_shard, weight_values
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all

VOCAB, SEQ = 64, 16


def test_fp8_weight_copy():
    data = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(kernels.E4M3)
    copy = Fp8WeightCopy(data, torch.tensor([0.5]))
    assert torch.equal(copy.transposed().float(), data.float().t()) and copy.transposed().is_contiguous()
    data.copy_(torch.tensor([[2.0, 2.0], [1.0, 1.0]]).to(kernels.E4M3))
    copy.update(torch.tensor([0.25]))
    assert torch.equal(copy.transposed().float(), data.float().t())  # made from the current bytes, not kept
    assert copy.dequantized(torch.float32).tolist() == [[0.5, 0.5], [0.25, 0.25]] and copy.nbytes() == 4 + 4
    q, inv = quantize_shard(torch.tensor([1.0, -3.0, 0.0]), torch.tensor([3.0]))
    scale = torch.tensor([448.0]) / 3.0  # fp32, one rounding
    reference = (torch.tensor([1.0, -3.0, 0.0]) * scale).to(kernels.E4M3)
    assert torch.equal(q.view(torch.uint8), reference.view(torch.uint8)) and q.float()[1].item() == -448.0
    assert torch.equal(inv, torch.ones(1) / scale)


def _build(seed, fp8_param=True, bf16=True, **config_kwargs):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    seed_all(seed)
    dtype = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, fp8="hybrid", fp8_recipe="tensorwise",
                               fp8_param=fp8_param, **dtype, **config_kwargs)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model = apply_plan(model.bfloat16() if bf16 else model)[0]
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param, grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, clip_grad=1.0,
                                                       use_distributed_optimizer=True), [ddp])
    return model, ddp, optimizer


def _train(model, ddp, optimizer, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, torch.arange(SEQ).expand(2, SEQ), None, labels=tokens).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _fp8_weights(model):
    return [p for p in model.parameters() if getattr(p, "fp8_param", False)]


def test_bf16_fp8_parameters_are_the_only_copy(monkeypatch):
    init_single_rank()
    model, ddp, optimizer = _build(3)
    weights = _fp8_weights(model)
    assert len(weights) == 8 and all(is_fp8_primary(w) for w in weights)  # from the optimizer's construction on
    losses = _train(model, ddp, optimizer, 2)
    assert all(torch.isfinite(torch.tensor(losses)))
    numel = sum(w.numel() for w in weights)
    for weight in weights:  # no bf16 storage: one placeholder element; the FP8 values are the bucket's uint8 bytes
        assert weight.untyped_storage().nbytes() == 2 and weight.fp8_weight_copy.data.untyped_storage().nbytes() \
            == ddp.buffers[0].param_to_bucket[weight].fp8_param_data.numel()
    ratio = sum(held_bytes(w) for w in weights) / (2 * numel)
    print(f"FP8 linears' weights: {sum(held_bytes(w) for w in weights)} bytes held for {numel} values, "
          f"{ratio:.4f}x of bf16")
    assert ratio <= 0.55, ratio

    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    copy, master = weight.fp8_weight_copy, optimizer.model_param_to_main_param[weight]
    assert master.dtype == torch.float32
    expected, expected_inv = quantize_shard(master, kernels.amax(master))
    assert torch.equal(copy.data.view(torch.uint8).reshape(-1), expected.view(torch.uint8))
    assert torch.equal(copy.scale_inv, expected_inv)
    from_bf16, _ = quantize_shard(master.bfloat16(), kernels.amax(master.bfloat16()))
    assert not torch.equal(from_bf16.view(torch.uint8), expected.view(torch.uint8))  # the test can tell them apart
    state = model.state_dict()
    assert torch.equal(state["decoder.layers.0.mlp.linear_fc1.weight"], copy.dequantized(torch.bfloat16))
    assert torch.equal(weight_values(weight), copy.dequantized(torch.bfloat16))

    quantized = []
    scaling_type = type(model.decoder.layers[0].mlp.linear_fc1.fp8.weight)
    original = scaling_type.quantize
    monkeypatch.setattr(scaling_type, "quantize", lambda self, *a, **k: quantized.append(self) or original(self, *a, **k))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(SEQ).expand(2, SEQ), None, labels=tokens).float().mean().backward()
    assert not any(s is model.decoder.layers[0].mlp.linear_fc1.fp8.weight for s in quantized)  # bytes as they are
    assert sum(held_bytes(w) for w in weights) / (2 * numel) == ratio  # no transposed copy kept after backward


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def test_fp8_params_checkpoint_loads_without_fp8_and_resumes_exactly(tmp_path):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_single_rank()
    model, ddp, optimizer = _build(5, bf16=False)
    _train(model, ddp, optimizer, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")  # a plain state dict: tensors only, no FP8 objects
    saved_model, saved_optimizer = torch.load(tmp_path / "model.pt", weights_only=True), optimizer.state_dict()
    saved_model = {key: value for key, value in saved_model.items() if torch.is_tensor(value)}
    saved_params = optimizer.get_parameter_state_dp_zero()
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert torch.equal(saved_model[fc1], model.decoder.layers[0].mlp.linear_fc1.weight.fp8_weight_copy.dequantized(
        torch.float32))  # the checkpoint holds the dequantized FP8 values

    plain = GPTModel(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       use_cpu_initialization=True), get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    plain.load_state_dict(model.state_dict(), strict=True)
    assert all(torch.equal(p.detach(), saved_model[name]) for name, p in plain.named_parameters())

    resumed, resumed_ddp, resumed_optimizer = _build(6, bf16=False)  # other initial weights
    resumed.load_state_dict(saved_model, strict=True)  # quantized on load
    loaded_fc1 = resumed.decoder.layers[0].mlp.linear_fc1.weight
    assert is_fp8_primary(loaded_fc1) and loaded_fc1.untyped_storage().nbytes() == 4
    original_copy = model.decoder.layers[0].mlp.linear_fc1.weight.fp8_weight_copy
    assert torch.equal(loaded_fc1.fp8_weight_copy.data.view(torch.uint8), original_copy.data.view(torch.uint8))
    assert torch.allclose(weight_values(loaded_fc1), saved_model[fc1], rtol=1e-6, atol=0)
    resumed_optimizer.load_state_dict(saved_optimizer)
    resumed_optimizer.load_parameter_state_from_dp_zero(saved_params)  # FP8 copies re-gathered from the masters
    assert torch.equal(_state(resumed)[fc1], saved_model[fc1])
    assert _train(resumed, resumed_ddp, resumed_optimizer, 2, first=2) == _train(model, ddp, optimizer, 2, first=2)
    assert all(torch.equal(value, _state(model)[key]) for key, value in _state(resumed).items())

    resumed_optimizer.reload_model_params()  # masters from the model's FP8 values (--finetune, --no-load-optim)
    weight = resumed.decoder.layers[0].mlp.linear_fc1.weight
    assert torch.equal(resumed_optimizer.model_param_to_main_param[weight], weight_values(weight).view(-1))


def test_fp8_params_distributed_checkpoint_resumes_exactly(tmp_path):
    """torch_dist checkpoint (model + distributed-optimizer state in model space) of a SwiGLU model (fc1's
    [gate; up] halves are a ShardedTensorFactory): the optimizer state of the FP8 weights is found through their
    dequantized values, and training resumes bit for bit."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    init_single_rank()
    model, ddp, optimizer = _build(5, bf16=False, gated_linear_unit=True)
    _train(model, ddp, optimizer, 2)
    model_state = model.sharded_state_dict()
    state = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state)}
    keys = {value.key for value in nested_values(state["optimizer"]) if hasattr(value, "key")}
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in keys, sorted(keys)  # FP8 weights' state
    dist_checkpointing.save(state, str(tmp_path))
    resumed, resumed_ddp, resumed_optimizer = _build(6, bf16=False, gated_linear_unit=True)
    request_model = resumed.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": request_model, "optimizer": resumed_optimizer.sharded_state_dict(
        request_model, is_loading=True)}, str(tmp_path))
    resumed.load_state_dict(loaded["model"], strict=False)
    resumed_optimizer.load_state_dict(loaded["optimizer"])
    assert _train(resumed, resumed_ddp, resumed_optimizer, 2, first=2) == _train(model, ddp, optimizer, 2, first=2)
    assert all(torch.equal(value, _state(model)[key]) for key, value in _state(resumed).items())
