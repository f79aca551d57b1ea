"""Tiny GPT / Llama-style models, a NullTokenizer, the engines over them, and the full-recompute reference."""
import torch
import torch.nn.functional as F

VOCAB, MAX_SEQ, SEED = 128, 128, 4321


def build_model(kind: str = "gpt", tp: int = 1):
    """A 2-layer model (same weights for any TP size: CPU initialisation from one seed)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, init_method_std=0.3,
              tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0)
    if kind == "llama":
        kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  num_query_groups=2, ffn_hidden_size=64)
    config = TransformerConfig(**kw)
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=VOCAB, max_sequence_length=MAX_SEQ, share_embeddings_and_output_weights=kind == "gpt",
                     position_embedding_type="rope" if kind == "llama" else "learned_absolute")
    return model.eval()


def tokenizer():
    """Ids as text ('3 17 5'); eod = VOCAB - 1."""
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    return _NullTokenizer(VOCAB - 1)


class CharTokenizer:
    """Printable ASCII, one token per character; eod = 127 (for the server's text routes)."""

    vocab_size = VOCAB
    eod = VOCAB - 1

    def tokenize(self, text: str):
        return [ord(c) if ord(c) < self.eod else ord("?") for c in text]

    def detokenize(self, ids) -> str:
        return "".join(chr(int(t)) for t in ids if int(t) != self.eod)

    def offsets(self, ids, text: str):
        return list(range(len(ids)))


def wrapper_config(max_requests: int = 8, max_seq: int = MAX_SEQ):
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

    return InferenceWrapperConfig(hidden_size=32, params_dtype=torch.float32, inference_batch_times_seqlen_threshold=-1,
                                  padded_vocab_size=VOCAB, inference_max_requests=max_requests,
                                  inference_max_seq_length=max_seq)


def static_engine(model, max_requests: int = 8, tokenizer_=None):
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    wrapped = GPTInferenceWrapper(model, wrapper_config(max_requests))
    controller = TextGenerationController(wrapped, tokenizer_ or tokenizer())
    return StaticInferenceEngine(controller, max_batch_size=max_requests)


def dynamic_engine(model, tp: int = 1, chunk: int = 8, max_requests: int = 4, buffer_gb: float = 0.0005,
                   kv_layer_numbers=None):
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    config = model.config
    context = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=config.num_layers, kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups, max_sequence_length=MAX_SEQ, buffer_size_gb=buffer_gb,
        buffer_guaranteed_fraction=0.1, chunk_size_tokens=chunk, max_requests_override=max_requests,
        max_tokens_override=64, tensor_model_parallel_size=tp, kv_layer_numbers=kv_layer_numbers,
    )
    wrapped = GPTInferenceWrapper(model, wrapper_config(), inference_context=context)
    return DynamicInferenceEngine(TextGenerationController(wrapped, tokenizer()), context,
                                  termination_id=VOCAB - 1, random_seed=SEED)


@torch.no_grad()
def run_with_arrivals(engine, prompts, budgets, arrivals, sampling_params):
    """Step a dynamic engine while requests join before the steps `arrivals` ({step: [request ids]}) names;
    returns {request id: generated tokens}."""
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid in arrivals.get(step, []):
            engine.add_request(rid, prompts[rid], budgets[rid])
        finished, _ = engine.step(sampling_params)
        done.update((r.request_id, r.generated_tokens) for r in finished)
        step += 1
    return done


def reference_greedy(model, prompt_tokens, num_tokens: int, eod: int = VOCAB - 1):
    """Greedy tokens by recomputing the whole sequence every step (no KV cache)."""
    ids = list(prompt_tokens)
    out = []
    for _ in range(num_tokens):
        n = len(ids)
        tokens = torch.tensor([ids])
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1).view(1, 1, n, n)  # [s, s] -> [1, 1, s, s]
        logits = model(tokens, torch.arange(n).unsqueeze(0), mask)  # [s] -> [1, s]
        token = int(torch.argmax(logits[0, -1, :VOCAB]))
        if token == eod:
            break
        ids.append(token)
        out.append(token)
    return out


@torch.no_grad()
def reference_log_probs(model, ids):
    """log P(ids[j+1] | ids[:j+1]) for j in 0..len-2 from one full forward."""
    n = len(ids)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1).view(1, 1, n, n)  # [s, s] -> [1, 1, s, s]
    logits = model(torch.tensor([ids]), torch.arange(n).unsqueeze(0), mask)[0].float()  # [s] -> [1, s]
    scores = torch.log_softmax(logits, -1)
    return scores[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()


def prompts(count: int, lengths, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]
