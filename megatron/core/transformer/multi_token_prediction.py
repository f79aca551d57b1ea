"""Multi-token prediction (DeepSeek-V3), with Megatron Core's module names and checkpoint keys.

Depth k = 1..D (`mtp_num_layers`) predicts token t+k+1 from position t. With h_0 the decoder output (after its
final norm) and the input ids, position ids, labels and loss mask rolled left by one more column per depth
(the last column filled with 0):

    e   = embedding(ids_k, positions_k)                 (the main model's embedding module)
    h   = eh_proj(cat(enorm(e), hnorm(h_{k-1})))        (column-parallel 2H -> H, gathered over TP)
    h_k = final_layernorm(transformer_layer(h))         (the spec of the decoder's last layer)
    L_k = loss_mask_k * CE(labels_k, output_layer(h_k)) (the main model's output layer / tied weight)

Each depth's `(mtp_loss_scaling_factor / D) * sum(L_k) / n_k` (no `/ n_k` under per-token loss) is attached to
the main hidden states through `MTPLossAutoScaler`, whose backward gives it the main loss's scale (the
schedule sets it after every forward, as for MoE auxiliary losses). The returned main loss excludes MTP;
`MTPLossLoggingHelper` keeps `sum(L_k) / n_k` per depth for the log line (`mtp_1 loss`, ...).

All MTP layers live on the last pipeline stage (`get_mtp_num_layers_to_build`).
"""
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.utils import register_aux_loss_scale_setter
from megatron.core.tensor_parallel.mappings import (
    all_reduce_tensor,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp
from megatron.core.utils import make_viewless_tensor


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dims: int = -1):
    """(tensor rolled left by one along `dims` with the freed last entry set to 0, its sum)."""
    if shifts != -1:
        raise ValueError(f"roll_tensor supports shifts=-1 only (Megatron's use), got {shifts}.")
    rolled = torch.roll(tensor, shifts=shifts, dims=dims)
    rolled.select(dims, -1).fill_(0)
    return rolled, rolled.sum()


class MTPLossAutoScaler(torch.autograd.Function):
    """Identity on the main hidden states whose backward gives the attached MTP loss the gradient
    `main_loss_backward_scale` (the main loss's scale: 1/num_microbatches times the fp16 loss scale)."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, mtp_loss: torch.Tensor):
        """Keep mtp_loss for the backward; return `output` unchanged."""
        ctx.save_for_backward(mtp_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Pass grad_output through; mtp_loss gets `main_loss_backward_scale`."""
        (mtp_loss,) = ctx.saved_tensors
        scale = MTPLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.tensor(1.0, device=mtp_loss.device)
        return grad_output, torch.ones_like(mtp_loss) * scale.to(mtp_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor):
        """Set the backward scale of the attached MTP losses."""
        MTPLossAutoScaler.main_loss_backward_scale = scale


def _set_mtp_loss_scale_from_schedule(config, scale: torch.Tensor) -> None:
    if getattr(config, "mtp_num_layers", None):
        MTPLossAutoScaler.set_loss_scale(scale)


register_aux_loss_scale_setter(_set_mtp_loss_scale_from_schedule)


class MTPLossLoggingHelper:
    """Per-depth MTP losses accumulated over micro-batches for the training log (Megatron's helper)."""

    tracker = {}

    @staticmethod
    def save_loss_to_tracker(loss: torch.Tensor, layer_number: int, num_layers: int, reduce_group=None,
                             avg_group=None):
        """Add `loss` (detached) to depth `layer_number` (0-based) of `num_layers`."""
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker or tracker["values"].numel() != num_layers:
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        tracker["values"][layer_number] += loss.detach()
        tracker["reduce_group"] = reduce_group
        tracker["avg_group"] = avg_group

    @staticmethod
    def clean_loss_in_tracker():
        """Zero the accumulated values."""
        if "values" in MTPLossLoggingHelper.tracker:
            MTPLossLoggingHelper.tracker["values"].zero_()
        MTPLossLoggingHelper.tracker["reduce_group"] = None
        MTPLossLoggingHelper.tracker["avg_group"] = None

    @staticmethod
    def reduce_loss_in_tracker():
        """Sum over the reduce group, average over the avg group (TP x CP); only the last pipeline stage, which
        prints the log line, holds values."""
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        values = tracker["values"]
        if tracker.get("reduce_group") is not None:
            all_reduce_tensor(values, tracker["reduce_group"])
        if tracker.get("avg_group") is not None:
            all_reduce_tensor(values, tracker["avg_group"])
            values.div_(tracker["avg_group"].size())

    @staticmethod
    def track_mtp_metrics(loss_scale: float, iteration: int, writer, wandb_writer=None, total_loss_dict=None):
        """Add `mtp_{k} loss` (times loss_scale = 1/num_microbatches) to total_loss_dict and the writers."""
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        losses = tracker["values"] * loss_scale
        for index, loss in enumerate(losses.tolist()):
            name = f"mtp_{index + 1} loss"
            if total_loss_dict is not None:
                total_loss_dict[name] = total_loss_dict.get(name, 0.0) + torch.tensor(loss)
            if writer is not None:
                writer.add_scalar(name, loss, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: loss}, iteration)
        MTPLossLoggingHelper.clean_loss_in_tracker()


