"""`GPTInferenceWrapper`: token windows, positions and the causal mask of a GPT model for the controller."""
from typing import Any, Dict

import torch

from megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)


class GPTInferenceWrapper(AbstractModelInferenceWrapper):
    """Wrapper of `GPTModel` (and models with its forward signature)."""

    def prep_inference_input(self, prompts_tokens: torch.Tensor) -> Dict[str, Any]:
        """tokens [b, s], position_ids [b, s] (0..s-1) and the causal mask [1, 1, s, s] (True: masked)."""
        batch, seq = prompts_tokens.shape
        device = prompts_tokens.device
        position_ids = torch.arange(seq, dtype=torch.long, device=device).unsqueeze(0).expand(batch, seq)  # [s] -> [b, s]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)
        return {"tokens": prompts_tokens, "position_ids": position_ids,
                "attention_mask": mask.view(1, 1, seq, seq)}  # [s, s] -> [1, 1, s, s]

    def get_batch_for_context_window(self, inference_input: Dict[str, Any], context_start_position: int,
                                     context_end_position: int) -> Dict[str, Any]:
        """Columns [start, end): the context attends to the cached earlier columns itself."""
        window = slice(context_start_position, context_end_position)
        mask = inference_input["attention_mask"][..., window, :context_end_position]
        return {"tokens": inference_input["tokens"][:, window], "position_ids": inference_input["position_ids"][:, window],
                "attention_mask": mask}


__all__ = ["GPTInferenceWrapper"]
