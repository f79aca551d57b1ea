"""The optimisation plan: resolution as a pure function of (config, device facts), applied to built models.

The GPU rows are resolved here on CPU by passing an H200's facts, from the benchmark's own command lines
(`benchmarks/gpu/run_bench.py`): the default plan must choose what the code chose before the plan existed
(compiled layers from hidden size 2048 on CUDA, not for TP + SP; linears eager inside them; compiled fused
kernels; copy-engine overlap transport; FP8 GEMMs on the FP8 tensor cores).
"""
import pytest
import torch

from benchmarks.gpu.run_bench import COMMON, MODELS
from megatron.core.optimization_plan.apply import apply_optimization_plan, device_facts_of
from megatron.core.optimization_plan.resolve import (
    Decision,
    DeviceFacts,
    PlanError,
    format_plan,
    resolve_plan,
    settings_applied_by_plan,
)
from megatron.training.arguments import _parse, validate_args
from megatron.training.arguments.to_configs import core_transformer_config_from_args

H200 = DeviceFacts(device_type="cuda", cuda=True, compute_capability=(9, 0), triton=True, tp_backend="nccl")
CPU = DeviceFacts(device_type="cpu", tp_backend="gloo")


def _config(command_line: str, world_size: int = 1):
    args = _parse(command_line.split() + ["--global-batch-size", "8", "--train-iters", "10"])
    args.world_size, args.rank = world_size, 0
    return core_transformer_config_from_args(validate_args(args))


def _bench(model: str, extra: str = "", world_size: int = 1):
    common = COMMON if "--data-path" not in MODELS[model][0] else COMMON.replace(
        "--mock-data --tokenizer-type NullTokenizer ", "")  # as run_bench.py builds the command line
    return _config(f"{MODELS[model][0]} {common} {extra}", world_size)


def _values(plan):
    return {name: decision.value for name, decision in plan.decisions()}


