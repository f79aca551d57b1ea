"""`AbstractModelInferenceWrapper`: runs a model forward for the text-generation controller.

It puts the model in eval mode, owns the inference context (a `StaticInferenceContext` sized by the
`InferenceWrapperConfig` unless one is given), feeds a window of columns, advances the static context's
offset, and returns full-vocabulary logits: vocabulary-parallel logits are gathered over tensor-parallel
ranks (`tensor_parallel.mappings`), so every rank samples from the same values.

Decode graphs (`InferenceWrapperConfig.enable_cuda_graph`, default: the model config's `enable_cuda_graph`):
one-column forwards of the static context, and decode-only steps of the dynamic context laid out in its
static buffers, run through a `DecodeGraphRunner` keyed by the batch-size bucket (power of two): the rows
are copied into the bucket's input buffers, the step is replayed (captured on first use) and the logits of
the real rows are returned. Prefills always run eagerly.
"""
import abc
from typing import Any, Dict, Optional, Tuple

import torch

import torch.distributed as dist

from megatron.core.inference.contexts.static_context import StaticInferenceContext
from megatron.core.inference.decode_graphs import DecodeGraphRunner, batch_bucket, eager_forwards

from megatron.core.tensor_parallel.mappings import broadcast_tensor, gather_from_tensor_model_parallel_region
from megatron.core.transformer.utils import get_tp_group, get_tp_world_size


