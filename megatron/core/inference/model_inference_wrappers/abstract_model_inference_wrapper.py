"""`AbstractModelInferenceWrapper`: runs a model forward for the text-generation controller.

It puts the model in eval mode, owns the inference context (a `StaticInferenceContext` sized by the
`InferenceWrapperConfig` unless one is given), feeds a window of columns, advances the static context's
offset, and returns full-vocabulary logits: vocabulary-parallel logits are gathered over tensor-parallel
ranks (`tensor_parallel.mappings`), so every rank samples from the same values.

Pipeline parallelism (Megatron Core's semantics): every stage runs the same loop over the same requests.
A forward receives the activation [s, b, h] from the previous stage (`pipeline_parallel.p2p_communication`),
runs this stage's layers and sends its output on; the last stage's (TP-gathered) logits are then broadcast
to every stage, so each rank samples, scores and advances the requests identically. When
`b * s > inference_batch_times_seqlen_threshold` (and the threshold is not -1) a static-batch forward is
split into micro-batches of `max(1, threshold // s)` rows, each run through all stages in turn (the static
context's `batch_size_offset` says which cache rows they own). A dynamic step is one `[1, T]` sequence,
so it is never split. A stage's layers keep their global numbers, so a dynamic context is built with the
model's total `num_layers` on every stage (each stage fills only its own layers' part).

Decode graphs (`InferenceWrapperConfig.enable_cuda_graph`, default: the model config's `enable_cuda_graph`):
one-column forwards of the static context, and decode-only steps of the dynamic context laid out in its
static buffers, run through a `DecodeGraphRunner` keyed by the batch-size bucket (power of two): the rows
are copied into the bucket's input buffers, the step is replayed (captured on first use) and the logits of
the real rows are returned. Prefills always run eagerly. Decode graphs are refused with pipeline
parallelism (a stage's input activation arrives by p2p, outside any graph).
"""
import abc
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.inference.contexts.static_context import StaticInferenceContext
from megatron.core.inference.decode_graphs import DecodeGraphRunner, batch_bucket, eager_forwards
from megatron.core.pipeline_parallel.p2p_communication import (
    broadcast_from_last_pipeline_stage,
    recv_from_prev_pipeline_rank,
    send_to_next_pipeline_rank,
)
from megatron.core.tensor_parallel.mappings import broadcast_tensor, gather_from_tensor_model_parallel_region
from megatron.core.transformer.utils import get_tp_group, get_tp_world_size


