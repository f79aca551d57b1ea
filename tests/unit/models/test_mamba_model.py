"""Hybrid layer allocation (Megatron's examples), flag validation, the mixer against a step-by-step reference
written here, and the model's state-dict keys."""
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments.validate_mamba import validate_mamba


@pytest.mark.parametrize("n,ra,rm,expected", [(10, 0.2, 0.0, "MMM*MM*MMM"), (10, 0.0, 0.3, "MM-MMM-MM-"),
                                              (10, 0.1, 0.1, "MMMMM*MMM-"), (12, 0.25, 0.25, "MM*-MM*-M*M-")])
def test_allocation_matches_megatron_examples(n, ra, rm, expected):
    assert "".join(allocate_layers(n, ra, rm)) == expected


def test_override_pattern_rules():
    assert "".join(allocate_layers(4, 0.0, 0.0, "M*-M")) == "M*-M"
    with pytest.raises(ValueError, match="--hybrid-override-pattern has 3 symbols"):
        allocate_layers(4, 0.0, 0.0, "M*M")
    with pytest.raises(ValueError, match="'E'"):
        allocate_layers(4, 0.0, 0.0, "MEMM")
    with pytest.raises(ValueError, match="--hybrid-attention-ratio gives 2"):
        allocate_layers(10, 0.2, 0.0, "MMMM*MMMMM")


def test_validation_collects_mamba_problems():
    args = types.SimpleNamespace(spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
                                 is_hybrid_model=False, hybrid_override_pattern="M*M", hybrid_attention_ratio=0.0,
                                 hybrid_mlp_ratio=0.0, num_layers=4, pipeline_model_parallel_size=3,
                                 num_layers_per_virtual_pipeline_stage=None, context_parallel_size=1,
                                 hidden_size=32, mamba_head_dim=8, mamba_num_groups=3, mamba_state_dim=8,
                                 mamba_num_heads=None, tensor_model_parallel_size=2)
    problems = validate_mamba(args)
    text = " ".join(problems)
    assert "--hybrid-override-pattern has 3 symbols" in text
    assert "--pipeline-model-parallel-size (3)" in text
    assert "--mamba-num-groups (3) must be divisible by --tensor-model-parallel-size (2)" in text
    args.spec, args.hybrid_override_pattern = ["local"], None
    assert validate_mamba(args) == []


def _config(**kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, mamba_state_dim=8, mamba_head_dim=8,
                mamba_num_groups=2, use_cpu_initialization=True, normalization="RMSNorm", add_bias_linear=False,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _naive_mixer(mixer, x):
    """The Mamba-2 mixer, one time step at a time, in float64. x [s, b, h] -> [s, b, h]."""
    d = {k: v.double() for k, v in mixer.state_dict().items() if not k.endswith("_extra_state")}
    s, b, _ = x.shape
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + mixer.config.layernorm_epsilon)
    zxbcdt = (xn * d["in_proj.layer_norm_weight"]) @ d["in_proj.weight"].T  # [s, b, rows]
    di, g, n, h, p = mixer.d_inner, mixer.ngroups, mixer.d_state, mixer.nheads, mixer.headdim
    z, xbc, dt = zxbcdt[..., :di], zxbcdt[..., di:2 * di + 2 * g * n], zxbcdt[..., 2 * di + 2 * g * n:]
    w, wb = d["conv1d.weight"][:, 0, :], d["conv1d.bias"]
    conv = torch.zeros_like(xbc)
    for t in range(s):
        for j in range(w.shape[1]):
            src = t - (w.shape[1] - 1) + j
            if src >= 0:
                conv[t] += w[:, j] * xbc[src]
    u = F.silu(conv + wb)
    xs, Bs, Cs = u[..., :di], u[..., di:di + g * n], u[..., di + g * n:]
    A = -torch.exp(d["A_log"])
    state = torch.zeros(b, h, p, n, dtype=torch.float64)
    ys = []
    for t in range(s):
        delta = F.softplus(dt[t] + d["dt_bias"])  # [b, h]
        xh = xs[t].reshape(b, h, p)
        Bh = Bs[t].reshape(b, g, n).repeat_interleave(h // g, dim=1)
        Ch = Cs[t].reshape(b, g, n).repeat_interleave(h // g, dim=1)
        state = torch.exp(delta * A)[..., None, None] * state + delta[..., None, None] * xh[..., None] * Bh[:, :, None]
        ys.append(((state * Ch[:, :, None]).sum(-1) + d["D"][:, None] * xh).reshape(b, di))
    y = torch.stack(ys) * F.silu(z)
    yg = y.reshape(s, b, g, di // g)
    y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(s, b, di) * d["norm.weight"]
    return y @ d["out_proj.weight"].T


@pytest.mark.parametrize("mem_eff", [True, False])
def test_mixer_equals_step_by_step_reference(mem_eff):
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = MambaModel(_config(use_mamba_mem_eff_path=mem_eff), mamba_stack_spec, vocab_size=64,
                       max_sequence_length=16, hybrid_override_pattern="M*M-")
    mixer = model.decoder.layers[0].mixer
    mixer.chunk_size = 4  # several chunks over 11 steps
    x = torch.randn(11, 2, 32)
    out, bias = mixer(x)
    assert bias is None
    torch.testing.assert_close(out.double(), _naive_mixer(mixer, x), rtol=1e-4, atol=1e-5)


def test_model_keys_and_backward():
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = MambaModel(_config(), mamba_stack_spec, vocab_size=64, max_sequence_length=16,
                       hybrid_override_pattern="M*M-", position_embedding_type="learned_absolute",
                       share_embeddings_and_output_weights=True)
    keys = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    for key in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                "decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.layers.0.mixer.in_proj.weight",
                "decoder.layers.0.mixer.conv1d.weight", "decoder.layers.0.mixer.conv1d.bias",
                "decoder.layers.0.mixer.dt_bias", "decoder.layers.0.mixer.A_log", "decoder.layers.0.mixer.D",
                "decoder.layers.0.mixer.norm.weight", "decoder.layers.0.mixer.out_proj.weight",
                "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", "decoder.final_norm.weight"):
        assert key in keys, key
    assert "output_layer.weight" not in keys  # tied
    mixer = model.decoder.layers[0].mixer
    assert tuple(mixer.in_proj.weight.shape) == (2 * 64 + 2 * 2 * 8 + 8, 32)
    assert tuple(mixer.conv1d.weight.shape) == (64 + 2 * 2 * 8, 1, 4)
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, torch.arange(16)[None].expand(2, -1), None, labels=ids)
    loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mem_eff", [True, False])
def test_decoding_with_states_equals_full_recompute(mem_eff):
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = MambaModel(_config(use_mamba_mem_eff_path=mem_eff), mamba_stack_spec, vocab_size=64,
                       max_sequence_length=32, hybrid_override_pattern="M*M-").eval()
    for layer in (model.decoder.layers[0], model.decoder.layers[2]):
        layer.mixer.chunk_size = 4
    ids = torch.randint(0, 64, (2, 15))
    with torch.no_grad():
        full = model(ids, torch.arange(15)[None].expand(2, -1), None)  # [b, s, V]
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=32,
                                         materialize_only_last_token_logits=False)
        prompt = model(ids[:, :10], torch.arange(10)[None].expand(2, -1), None, inference_context=context)
        torch.testing.assert_close(prompt, full[:, :10], rtol=1e-5, atol=1e-5)
        context.sequence_len_offset = 10
        for t in range(10, 15):
            step = model(ids[:, t:t + 1], torch.full((2, 1), t), None, inference_context=context)
            torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-4, atol=1e-4)
            context.sequence_len_offset += 1
    conv, ssm = context.key_value_memory_dict[1]
    assert conv.shape == (4, 2, 64 + 2 * 2 * 8) and ssm.shape == (8, 2, 8, 8)


