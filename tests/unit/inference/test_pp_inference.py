"""Pipeline-parallel inference on 4 gloo ranks (one launch): PP=2 (a tied-embedding GPT, two data-parallel
replicas), TP=2 x PP=2 (a Llama-style model) and PP=4 (a 4-layer GPT: middle stages receive and send). In each
layout the static engine's greedy tokens and log-probabilities, its seeded top-k samples, the same runs
micro-batched by a small `inference_batch_times_seqlen_threshold`, and the dynamic engine with requests of
different lengths joining mid-flight (one longer than the step's token budget: chunked prefill) equal the
single-process (PP=1) engines token for token; every rank returns the same results. CUDA-graph decode steps
and a dynamic context sized for one stage's layers are refused with a message; ranks whose dynamic schedule
drifted from the last stage's raise. In the TP=2 x PP=2 layout rank 0 also serves `PUT /api` over HTTP while
the other ranks follow its broadcast requests.

Tolerances: log-probabilities to 1e-4 (fp32; stage splits, TP reductions and micro-batches change only the
summation order).
"""
import http.client
import json

import torch
import torch.nn.functional as F

from tests.harness import run_on_ranks, tp_slice
from tests.unit.inference import tiny_gpt as T
from tests.unit.transformer.model_setup import init_single_rank, teardown_single_rank

NEW = 8
PROMPTS = T.prompts(5, [3, 9, 5, 12, 1])
DYNAMIC_PROMPTS = T.prompts(5, [5, 70, 2, 17, 9], seed=11)  # 70 > the 64-token step budget: chunked prefill
DYNAMIC_BUDGETS = [10, 6, 12, 3, 8]
ARRIVALS = {0: [0, 1], 2: [2], 3: [3], 5: [4]}  # step -> requests joining before it
LAYOUTS = [("gpt", 2, 1, 2), ("llama", 2, 2, 2), ("gpt", 4, 1, 4)]  # (model kind, layers, TP, PP) on 4 ranks
SERVER_PROMPTS = ["Hello", "The quick brown"]
SERVER_TOKENS = 5


def _greedy(num=NEW, **kw):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=num, **kw)


def _sampled():
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=8, num_tokens_to_generate=NEW)


def _greedy_run(engine):
    """Greedy (tokens, prompt + generated log-probs) of PROMPTS."""
    tok = T.tokenizer()
    results = engine.generate(prompts=[tok.detokenize(p) for p in PROMPTS],
                              sampling_params=_greedy(return_log_probs=True))
    return [r.generated_tokens for r in results], [r.prompt_log_probs + r.generated_log_probs for r in results]


def _static_runs(engine, threshold=-1):
    """Greedy tokens, log-probs and the number of stage forwards they took (None at PP=1) under `threshold`,
    then seeded top-k tokens of PROMPTS."""
    wrapped = engine.text_generation_controller.inference_wrapped_model
    wrapped.inference_wrapper_config.inference_batch_times_seqlen_threshold = threshold
    calls = _count_stage_forwards(wrapped) if wrapped.model_is_pipeline_parallel else [None]
    greedy, log_probs = _greedy_run(engine)
    engine.random_seed = 5
    sampled = engine.generate(prompts=[T.tokenizer().detokenize(p) for p in PROMPTS], sampling_params=_sampled())
    return {"greedy": greedy, "log_probs": log_probs, "stage_forwards": calls[0],
            "sampled": [r.generated_tokens for r in sampled]}


def _dynamic_run(engine):
    """Generated tokens of DYNAMIC_PROMPTS joining at the steps of ARRIVALS (4 request slots)."""
    done = T.run_with_arrivals(engine, DYNAMIC_PROMPTS, DYNAMIC_BUDGETS, ARRIVALS, _greedy())
    return [done[i] for i in range(len(DYNAMIC_PROMPTS))]


def _dynamic_engine(model, tp=1, stage_kv=False):
    """tiny_gpt's dynamic engine (4 request slots), its buffer grown with the layer count (same chunk count).
    With `stage_kv` the key/value buffer holds only this stage's layers (`attention_layer_numbers` of the
    stage: global numbers), its size scaled to them (the same chunk count again)."""
    from megatron.core.inference.contexts.dynamic_context import attention_layer_numbers

    numbers = attention_layer_numbers(model) if stage_kv else None
    layers = len(numbers) if stage_kv else model.config.num_layers
    return T.dynamic_engine(model, tp=tp, max_requests=4, buffer_gb=0.00025 * layers, kv_layer_numbers=numbers)