class AbstractModelInferenceWrapper(abc.ABC):
    """Model-agnostic part of the wrappers."""

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
        if config is not None and getattr(config, "sequence_parallel", False):
            raise ValueError("inference with --sequence-parallel is not supported: drop the flag when serving")
        groups = getattr(self._unwrapped(), "model_comm_pgs", None)
        self.tp_group = getattr(groups, "tp", None)
        self.pp_group = self._pipeline_group(config, getattr(groups, "pp", None))
        self._check_dynamic_context_layers(config)
        enabled = getattr(inference_wrapper_config, "enable_cuda_graph", None)
        if enabled is None:
            enabled = bool(getattr(config, "enable_cuda_graph", False))
        self.decode_graphs: Optional[DecodeGraphRunner] = None
        self._decode_graphs_enabled = False
        self._static_buffers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.set_decode_graphs(enabled)

    @staticmethod
    def _pipeline_group(config, pp_group):
        """The pipeline group of a model split over stages (None: pipeline size 1)."""
        if config is None or getattr(config, "pipeline_model_parallel_size", 1) <= 1:
            return None
        return pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()

    def _check_dynamic_context_layers(self, config) -> None:
        """A stage's layers keep their global numbers, which index the dynamic context's memory."""
        context = self.inference_context
        if self.pp_group is None or context is None or not context.is_dynamic_batching():
            return
        layers = getattr(context, "num_layers", None)
        if layers is not None and layers < config.num_layers:
            raise ValueError(f"the dynamic inference context has {layers} layers but the model has "
                             f"{config.num_layers}: with --pipeline-model-parallel-size > 1 a stage's layers keep "
                             "their global numbers, so build the context with num_layers = the model's total")

    @property
    def model_is_pipeline_parallel(self) -> bool:
        """Whether the model is one stage of several (Megatron Core's attribute)."""
        return self.pp_group is not None

    def _is_first_stage(self) -> bool:
        return self.pp_group is None or dist.get_rank(group=self.pp_group) == 0

    def _is_last_stage(self) -> bool:
        return self.pp_group is None or dist.get_rank(group=self.pp_group) == dist.get_world_size(self.pp_group) - 1

    def set_decode_graphs(self, enabled: bool) -> None:
        """Turn static-shape (CUDA-graph) decode steps on or off; the runner is built at the next step."""
        if enabled and self.pp_group is not None:
            raise ValueError("CUDA-graph decode steps (--enable-cuda-graph) are not supported for inference with "
                             "--pipeline-model-parallel-size > 1: drop --enable-cuda-graph when serving")
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
        """Logits [b, s', padded_vocab] (s' = 1 when only the last token is materialised), on every rank."""
        if self.pp_group is not None:
            logits = self._pipeline_forward(inference_input)
        elif not self._uses_decode_graph(inference_input):
            with eager_forwards():
                logits = self._forward(inference_input)
        elif self.inference_context.is_static_batching():
            logits = self._static_decode_step(inference_input)
        else:
            logits = self._dynamic_decode_step()
        if logits is not None and get_tp_world_size(self.tp_group) > 1:
            logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
        if self.pp_group is not None:
            logits = broadcast_from_last_pipeline_stage(self._logits_shape(inference_input),
                                                        self.inference_wrapper_config.params_dtype, self.pp_group,
                                                        tensor=logits)
        if self.inference_context.is_static_batching():
            self.inference_context.sequence_len_offset += inference_input["tokens"].size(1)
        return logits

    def _micro_batch_rows(self, batch: int, seq: int) -> int:
        """Rows per micro-batch of a pipelined forward: all of them unless `batch * seq` exceeds the threshold."""
        threshold = self.inference_wrapper_config.inference_batch_times_seqlen_threshold
        if threshold == -1 or batch * seq <= threshold or not self.inference_context.is_static_batching():
            return batch
        return max(1, threshold // seq)

    @staticmethod
    def _rows_of(inference_input: Dict[str, Any], rows: slice) -> Dict[str, Any]:
        """The inputs of batch rows `rows` (a mask shared by all rows, [1, 1, s, s], stays whole; a batch of
        one row is never split)."""
        batch = inference_input["tokens"].size(0)
        return {key: value[rows] if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == batch else value
                for key, value in inference_input.items()}

    def _pipeline_forward(self, inference_input: Dict[str, Any]) -> Optional[torch.Tensor]:
        """This stage's part of one forward, micro-batched by rows; the last stage returns the logits
        [b, s', V/TP], the others None."""
        batch, seq = inference_input["tokens"].shape
        step = self._micro_batch_rows(batch, seq)
        context = self.inference_context
        outputs = []
        try:
            for start in range(0, batch, step):
                piece = inference_input if step >= batch else self._rows_of(inference_input, slice(start, start + step))
                if context.is_static_batching():
                    context.batch_size_offset = start
                outputs.append(self._stage_forward(piece))
        finally:
            if context.is_static_batching():
                context.batch_size_offset = 0
        if not self._is_last_stage():
            return None
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _activation_dtype(self) -> torch.dtype:
        config = self.inference_wrapper_config
        return torch.float32 if config.fp32_residual_connection else config.params_dtype

    def _stage_forward(self, inference_input: Dict[str, Any]) -> torch.Tensor:
        """Receive the input activation [s, b, h] (not on the first stage), run this stage, send the output on
        (not on the last stage); returns the stage's output (logits on the last stage)."""
        batch, seq = inference_input["tokens"].shape
        if not self._is_first_stage():
            shape = (seq, batch, self.inference_wrapper_config.hidden_size)  # [s, b, h]
            received = recv_from_prev_pipeline_rank(shape, self._activation_dtype(), self.pp_group)
            self._unwrapped().set_input_tensor(received)
        with eager_forwards():
            output = self._forward(inference_input)
        if not self._is_first_stage():
            self._unwrapped().set_input_tensor(None)  # the received activation is not kept past the forward
        if not self._is_last_stage():
            send_to_next_pipeline_rank(output.to(self._activation_dtype()), self.pp_group)
        return output

    def _logits_shape(self, inference_input: Dict[str, Any]) -> Tuple[int, int, int]:
        """The shape of a forward's gathered logits, which the stages before the last cannot see."""
        batch, seq = inference_input["tokens"].shape
        context = self.inference_context
        vocab = self.inference_wrapper_config.padded_vocab_size
        if not context.materialize_only_last_token_logits:
            return batch, seq, vocab
        if context.is_static_batching():
            return batch, 1, vocab
        return 1, len(context.step_layout.request_ids), vocab  # one row per scheduled request

    def broadcast_from_first_tp_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (sampled tokens) made equal on every TP rank: tensor-parallel rank 0's values win."""
        if get_tp_world_size(self.tp_group) == 1:
            return tensor
        group = get_tp_group(self.tp_group)
        return broadcast_tensor(tensor.contiguous(), dist.get_global_rank(group, 0), group)

    def broadcast_sampled_tokens(self, tensor: torch.Tensor, step_fingerprint: Optional[List[int]] = None
                                 ) -> torch.Tensor:
        """Sampled tokens [n] made equal on every model-parallel rank: those of the last stage's TP rank 0 win
        (each stage samples from the same broadcast logits; this also covers RNG streams that drifted apart).

        `step_fingerprint` (ints describing the step's schedule) travels in the same broadcast: a rank whose
        own fingerprint differs from the last stage's has drifted out of step and raises RuntimeError."""
        if get_tp_world_size(self.tp_group) == 1 and self.pp_group is None:
            return tensor
        count = tensor.numel()
        if step_fingerprint is not None:
            local = torch.tensor(step_fingerprint, dtype=tensor.dtype, device=tensor.device)
            tensor = torch.cat([tensor.reshape(-1), local])  # [n] + [f] -> [n + f]
        tensor = self.broadcast_from_first_tp_rank(tensor)
        if self.pp_group is not None:
            tensor = broadcast_from_last_pipeline_stage(tuple(tensor.shape), tensor.dtype, self.pp_group, tensor=tensor)
        if step_fingerprint is None:
            return tensor
        received = tensor[count:].tolist()
        if received != list(step_fingerprint):
            raise RuntimeError(
                f"global rank {dist.get_rank()} is out of step with the last pipeline stage's tensor-parallel "
                f"rank 0: its step schedules {step_fingerprint[:2]} (requests, tokens) with fingerprint "
                f"{step_fingerprint[2:]}, that rank {received[:2]} with {received[2:]}; every rank must make the "
                "same add_request calls before the same steps")
        return tensor[:count]


__all__ = ["AbstractModelInferenceWrapper"]