def test_dist_checkpoint_keys_are_megatrons():
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = MambaModel(_config(), mamba_stack_spec, vocab_size=64, max_sequence_length=16,
                       hybrid_override_pattern="M*M-")
    sharded = model.sharded_state_dict()
    assert isinstance(sharded["decoder.layers.0.mixer.in_proj.weight"], ShardedTensorFactory)
    apply_factories(sharded)
    keys = set()
    for value in sharded.values():
        for item in (value.values() if isinstance(value, dict) else [value]):
            keys.add(item.key)
    prefix = "decoder.layers.2.mixer."
    for name in ("in_proj.weight.z", "in_proj.weight.x", "in_proj.weight.B", "in_proj.weight.C", "in_proj.weight.dt",
                 "conv1d.weight.x", "conv1d.weight.B", "conv1d.weight.C", "conv1d.bias.x", "conv1d.bias.B",
                 "conv1d.bias.C", "A_log", "dt_bias", "D", "norm.weight", "out_proj.weight",
                 "in_proj.layer_norm_weight"):
        assert prefix + name in keys, name
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in keys  # global index, no stacking
    assert "decoder.final_norm.weight" in keys
    z = next(v for v in sharded["decoder.layers.0.mixer.in_proj.weight"].values()
             if v.key.endswith(".z"))
    assert z.global_shape == (64, 32)


def test_command_line_mamba_problems_are_collected_once():
    from megatron.training.arguments import ArgumentsError, _parse, validate_args

    argv = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 10 --spec megatron.core.models.mamba.mamba_layer_specs "
            "mamba_stack_spec --hybrid-override-pattern M*E- --mamba-num-groups 3 --mamba-head-dim 16").split()
    args = _parse(argv)
    args.world_size, args.rank = 1, 0
    with pytest.raises(ArgumentsError) as err:
        validate_args(args)
    text = " ".join(err.value.problems)
    assert "'E'" in text and "--mamba-num-groups (3)" in text
    ok = _parse([a.replace("M*E-", "M*M-") for a in argv if a not in ("--mamba-num-groups", "3")])
    ok.world_size, ok.rank = 1, 0
    validate_args(ok)
    assert ok.hybrid_override_pattern == "M*M-"


def test_bench_flops_formula_equals_the_trainers():
    from benchmarks.gpu import mamba_bench
    from megatron.training.arguments import _parse
    from megatron.training.training_log import num_floating_point_operations

    model = mamba_bench.MODEL_1B
    args = _parse(mamba_bench.flags(model, 2, smoke=False))
    args.padded_vocab_size = -(-model["vocab"] // 128) * 128
    args.ffn_hidden_size = model["ffn"]
    assert num_floating_point_operations(args, model["mbs"]) == pytest.approx(
        mamba_bench.hybrid_flops(model, model["mbs"]), rel=1e-12)


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_gives_the_same_gradients(method):
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        extra = dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=2) if recompute \
            else {}
        model = MambaModel(_config(**extra), mamba_stack_spec, vocab_size=64, max_sequence_length=16,
                           hybrid_override_pattern="M*M-")
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
        model(ids, torch.arange(16)[None].expand(2, -1), None, labels=ids).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)