class AbstractModelInferenceWrapper(abc.ABC):
    """Model-agnostic part of the wrappers (pipeline size 1)."""

    def __init__(self, model, inference_wrapper_config, inference_context: Optional[Any] = None):
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ValueError(f"inference takes one model chunk, got {len(model)} (interleaved pipeline "
                                 "parallelism is not supported for inference)")
            model = model[0]
        self.model = model
        self.inference_wrapper_config = inference_wrapper_config
        self.inference_context = inference_context
        config = self._transformer_config()
        if config is not None and getattr(config, "pipeline_model_parallel_size", 1) > 1:
            raise ValueError("inference with --pipeline-model-parallel-size > 1 is not supported yet: run the "
                             "server with pipeline-model-parallel-size 1 (tensor parallelism is supported)")
        if config is not None and getattr(config, "sequence_parallel", False):
            raise ValueError("inference with --sequence-parallel is not supported: drop the flag when serving")
        self.tp_group = getattr(getattr(self._unwrapped(), "model_comm_pgs", None), "tp", None)
        enabled = getattr(inference_wrapper_config, "enable_cuda_graph", None)
        if enabled is None:
            enabled = bool(getattr(config, "enable_cuda_graph", False))
        self.decode_graphs: Optional[DecodeGraphRunner] = None
        self._decode_graphs_enabled = False
        self._static_buffers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.set_decode_graphs(enabled)

    def set_decode_graphs(self, enabled: bool) -> None:
        """Turn static-shape (CUDA-graph) decode steps on or off; the runner is built at the next step."""
        self._decode_graphs_enabled = bool(enabled)
        self.decode_graphs = None
        self._static_buffers = {}
        context = self.inference_context
        if context is not None and context.is_dynamic_batching():
            context.static_decode = self._decode_graphs_enabled

    def _runner(self) -> DecodeGraphRunner:
        if self.decode_graphs is None:
            cfg = self.inference_wrapper_config
            self.decode_graphs = DecodeGraphRunner(self.device, getattr(cfg, "cuda_graph_warmup_steps", 2),
                                                   compile_step=getattr(cfg, "compile_decode_step", False))
        return self.decode_graphs

    def _unwrapped(self):
        module = self.model
        while hasattr(module, "module"):
            module = module.module
        return module

    def _transformer_config(self):
        return getattr(self._unwrapped(), "config", None)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live."""
        return next(self.model.parameters()).device

    def prep_model_for_inference(self, prompts_tokens: Optional[torch.Tensor] = None) -> None:
        """Eval mode, and a fresh (or reset) static context."""
        self.model.eval()
        if self.inference_context is None:
            self.inference_context = StaticInferenceContext.from_config(self.inference_wrapper_config)
        if self.inference_context.is_static_batching():
            self.inference_context.reset()

    @abc.abstractmethod
    def prep_inference_input(self, prompts_tokens: torch.Tensor) -> Dict[str, Any]:
        """The model inputs of the whole padded batch."""

    @abc.abstractmethod
    def get_batch_for_context_window(self, inference_input: Dict[str, Any], context_start_position: int,
                                     context_end_position: int) -> Dict[str, Any]:
        """The inputs of columns [start, end)."""

    def _forward(self, inference_input: Dict[str, Any]) -> torch.Tensor:
        return self.model(inference_input["tokens"], inference_input["position_ids"],
                          inference_input.get("attention_mask"), inference_context=self.inference_context)

    def _static_decode_step(self, inference_input: Dict[str, Any]) -> torch.Tensor:
        """One column of the static context through the bucket's graph: logits [b, 1, V/TP]."""
        context = self.inference_context
        tokens = inference_input["tokens"]
        rows = tokens.size(0)
        bucket = batch_bucket(rows, context.max_batch_size)
        buffers = self._static_buffers.get(bucket)
        if buffers is None:
            buffers = tuple(torch.zeros(bucket, 1, dtype=torch.long, device=tokens.device) for _ in range(2))
            self._static_buffers[bucket] = buffers
        ids, positions = buffers
        ids[:rows].copy_(tokens)
        positions[:rows].copy_(inference_input["position_ids"])
        context.set_decode_position(tokens.device)
        cache = next(iter(context.key_value_memory_dict.values()))[0]

        def step():
            context.static_decode = True
            try:
                return self.model(ids, positions, None, inference_context=context)
            finally:
                context.static_decode = False

        key = ("static", bucket, context.decode_window, id(context), cache.data_ptr())
        return self._runner().run(key, step)[:rows]

    def _dynamic_decode_step(self) -> torch.Tensor:
        """A decode-only dynamic step laid out in the context's static buffers: logits [1, R, V/TP]."""
        context = self.inference_context
        layout = context.step_layout
        input_ids = layout.input_ids.unsqueeze(0)  # [R_b] -> [1, R_b]
        position_ids = layout.positions.unsqueeze(0)  # [R_b] -> [1, R_b]

        def step():
            return self.model(input_ids, position_ids, None, inference_context=context)

        key = ("dynamic",) + layout.graph_key + (id(context),)
        return self._runner().run(key, step)[:, :len(layout.request_ids)]

    def _uses_decode_graph(self, inference_input: Dict[str, Any]) -> bool:
        if not self._decode_graphs_enabled:
            return False
        context = self.inference_context
        if context.is_static_batching():
            return inference_input["tokens"].size(1) == 1 and bool(context.key_value_memory_dict)
        return getattr(context.step_layout, "graph_key", None) is not None

    @torch.no_grad()
    def run_one_forward_step(self, inference_input: Dict[str, Any]) -> torch.Tensor:
        """Logits [b, s', padded_vocab] (s' = 1 when only the last token is materialised)."""
        if not self._uses_decode_graph(inference_input):
            with eager_forwards():
                logits = self._forward(inference_input)
        elif self.inference_context.is_static_batching():
            logits = self._static_decode_step(inference_input)
        else:
            logits = self._dynamic_decode_step()
        if get_tp_world_size(self.tp_group) > 1:
            logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
        if self.inference_context.is_static_batching():
            self.inference_context.sequence_len_offset += inference_input["tokens"].size(1)
        return logits

    def broadcast_from_first_tp_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (sampled tokens) made equal on every TP rank: tensor-parallel rank 0's values win."""
        if get_tp_world_size(self.tp_group) == 1:
            return tensor
        group = get_tp_group(self.tp_group)
        return broadcast_tensor(tensor.contiguous(), dist.get_global_rank(group, 0), group)


__all__ = ["AbstractModelInferenceWrapper"]