def _model_kwargs(kind, layers):
    """tiny_gpt's model (same sizes and initialisation), with `layers` layers."""
    kw = dict(num_layers=layers, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, init_method_std=0.3,
              hidden_dropout=0.0, attention_dropout=0.0)
    if kind == "llama":
        kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  num_query_groups=2, ffn_hidden_size=64)
    return kw


def _reference_name(model, name, tied):
    """The single-process name of a stage parameter (layers renumbered globally)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    if tied and parts[0] == "output_layer":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def _shard(param, full):
    """This rank's TP shard of the single-process tensor `full` (strided partitions: GLU's [gate; up] halves
    are each split, and the rank's pieces concatenated)."""
    from megatron.core import parallel_state

    stride = getattr(param, "partition_stride", 1)
    if not getattr(param, "tensor_model_parallel", False) or stride == 1:
        return tp_slice(param, full)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    pieces = [piece.chunk(tp, dim=param.partition_dim)[rank] for piece in full.chunk(stride, dim=param.partition_dim)]
    return torch.cat(pieces, dim=param.partition_dim)


def _gpt_model(kind, layers, tp=1, pp=1, pre_process=True, post_process=True):
    """tiny_gpt's GPTModel, or one pipeline stage of it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32, **_model_kwargs(kind, layers))
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                    vocab_size=T.VOCAB, max_sequence_length=T.MAX_SEQ, share_embeddings_and_output_weights=kind == "gpt",
                    position_embedding_type="rope" if kind == "llama" else "learned_absolute",
                    pre_process=pre_process, post_process=post_process).eval()


def _stage_model(kind, layers, tp, pp, state):
    """This rank's stage (and TP shard) of the model, with the single-process weights."""
    from megatron.core import parallel_state

    model = _gpt_model(kind, layers, tp, pp, parallel_state.is_pipeline_first_stage(),
                       parallel_state.is_pipeline_last_stage())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_shard(param, state[_reference_name(model, name, kind == "gpt")]))
    return model


def _count_stage_forwards(wrapped):
    """Wrap the wrapper's per-stage forward with a call counter; returns the counter (a one-item list)."""
    calls, stage_forward = [0], wrapped._stage_forward

    def counted(piece):
        calls[0] += 1
        return stage_forward(piece)

    wrapped._stage_forward = counted
    return calls


def _refusals(model, tp):
    """The messages of what PP inference refuses: decode graphs, a dynamic context sized for one stage."""
    import pytest

    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    messages = []
    with pytest.raises(ValueError, match="--enable-cuda-graph") as graphs:
        T.static_engine(model).text_generation_controller.inference_wrapped_model.set_decode_graphs(True)
    messages.append(str(graphs.value))
    context = DynamicInferenceContext(params_dtype=torch.float32, num_layers=1, kv_channels=model.config.kv_channels,
                                      num_attention_heads=model.config.num_query_groups, max_sequence_length=T.MAX_SEQ,
                                      buffer_size_gb=0.0005, buffer_guaranteed_fraction=0.1, chunk_size_tokens=8,
                                      max_requests_override=4, max_tokens_override=64, tensor_model_parallel_size=tp)
    with pytest.raises(ValueError, match="num_layers = the model's total") as layers:
        GPTInferenceWrapper(model, T.wrapper_config(), inference_context=context)
    messages.append(str(layers.value))
    return messages


def _drift_detected(model, tp):
    """One dynamic step where the first stage's ranks hold another request id than the last stage's: the ranks
    that differ from the last stage raise (after the step's collectives, so nobody hangs)."""
    from megatron.core import parallel_state

    engine = _dynamic_engine(model, tp)
    engine.add_request(7 if parallel_state.is_pipeline_first_stage() else 8, DYNAMIC_PROMPTS[0], 4)
    try:
        engine.step(_greedy())
    except RuntimeError as error:
        return "out of step" in str(error)
    return False


