"""`SharedExpertMLP`: the always-active experts of an MoE layer (DeepSeek/Qwen style), a dense MLP on the
attention TP group with `ffn_hidden_size = moe_shared_expert_intermediate_size`.

Its input is the MoE layer's input, its output is added after the routed experts' combine. An optional
sigmoid gate (`gate_weight [1, H]`, output * sigmoid(x . gate_weight)) exists in the class, as in Megatron;
the shipped spec does not turn it on.

`--moe-shared-expert-overlap` (alltoall dispatcher): the same math split into five calls that the dispatcher
makes between its own steps (`pre_forward_comm` -> `linear_fc1_forward_and_act` -> `linear_fc2_forward` ->
`post_forward_comm` -> `get_output`), with the linears' TP communication replaced by explicit
gather / reduce-scatter calls here. On CUDA they run on a side stream, so they overlap the dispatcher's
all-to-alls; elsewhere they run in order on the current stream (same results).
"""
import contextlib
from typing import Optional

import torch

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import make_sharded_tensor_for_checkpoint
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_utils import ModelCommProcessGroups, get_default_model_comm_pgs
from megatron.core.transformer.transformer_config import TransformerConfig


def _run_backward_last(tensor: torch.Tensor) -> None:
    """Give the node that made `tensor` the highest sequence number, so autograd runs the shared experts'
    backward before the routed path's (their forward was launched first, on the side stream)."""
    grad_fn = getattr(tensor, "grad_fn", None)
    if grad_fn is not None and hasattr(grad_fn, "_set_sequence_nr"):
        grad_fn._set_sequence_nr(torch.iinfo(torch.int).max)


class SharedExpertMLP(MLP):
    """A dense MLP of width `moe_shared_expert_intermediate_size` run on every token of an MoE layer."""

    stream = None
    """The CUDA side stream of the overlapped mode (one per process)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, gate: bool = False,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        if config.add_bias_linear:
            raise ValueError("shared experts have no bias: use --disable-bias-linear with "
                             "--moe-shared-expert-intermediate-size.")
        if model_comm_pgs is None:
            model_comm_pgs = get_default_model_comm_pgs()
        super().__init__(config=config, submodules=submodules,
                         ffn_hidden_size=config.moe_shared_expert_intermediate_size, tp_group=model_comm_pgs.tp)
        self.tp_group = model_comm_pgs.tp
        self.use_shared_expert_gate = gate
        self.gate_weight = None
        if gate:
            self.gate_weight = torch.nn.Parameter(torch.empty((1, config.hidden_size)))
            if config.perform_initialization:
                config.init_method(self.gate_weight)
            device = self.linear_fc1.weight.device
            self.gate_weight.data = self.gate_weight.data.to(dtype=config.params_dtype, device=device)
            setattr(self.gate_weight, "sequence_parallel", config.sequence_parallel)
        if config.moe_shared_expert_overlap:
            for linear in (self.linear_fc1, self.linear_fc2):
                linear.explicit_expert_comm = True  # the communication happens in the calls below
            self.cached_fc1_input = self.cached_fc2_input = self.cached_fc2_output = None
            self.cached_output = self.gate_score = None
            if SharedExpertMLP.stream is None and torch.cuda.is_available():
                SharedExpertMLP.stream = torch.cuda.Stream()

    def forward(self, hidden_states):
        """[s/TP, b, h] -> [s/TP, b, h] (times the sigmoid gate when enabled)."""
        output, _ = super().forward(hidden_states)
        if self.use_shared_expert_gate:
            output = output * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return output

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The MLP's sharded state dict plus the (replicated) gate weight."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.use_shared_expert_gate:
            key = f"{prefix}gate_weight"
            sharded[key] = make_sharded_tensor_for_checkpoint(self.gate_weight, key, prepend_offsets=sharded_offsets)
        return sharded

    def _on_side_stream(self):
        if self.stream is None or not self.linear_fc1.weight.is_cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def pre_forward_comm(self, input):
        """Overlap step 1: gate score, then the SP all-gather (or TP copy) of the layer input."""
        if self.cached_output is not None:
            raise RuntimeError("SharedExpertMLP: pre_forward_comm called before the previous output was taken.")
        if self.stream is not None and input.is_cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
        with self._on_side_stream():
            if self.use_shared_expert_gate:
                self.gate_score = torch.sigmoid(torch.nn.functional.linear(input, self.gate_weight))
            if self.config.sequence_parallel:
                self.cached_fc1_input = gather_from_sequence_parallel_region(
                    input, tensor_parallel_output_grad=True, group=self.tp_group)
            else:
                self.cached_fc1_input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
            _run_backward_last(self.cached_fc1_input)

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        """Overlap step 2: fc1 and the activation."""
        with self._on_side_stream():
            intermediate, bias = self.linear_fc1(self.cached_fc1_input)
            self.cached_fc1_input = None
            self.cached_fc2_input = self.activation(intermediate, bias)

    def linear_fc2_forward(self, overlapped_comm_output=None):
        """Overlap step 3: fc2 (partial sums over TP)."""
        with self._on_side_stream():
            self.cached_fc2_output, _ = self.linear_fc2(self.cached_fc2_input)
            self.cached_fc2_input = None

    def post_forward_comm(self):
        """Overlap step 4: the SP reduce-scatter (or TP all-reduce) of fc2's output."""
        with self._on_side_stream():
            if self.config.sequence_parallel:
                self.cached_output = reduce_scatter_to_sequence_parallel_region(self.cached_fc2_output,
                                                                                group=self.tp_group)
            else:
                self.cached_output = reduce_from_tensor_model_parallel_region(self.cached_fc2_output,
                                                                              group=self.tp_group)
            self.cached_fc2_output = None
            _run_backward_last(self.cached_output)

    def get_output(self):
        """Overlap step 5: the shared experts' output (gated), joined back to the current stream."""
        with self._on_side_stream():
            output = self.cached_output
            if self.use_shared_expert_gate:
                output = output * self.gate_score
                self.gate_score = None
            self.cached_output = None
        if self.stream is not None and output.is_cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
        return output


__all__ = ["SharedExpertMLP"]