@dataclass
class MultiTokenPredictionLayerSubmodules:
    """Specs of one MTP layer."""

    enorm: Union[ModuleSpec, type] = None
    """Norm of the (rolled) token embedding."""

    hnorm: Union[ModuleSpec, type] = None
    """Norm of the previous depth's hidden states."""

    eh_proj: Union[ModuleSpec, type] = None
    """Column-parallel projection 2H -> H of [embedding | hidden]."""

    transformer_layer: Union[ModuleSpec, type] = None
    """The transformer layer (the decoder's last layer spec)."""

    layer_norm: Union[ModuleSpec, type] = None
    """Final norm (module attribute `final_layernorm`)."""


@dataclass
class MultiTokenPredictionBlockSubmodules:
    """Specs of the MTP layers of this stage."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    """One spec per MTP depth."""


def get_mtp_num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """mtp_num_layers on the last pipeline stage (last virtual stage), 0 elsewhere."""
    if not config.mtp_num_layers:
        return 0
    if parallel_state.model_parallel_is_initialized():
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
            return 0
    return config.mtp_num_layers


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth: enorm / hnorm / eh_proj / transformer_layer / final_layernorm."""

    def __init__(self, config: TransformerConfig, submodules: MultiTokenPredictionLayerSubmodules,
                 layer_number: int = 1, vp_stage: Optional[int] = None, model_comm_pgs=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.tp_group = get_model_comm_pgs_tp(model_comm_pgs)
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.enorm = build_module(submodules.enorm, **norm_kwargs)
        self.hnorm = build_module(submodules.hnorm, **norm_kwargs)
        self.eh_proj = build_module(
            submodules.eh_proj, config.hidden_size * 2, config.hidden_size, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="eh_proj", tp_group=self.tp_group,
        )
        self.transformer_layer = build_module(submodules.transformer_layer, config=config, vp_stage=vp_stage,
                                              model_comm_pgs=model_comm_pgs)
        self.final_layernorm = build_module(submodules.layer_norm, **norm_kwargs)

    def forward(self, decoder_input: torch.Tensor, hidden_states: torch.Tensor, attention_mask=None,
                rotary_pos_emb=None, packed_seq_params=None):
        """decoder_input (this depth's embedding) and hidden_states, both [s, b, h] (or [s/tp, b, h] under SP)."""
        if packed_seq_params is not None:
            raise ValueError("multi-token prediction does not support packed sequences (as in Megatron-LM).")
        combined = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)  # [s, b, 2h]
        hidden_states, _ = self.eh_proj(combined)
        if hidden_states.size(-1) != self.config.hidden_size:
            hidden_states = gather_from_tensor_model_parallel_region(hidden_states, group=self.tp_group)
            if self.config.sequence_parallel:
                hidden_states = scatter_to_sequence_parallel_region(hidden_states, group=self.tp_group)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        hidden_states, _ = self.transformer_layer(hidden_states, attention_mask=attention_mask,
                                                  rotary_pos_emb=rotary_pos_emb)
        return self.final_layernorm(hidden_states)


class MultiTokenPredictionBlock(MegatronModule):
    """The MTP depths of the last pipeline stage (`mtp.layers.{k}`)."""

    def __init__(self, config: TransformerConfig, spec: Union[ModuleSpec, MultiTokenPredictionBlockSubmodules],
                 vp_stage: Optional[int] = None, model_comm_pgs=None):
        super().__init__(config=config)
        submodules = spec.submodules if isinstance(spec, ModuleSpec) else spec
        self.mtp_loss_scaling_factor = config.mtp_loss_scaling_factor
        self.model_comm_pgs = model_comm_pgs
        self.layers = torch.nn.ModuleList([
            build_module(layer_spec, config=config, layer_number=index + 1, vp_stage=vp_stage,
                         model_comm_pgs=model_comm_pgs)
            for index, layer_spec in enumerate(submodules.layer_specs)
        ])

    def _logging_groups(self):
        pgs = self.model_comm_pgs
        if pgs is not None and getattr(pgs, "tp_cp", None) is not None:
            return pgs.tp_cp
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_and_context_parallel_group()
        return None

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, labels, loss_mask, embedding,
                output_layer, output_weight, compute_language_model_loss, rotary_pos_emb=None,
                packed_seq_params=None, runtime_gather_output=None):
        """The main hidden states [s, b, h] with every depth's scaled MTP loss attached (values unchanged)."""
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float)
        main_hidden = hidden_states
        num_depths = len(self.layers)
        for depth, layer in enumerate(self.layers):
            input_ids, _ = roll_tensor(input_ids)
            position_ids, _ = roll_tensor(position_ids)
            labels, _ = roll_tensor(labels)
            loss_mask, num_tokens = roll_tensor(loss_mask)
            decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
            hidden_states = layer(decoder_input, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params)
            logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
            mtp_loss = loss_mask * compute_language_model_loss(labels, logits)  # [b, s]
            MTPLossLoggingHelper.save_loss_to_tracker(torch.sum(mtp_loss) / num_tokens, depth, num_depths,
                                                      avg_group=self._logging_groups())
            scale = self.mtp_loss_scaling_factor / num_depths
            if self.config.calculate_per_token_loss:
                main_hidden = MTPLossAutoScaler.apply(main_hidden, scale * mtp_loss)
            else:
                main_hidden = MTPLossAutoScaler.apply(main_hidden, scale * mtp_loss / num_tokens)
        return main_hidden


__all__ = [
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionBlockSubmodules",
    "MultiTokenPredictionLayer",
    "MultiTokenPredictionLayerSubmodules",
    "MTPLossAutoScaler",
    "MTPLossLoggingHelper",
    "get_mtp_num_layers_to_build",
    "roll_tensor",
]