def _server_answer():
    """Rank 0: serve on a free port, PUT /api once, stop serving (which releases the followers)."""
    from megatron.inference.text_generation_server import MegatronServer

    def run(engine):
        server = MegatronServer(engine)
        port = server.start("127.0.0.1", 0)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("PUT", "/api", body=json.dumps({"prompts": SERVER_PROMPTS, "tokens_to_generate": SERVER_TOKENS,
                                                         "top_k": 1}), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            status, text = response.status, response.read().decode()
            conn.close()
        finally:
            server.shutdown()
        return status, json.loads(text)["text"] if status == 200 else text

    return run


def _pp_layouts(states):
    """Every LAYOUTS case on this rank; returns {layout: results}."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.inference.text_generation.mcore_engine_server import serve_follower_ranks

    results = {}
    for kind, layers, tp, pp in LAYOUTS:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model = _stage_model(kind, layers, tp, pp, states[(kind, layers)])
        got = _static_runs(T.static_engine(model, max_requests=4))
        micro = _static_runs(T.static_engine(model, max_requests=4), threshold=2)  # prefill: 1 row, decode: 2
        got.update({f"micro_{key}": value for key, value in micro.items()})
        got["dynamic"] = _dynamic_run(_dynamic_engine(model, tp))
        stage_engine = _dynamic_engine(model, tp, stage_kv=True)
        got["dynamic_stage_kv"] = _dynamic_run(stage_engine)
        got["stage_kv_layers"] = list(stage_engine.context.kv_layer_numbers)
        got["stage_layers"] = [layer.layer_number for layer in model.decoder.layers]
        got["refused"] = _refusals(model, tp)
        got["drift_detected"] = _drift_detected(model, tp)
        got["first_stage"] = parallel_state.is_pipeline_first_stage()
        if tp > 1:  # the TP=2 x PP=2 layout also serves
            server_engine = T.static_engine(model, tokenizer_=T.CharTokenizer())
            if dist.get_rank() == 0:
                got["server"] = _server_answer()(server_engine)
            else:
                serve_follower_ranks(server_engine)
        results[(kind, layers, tp, pp)] = got
        parallel_state.destroy_model_parallel()
    return results


def _single_process_reference():
    """Weights and PP=1 results of each (model kind, layers)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    init_single_rank()
    try:
        states, want = {}, {}
        for key in sorted({layout[:2] for layout in LAYOUTS}):
            model_parallel_cuda_manual_seed(T.SEED)
            torch.manual_seed(T.SEED)
            model = _gpt_model(*key)
            states[key] = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
            want[key] = _static_runs(T.static_engine(model, max_requests=4))
            want[key]["dynamic"] = _dynamic_run(_dynamic_engine(model))
            tok = T.CharTokenizer()
            want[key]["server"] = [p + tok.detokenize(T.reference_greedy(model, tok.tokenize(p), SERVER_TOKENS))
                                   for p in SERVER_PROMPTS]
        return states, want
    finally:
        teardown_single_rank()


def _close(a, b, tol=1e-4):
    return all(len(x) == len(y) and max((abs(p - q) for p, q in zip(x, y)), default=0.0) < tol for x, y in zip(a, b))


def test_pipeline_parallel_generation_equals_single_process():
    states, want = _single_process_reference()
    per_rank = run_on_ranks(_pp_layouts, 4, states, timeout=120)
    for layout in LAYOUTS:
        ref = want[layout[:2]]
        for rank, results in enumerate(per_rank):
            got = results[layout]
            for prefix in ("", "micro_"):
                assert got[f"{prefix}greedy"] == ref["greedy"], (layout, rank, prefix)
                assert _close(got[f"{prefix}log_probs"], ref["log_probs"]), (layout, rank, prefix)
                assert got[f"{prefix}sampled"] == ref["sampled"], (layout, rank, prefix)
            assert got["dynamic"] == ref["dynamic"], (layout, rank)
            # a key/value buffer of the stage's own layers only: the same tokens
            assert got["dynamic_stage_kv"] == ref["dynamic"], (layout, rank)
            assert got["stage_kv_layers"] == got["stage_layers"] and len(got["stage_layers"]) < layout[1], rank
            assert len(got["refused"]) == 2, (layout, rank)
            assert got["drift_detected"] == got["first_stage"], (layout, rank)
            # the threshold split the forwards: a prefill of b rows into b, a 4-row decode step into 2
            assert got["micro_stage_forwards"] > 1.5 * got["stage_forwards"], (layout, rank)
        if layout[2] > 1:
            assert per_rank[0][layout]["server"] == (200, ref["server"])
