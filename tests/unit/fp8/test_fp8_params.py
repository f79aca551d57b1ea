"""FP8 parameters in one process (`--fp8-param-gather`, distributed optimizer over a group of one), bf16 model:
the gathered FP8 bytes are the fp32 master quantized with its own amax (not its bf16 copy), the parameter holds
their dequantized values, the forward takes them as they are (no weight quantization), and loading a state
dict drops the copy."""
import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.params import Fp8WeightCopy, quantize_shard
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all


def test_fp8_weight_copy_updates_in_place():
    data = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(kernels.E4M3)
    copy = Fp8WeightCopy(data, torch.tensor([0.5]))
    transposed = copy.transposed()
    assert torch.equal(transposed.float(), data.float().t())
    data.copy_(torch.tensor([[2.0, 2.0], [1.0, 1.0]]).to(kernels.E4M3))
    copy.update(torch.tensor([0.25]))
    assert copy.transposed() is transposed and torch.equal(transposed.float(), data.float().t())
    assert copy.dequantized(torch.float32).tolist() == [[0.5, 0.5], [0.25, 0.25]]
    q, inv = quantize_shard(torch.tensor([1.0, -3.0, 0.0]), torch.tensor([3.0]))
    scale = torch.tensor([448.0]) / 3.0  # fp32, one rounding
    reference = (torch.tensor([1.0, -3.0, 0.0]) * scale).to(kernels.E4M3)
    assert torch.equal(q.view(torch.uint8), reference.view(torch.uint8)) and q.float()[1].item() == -448.0
    assert torch.equal(inv, torch.ones(1) / scale)


def test_bf16_fp8_parameters_take_the_fp32_master(monkeypatch):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_single_rank()
    seed_all(3)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, fp8="hybrid", fp8_recipe="tensorwise",
                               fp8_param=True, bf16=True, params_dtype=torch.bfloat16)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16).bfloat16()
    model = apply_plan(model)[0]
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        fp8_param_gather=True, grad_reduce_in_fp32=True),
                                  model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True,
                                                       use_distributed_optimizer=True), [ddp])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    copy, master = weight.fp8_weight_copy, optimizer.model_param_to_main_param[weight]
    assert master.dtype == torch.float32
    expected, expected_inv = quantize_shard(master, kernels.amax(master))
    assert torch.equal(copy.data.view(torch.uint8).reshape(-1), expected.view(torch.uint8))
    assert torch.equal(copy.scale_inv, expected_inv)
    from_bf16, _ = quantize_shard(master.bfloat16(), kernels.amax(master.bfloat16()))
    assert not torch.equal(from_bf16.view(torch.uint8), expected.view(torch.uint8))  # the test can tell them apart
    assert torch.equal(weight.detach(), copy.dequantized(torch.bfloat16))

    quantized = []
    original = type(model.decoder.layers[0].mlp.linear_fc1.fp8.weight).quantize
    monkeypatch.setattr(type(model.decoder.layers[0].mlp.linear_fc1.fp8.weight), "quantize",
                        lambda self, *a, **k: quantized.append(self.dtype) or original(self, *a, **k))
    model(tokens, positions, None, labels=tokens)
    weights_quantized = len(quantized)
    model.decoder.layers[0].mlp.linear_fc1.load_state_dict(model.decoder.layers[0].mlp.linear_fc1.state_dict())
    assert weight.fp8_weight_copy is None  # loading drops the copy
    quantized.clear()
    model(tokens, positions, None, labels=tokens)
    assert len(quantized) == weights_quantized + 1  # now fc1's weight is quantized on the fly again