def test_default_gpu_plans_of_the_benchmarked_models(monkeypatch):
    # run_bench sets it for TP jobs; validation asks for it on a Hopper machine (the test also runs on one)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    gpt = _values(resolve_plan(_bench("gpt1.3b"), H200))
    llama = _values(resolve_plan(_bench("llama1b"), H200))
    fp8 = resolve_plan(_bench("gpt1.3b", "--fp8-format hybrid --fp8-recipe tensorwise --enable-cuda-graph"), H200)
    for values in (gpt, llama, _values(fp8)):
        assert values["compile_layers"] is True and values["compile_linears"] is False
        assert values["fusion_kernels"] == "compiled" and values["tp_comm_overlap"] is None
        assert values["gradient_accumulation_fusion"] is True
    assert gpt["fp8"] is None and gpt["cuda_graphs"] is None and gpt["bias_activation_fusion"] is True
    assert llama["bias_activation_fusion"] is True  # bias-free SwiGLU through the fused function
    assert fp8.fp8.value == {"fp8_format": "hybrid", "recipe": "tensorwise", "margin": 0, "amax_history_len": 1,
                             "amax_compute_algo": "most_recent", "wgrad": True, "fp8_param": False,
                             "num_layers": 0, "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 0}
    assert "torch._scaled_mm" in fp8.fp8.why and fp8.cuda_graphs.value == {"warmup_steps": 3}
    delayed = resolve_plan(_bench("llama1b", "--fp8-format hybrid"), H200).fp8
    assert delayed.value["recipe"] == "delayed" and delayed.text().startswith("hybrid, delayed (amax history 1,")
    # small layers and TP + SP layers stay eager; TP=2 + SP overlaps over the copy engine
    assert resolve_plan(_bench("gpt-small-text"), H200).compile_layers.value is False
    tp_sp = resolve_plan(_bench("gpt1.3b", "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap",
                                world_size=2), H200)
    assert tp_sp.compile_layers == Decision(False, "auto: tensor + sequence parallelism (split graphs ran slower "
                                                   "than eager layers)")
    assert tp_sp.tp_comm_overlap.value == {"all_gather": True, "reduce_scatter": True}
    assert tp_sp.tp_comm_transport.value == "copy-engine"
    tp_only = resolve_plan(_bench("gpt1.3b", "--tensor-model-parallel-size 2", world_size=2), H200)
    assert tp_only.compile_layers.value is True
    # the same command lines on CPU: nothing compiled, fused functions eager, the p2p ring
    cpu = resolve_plan(_bench("gpt1.3b", "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap",
                              world_size=2), CPU)
    assert _values(cpu)["compile_layers"] is False and cpu.fusion_kernels.value == "eager"
    assert cpu.tp_comm_transport.value == "p2p"
    # parameters built on the CPU or the meta device of a GPU process: layers and graphs follow the parameters
    # (as the constructors used to decide), fused kernels and transport the tensors the process computes on
    meta = resolve_plan(_bench("gpt1.3b", "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap "
                               "--compile-layers auto --enable-cuda-graph", world_size=2),
                        DeviceFacts(device_type="meta", cuda=True, compute_capability=(9, 0), tp_backend="nccl"))
    assert meta.compile_layers.value is False and meta.cuda_graphs.value is None
    assert meta.fusion_kernels.value == "compiled" and meta.tp_comm_transport.value == "copy-engine"


def test_explicit_flags_win_over_auto_and_impossible_requests_fail_naming_the_flag():
    plan = resolve_plan(_bench("gpt-small-text", "--compile-layers on --compile-linears on --fusion-kernels eager"),
                        CPU)
    assert plan.compile_layers == Decision(True, "--compile-layers on")
    assert plan.compile_linears.value is True and plan.fusion_kernels.value == "eager"
    off = resolve_plan(_bench("gpt1.3b", "--compile-layers off --compile-linears on"), H200)
    assert off.compile_layers.why == "--compile-layers off"
    assert off.compile_linears == Decision(False, "layers not compiled (--compile-linears on has no effect)")
    p2p = resolve_plan(_bench("gpt1.3b", "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap "
                              "--tp-comm-overlap-transport p2p --disable-tp-comm-overlap-rs", world_size=2), H200)
    assert p2p.tp_comm_transport.value == "p2p" and p2p.tp_comm_overlap.value == {"all_gather": True,
                                                                                "reduce_scatter": False}
    config = _bench("gpt1.3b", "--recompute-activations --compile-layers on --tensor-model-parallel-size 2 "
                    "--sequence-parallel --tp-comm-overlap --tp-comm-overlap-transport copy-engine --fp8-format hybrid",
                    world_size=2)
    config.enable_cuda_graph = True  # (the argument validation refuses graphs with recompute first)
    with pytest.raises(PlanError) as error:
        resolve_plan(config, CPU)
    problems = error.value.problems
    assert len(problems) == 3, problems  # FP8 GEMMs with --tp-comm-overlap are supported (fp8_overlap.py)
    assert not any("--fp8-format" in problem for problem in problems), problems
    for fragment in ("--compile-layers on with selective activation",
                     "--enable-cuda-graph does not support activation recompute (--recompute-granularity selective)",
                     "--tp-comm-overlap-transport copy-engine needs CUDA tensors on an NCCL group"):
        assert any(fragment in problem for problem in problems), (fragment, problems)
    config = _bench("tiny")
    config.compile_layers = "sometimes"
    with pytest.raises(PlanError, match=r"--compile-layers \(compile_layers='sometimes'\): expected one of auto"):
        resolve_plan(config, CPU)


def test_the_table_and_the_stored_form_are_plain():
    plan = resolve_plan(_bench("gpt1.3b", "--fp8-format e4m3 --enable-cuda-graph"), H200)
    table = format_plan(plan).splitlines()
    assert table[0] == "optimisation plan (megatron.core.optimization_plan):"
    assert table[1].split("|")[0].strip() == "decision" and len(table) == 3 + len(plan.decisions())
    rows = {line.split("|")[0].strip(): [part.strip() for part in line.split("|")[1:]] for line in table[3:]}
    assert rows["compile_layers"] == ["on", "auto: CUDA, hidden size 2048 >= 2048"]
    assert rows["cuda_graphs"][0] == "on, per layer, after 3 warm-up steps"
    assert rows["fp8"][0] == "e4m3, delayed (amax history 1, most_recent), margin 0"
    stored = plan.as_dict()
    assert list(stored) == [name for name, _ in plan.decisions()]
    assert stored["fp8"]["value"]["fp8_format"] == "e4m3" and stored["tp_comm_transport"]["value"] is None
    from megatron.training.checkpoint_args import to_plain

    assert to_plain(stored) == stored  # already plain data: it goes into checkpoints as it is


def _tiny_model(**config_kwargs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit.transformer.model_setup import init_single_rank, seed_all

    init_single_rank()
    seed_all(3)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, **config_kwargs)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def test_apply_carries_out_the_plan_and_a_block_refuses_to_run_without_it():
    from megatron.core.fusions import _compile
    from megatron.core.transformer.transformer_block import TransformerBlock
    from tests.unit.transformer.model_setup import teardown_single_rank

    try:
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        position_ids = torch.arange(16).expand(2, 16)
        model = _tiny_model(fp8="hybrid", fp8_recipe="tensorwise", fusion_kernels="eager")
        assert settings_applied_by_plan(model.config) == ["--fp8-format hybrid", "--fusion-kernels eager"]
        bare = TransformerBlock(model.config, model.decoder.submodules)
        with pytest.raises(RuntimeError, match="asks for --fp8-format hybrid, --fusion-kernels eager"):
            bare(torch.zeros(16, 2, 32), None)
        facts = device_facts_of([model])
        assert (facts.device_type, facts.cuda, facts.tp_backend) == ("cpu", torch.cuda.is_available(), "gloo")
        assert facts.transformer_engine_modules == ()
        plan = resolve_plan(model.config, facts)
        apply_optimization_plan([model], plan)
        assert model.decoder.optimization_plan is plan and _compile.eager_fusions_requested()
        fp8_linears = [name for name, module in model.named_modules() if getattr(module, "fp8", None) is not None]
        assert len(fp8_linears) == 8 and all(name.startswith("decoder.layers.") for name in fp8_linears)
        assert model(tokens, position_ids, None, labels=tokens).isfinite().all()
        assert model.decoder.optimization_plan is plan  # the explicit plan stays; the first forward adds none
        with pytest.raises(RuntimeError, match="already have an optimisation plan applied"):
            apply_optimization_plan([model], plan)
    finally:
        teardown_single_rank()


def test_a_model_built_by_user_code_applies_its_config_plan_at_the_first_forward(caplog):
    """Megatron Core scripts build `GPTModel` themselves (no `get_model`): FP8 in the config must just work, and
    the model must run what the trainer runs for the same config."""
    from tests.unit.transformer.model_setup import teardown_single_rank

    try:
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        position_ids = torch.arange(16).expand(2, 16)
        model = _tiny_model(fp8="hybrid", fp8_recipe="tensorwise")
        assert model.decoder.optimization_plan is None
        with caplog.at_level("INFO", logger="megatron.core.optimization_plan.apply"):
            loss = model(tokens, position_ids, None, labels=tokens)
        assert loss.isfinite().all() and model.decoder.optimization_plan is not None
        assert model.decoder.optimization_plan.fp8_recipe is not None
        fp8_linears = [name for name, module in model.named_modules() if getattr(module, "fp8", None) is not None]
        assert len(fp8_linears) == 8
        logged = [record.getMessage() for record in caplog.records]
        assert len(logged) == 1 and "GPTModel: no optimisation plan" in logged[0] and "fp8" in logged[0]
        plan = model.decoder.optimization_plan
        model(tokens, position_ids, None, labels=tokens)
        assert model.decoder.optimization_plan is plan and len(caplog.records) == 1  # once
        plain = _tiny_model()
        assert settings_applied_by_plan(plain.config) == [] and plain.decoder._plan_guard is None
        assert plain(tokens, position_ids, None, labels=tokens).isfinite().all()
        assert plain.decoder.optimization_plan.fp8_recipe is None
    finally:
        teardown_single_rank()
