"""`AbstractModelInferenceWrapper`: runs a model forward for the text-generation controller.

It puts the model in eval mode, owns the inference context (a `StaticInferenceContext` sized by the
`InferenceWrapperConfig` unless one is given), feeds a window of columns, advances the static context's
offset, and returns full-vocabulary logits: vocabulary-parallel logits are gathered over tensor-parallel
ranks (`tensor_parallel.mappings`), so every rank samples from the same values.
"""
import abc
from typing import Any, Dict, Optional

import torch

from megatron.core.inference.contexts.static_context import StaticInferenceContext
import torch.distributed as dist

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

    @torch.no_grad()
    def run_one_forward_step(self, inference_input: Dict[str, Any]) -> torch.Tensor:
        """Logits [b, s', padded_vocab] (s' = 1 when only the last token is materialised)."""
        logits = self._forward(inference_input)
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
