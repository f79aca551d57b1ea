"""`DynamicInferenceContext`: paged key/value memory for in-flight (continuous) batching.

Every step runs ONE forward over the tokens of all scheduled requests flattened into a `[1, T]` sequence:
the prompts (or prompt chunks: chunked prefill) of newly admitted requests and one token per decoding
request. Keys/values live in `memory_buffer [2 (K, V), num_layers, chunk_count, chunk_size_tokens, ng / TP, hn]`;
each request owns a list of chunks (`request_to_kv_chunk_ids`), so requests of any length share the buffer
without padding. Requests join between steps (`add_request`) and leave when finished (their chunks go back
to the allocator). A request that needs a new chunk while memory is short is paused for the step and
resumed when chunks free up.

Key and value head dims may differ (`value_channels`, multi-latent attention: keys q_head_dim, values
v_head_dim): the buffer's last axis is the larger one and each side uses its leading part. With
`cache_mla_latents` multi-latent attention layers cache their compressed latent instead (see
`multi_latent_attention.py`): `num_attention_heads` is then the one latent head, the same on every TP rank,
and as the value is the key's leading part ([latent | k_pe]) the buffer holds keys only:
`memory_buffer [1, num_layers, chunk_count, chunk_size_tokens, 1, kv_lora_rank + d_r]` (bytes per chunk
accordingly). Layers that rotate
their own keys read the step's token positions from `token_positions`.

`kv_layer_numbers` (default: every layer 1..num_layers) names the layers that cache keys/values; the buffer
holds those alone (`memory_buffer[:, i]` is the i-th of them; the sizes count them instead of `num_layers`), so
a hybrid model gives its attention layers only (`attention_layer_numbers(model)`).

Mamba layers of hybrid models keep per-request recurrent states instead of paged keys/values: each admitted
request takes a state slot (`mamba_slot`, freed with the request) and every Mamba layer keeps
`mamba_states[layer_number] = (conv [d_conv, max_requests + 1, conv_dim / TP], ssm [heads / TP,
max_requests + 1, head_dim, d_state])` (slot `max_requests` is a dummy for padding rows).
`mamba_segments()` tells the mixer which tokens of the step belong to which slot, and whether the request
starts there (fresh state) or continues (a chunked-prefill continuation or a decode token).

Sizes follow Megatron Core: `chunk_size_bytes = dtype_bytes * 2 * num_layers * chunk_size_tokens * heads * hn`;
the buffer holds `int(buffer_size_gb * 2**30) // chunk_size_bytes` chunks (the last is a dummy);
`max_tokens = chunks * chunk_size_tokens`, `max_requests = max_tokens // max_sequence_length`; with
`buffer_overflow_factor f` they become `roundup4(max_requests * f)` and `roundup64(max_tokens * f / 50)`;
the overrides replace them (rounded the same way) and `max_requests <= max_tokens`. The guaranteed reserve is
`gtd_request_count = roundup4(min(max(1, requests fitting in the guaranteed fraction), max_requests))`
requests of `ceil(max_sequence_length / chunk_size_tokens)` chunks each.

Static-shape decode (`static_decode`, set by the wrapper under CUDA graphs): a step where every scheduled
request feeds exactly one token is laid out in buffers of a (request bucket, chunk bucket) pair, both powers
of two: token ids, positions, write chunk/offset and the chunk table live in one int64 device tensor per
pair, refilled by one host-to-device copy; padding rows read and write the dummy chunk at position 0. The
attention mask `key position <= query position` is then built on the device, so the step is graph-safe.
"""
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.inference.contexts.dynamic_chunk_allocator import ChunkAllocator
from megatron.core.inference.contexts.kv_attention import attend_padded, check_value_in_key, rotary_table, rotate
from megatron.core.inference.decode_graphs import batch_bucket
from megatron.core.transformer.attention import Attention


class ContextOverflowError(Exception):
    """The context cannot take a request now or ever."""


class RequestOverflowError(ContextOverflowError):
    """More requests than `max_requests`."""


class TokenOverflowError(ContextOverflowError):
    """More tokens than `max_tokens`."""


class MaxSequenceLengthOverflowError(ContextOverflowError):
    """Prompt + tokens to generate exceed `max_sequence_length`."""


class ChunkOverflowError(ContextOverflowError):
    """Not enough free chunks."""


def kv_cache_dims(config, cache_mla_latents: bool = False) -> tuple:
    """(key/value heads, key head dim, value head dim) a model's attention layers cache (before TP).

    Multi-latent attention caches every head's decompressed key (qk_head_dim + qk_pos_emb_head_dim) and value
    (v_head_dim), or with `cache_mla_latents` one head (replicated over TP) of key [latent | k_pe]
    (kv_lora_rank + qk_pos_emb_head_dim) and value latent (kv_lora_rank); other attention caches
    num_query_groups heads of kv_channels."""
    if getattr(config, "multi_latent_attention", False):
        if cache_mla_latents:
            return 1, config.kv_lora_rank + config.qk_pos_emb_head_dim, config.kv_lora_rank
        return (config.num_attention_heads, config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim)
    heads = config.num_query_groups or config.num_attention_heads
    return heads, config.kv_channels, config.kv_channels


def attention_layer_numbers(model) -> List[int]:
    """The layer numbers of a model's attention layers (those that cache keys/values; a hybrid model's `*`)."""
    return sorted({module.layer_number for module in model.modules() if isinstance(module, Attention)})


def _round_up(value: float, multiple: int) -> int:
    return int(math.ceil(int(value) / multiple) * multiple)


@dataclass
class _RequestState:
    request_id: int
    tokens: List[int]
    prompt_length: int
    max_length: int
    kv_length: int = 0
    chunks: List[int] = field(default_factory=list)
    paused: bool = False
    mamba_slot: int = -1


@dataclass
class _StepLayout:
    """Index tensors of one step, built once and read by every layer."""

    request_ids: List[int]
    query_lengths: List[int]
    positions: torch.Tensor  # [T]
    write_chunks: torch.Tensor  # [T]
    write_offsets: torch.Tensor  # [T]
    chunk_table: torch.Tensor  # [R, C]
    query_slots: torch.Tensor  # [T] index into R * Qmax
    max_query: int
    allowed: Optional[torch.Tensor]  # [R, 1, Qmax, C * chunk]; None: built from positions (static decode)
    last_token_index: torch.Tensor  # [R]
    graph_key: Optional[tuple] = None  # (request bucket, chunk bucket) of a static-shape decode step
    input_ids: Optional[torch.Tensor] = None  # [R_b] token ids of a static-shape decode step
    mamba_slots: Optional[torch.Tensor] = None  # [R] or [R_b] Mamba state slot of every row
    segments: Optional[List[tuple]] = None  # (first token, count, slot, fresh) per scheduled request


class DynamicInferenceContext(BaseInferenceContext):
    """Paged key/value memory, request book-keeping and the per-step token layout."""

    def __init__(
        self,
        params_dtype: torch.dtype,
        num_layers: int,
        kv_channels: int,
        num_attention_heads: int,
        max_sequence_length: int,
        buffer_size_gb: float,
        buffer_guaranteed_fraction: float,
        chunk_size_tokens: int = 256,
        buffer_overflow_factor: Optional[float] = None,
        max_requests_override: Optional[int] = None,
        max_tokens_override: Optional[int] = None,
        tensor_model_parallel_size: Optional[int] = None,
        materialize_only_last_token_logits: bool = True,
        device: Optional[torch.device] = None,
        value_channels: Optional[int] = None,
        cache_mla_latents: bool = False,
        kv_layer_numbers: Optional[Sequence[int]] = None,
    ):
        super().__init__(materialize_only_last_token_logits)
        self.cache_mla_latents = cache_mla_latents
        tp = 1 if tensor_model_parallel_size is None or cache_mla_latents else tensor_model_parallel_size
        if num_attention_heads % tp:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) of the dynamic context (the key/value "
                             f"heads) must be divisible by the tensor-parallel size ({tp})")
        self._max_sequence_length = max_sequence_length
        self.num_layers = num_layers
        self.kv_layer_numbers = list(range(1, num_layers + 1)) if kv_layer_numbers is None else \
            sorted(set(kv_layer_numbers))
        self._kv_layer_index = {number: index for index, number in enumerate(self.kv_layer_numbers)}
        kv_layers = len(self.kv_layer_numbers)
        self.chunk_size_tokens = chunk_size_tokens
        heads = num_attention_heads // tp
        self.key_channels = kv_channels
        self.value_channels = kv_channels if value_channels is None else value_channels
        head_dim = max(self.key_channels, self.value_channels)
        planes = 1 if cache_mla_latents else 2  # latents: the values live in the keys
        dtype_bytes = torch.tensor([], dtype=params_dtype).element_size()
        self.chunk_size_bytes = dtype_bytes * planes * kv_layers * chunk_size_tokens * heads * head_dim
        buffer_bytes = int(buffer_size_gb * 1024 ** 3) // self.chunk_size_bytes * self.chunk_size_bytes
        chunk_count_total = buffer_bytes // self.chunk_size_bytes
        self.max_tokens = chunk_count_total * chunk_size_tokens
        self.max_requests = self.max_tokens // max_sequence_length
        if buffer_overflow_factor is not None:
            self.max_requests = _round_up(self.max_requests * buffer_overflow_factor, 4)
            self.max_tokens = _round_up(self.max_tokens * buffer_overflow_factor / 50, 64)
        if max_requests_override is not None:
            self.max_requests = _round_up(max_requests_override, 4)
        if max_tokens_override is not None:
            self.max_tokens = _round_up(max_tokens_override, 64)
        self.max_requests = min(self.max_requests, self.max_tokens)
        self.chunks_per_request = math.ceil(max_sequence_length / chunk_size_tokens)
        fitting = int(buffer_guaranteed_fraction * buffer_bytes) // (self.chunk_size_bytes * self.chunks_per_request)
        self.gtd_request_count = _round_up(min(max(1, fitting), self.max_requests), 4)
        self.gtd_chunk_count = self.gtd_request_count * self.chunks_per_request
        if self.max_requests < 1:
            raise ValueError(
                f"the dynamic inference buffer ({buffer_size_gb} GB, {chunk_count_total} chunks of "
                f"{chunk_size_tokens} tokens) holds no request of --inference-max-seq-length {max_sequence_length}: "
                "raise --inference-dynamic-batching-buffer-size-gb or set "
                "--inference-dynamic-batching-max-requests-override"
            )
        self.chunk_allocator = ChunkAllocator(chunk_count_total, self.gtd_chunk_count)
        self.memory_buffer = torch.full(
            (planes, kv_layers, chunk_count_total, chunk_size_tokens, heads, head_dim), -1,
            dtype=params_dtype, device=device,
        )
        self.mamba_states = {}
        self._free_mamba_slots = list(range(self.max_requests - 1, -1, -1))
        self.requests: "OrderedDict[int, _RequestState]" = OrderedDict()
        self.step_layout: Optional[_StepLayout] = None
        self.static_decode = False
        self._static_buffers = {}

    @property
    def max_sequence_length(self) -> int:
        return self._max_sequence_length

    def is_static_batching(self) -> bool:
        return False

    @property
    def total_request_count(self) -> int:
        """Requests holding memory (running or paused)."""
        return len(self.requests)

    @property
    def paused_request_count(self) -> int:
        """Requests that could not get a chunk this step."""
        return sum(state.paused for state in self.requests.values())

    def reset(self) -> None:
        """Drop every request and free all memory."""
        self.requests.clear()
        self.chunk_allocator.reset()
        self.step_layout = None
        self._free_mamba_slots = list(range(self.max_requests - 1, -1, -1))

    def check_request(self, prompt_length: int, num_tokens_to_generate: int) -> None:
        """Raise MaxSequenceLengthOverflowError when the request can never fit."""
        if prompt_length < 1:
            raise ValueError("a dynamic inference request needs at least one prompt token")
        if prompt_length + num_tokens_to_generate > self.max_sequence_length:
            raise MaxSequenceLengthOverflowError(
                f"prompt ({prompt_length} tokens) + num_tokens_to_generate ({num_tokens_to_generate}) exceed "
                f"max_sequence_length ({self.max_sequence_length})"
            )

    def add_request(self, request_id: int, tokens: List[int], num_tokens_to_generate: int) -> None:
        """Admit a request, reserving its prompt's chunks; raises a ContextOverflowError when it cannot now."""
        self.check_request(len(tokens), num_tokens_to_generate)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already active")
        if len(self.requests) >= self.max_requests:
            raise RequestOverflowError(f"{len(self.requests)} requests are active (max_requests {self.max_requests})")
        chunks = self.chunk_allocator.allocate_memory_chunks(math.ceil(len(tokens) / self.chunk_size_tokens),
                                                            safe=True)
        if chunks is None:
            raise ChunkOverflowError(f"not enough free chunks for a prompt of {len(tokens)} tokens")
        self.requests[request_id] = _RequestState(request_id, list(tokens), len(tokens),
                                                  len(tokens) + num_tokens_to_generate, chunks=chunks,
                                                  mamba_slot=self._free_mamba_slots.pop())

    def release_request(self, request_id: int) -> None:
        """Free a finished request's memory (its chunks and its Mamba state slot)."""
        state = self.requests.pop(request_id)
        self.chunk_allocator.release_memory_chunks(state.chunks)
        self._free_mamba_slots.append(state.mamba_slot)

    @property
    def mamba_dummy_slot(self) -> int:
        """The Mamba state slot of padding rows (never given to a request)."""
        return self.max_requests

    def mamba_segments(self) -> List[tuple]:
        """(first token in the step's [T] layout, token count, state slot, fresh) of every scheduled request;
        fresh: the request's first tokens (its states start at zero)."""
        layout = self.step_layout
        if layout is None:
            raise ValueError("DynamicInferenceContext.mamba_segments: call initialize_step() before the forward")
        return layout.segments

    def token_positions(self, num_tokens: int, device=None) -> torch.Tensor:
        """Positions [T] of this step's tokens (for layers that rotate their own keys)."""
        if self.step_layout is None:
            raise ValueError("DynamicInferenceContext.token_positions: call initialize_step() before the forward")
        return self.step_layout.positions

    def _schedule(self):
        """(state, query length) of this step's requests, within the token budget; others are paused."""
        budget, scheduled = self.max_tokens, []
        for state in self.requests.values():
            pending = len(state.tokens) - state.kv_length
            count = min(pending, budget)
            state.paused = count == 0
            if count == 0:
                continue
            needed = math.ceil((state.kv_length + count) / self.chunk_size_tokens) - len(state.chunks)
            if needed > 0:
                chunks = self.chunk_allocator.allocate_memory_chunks(needed)
                if chunks is None:
                    state.paused = True
                    continue
                state.chunks.extend(chunks)
            scheduled.append((state, count))
            budget -= count
        if not scheduled and self.requests:
            raise ChunkOverflowError("every active request is paused for lack of memory chunks: raise "
                                     "--inference-dynamic-batching-buffer-size-gb or the guaranteed fraction")
        return scheduled

    def initialize_step(self, device=None):
        """Lay out this step's tokens; returns (input_ids [1, T], position_ids [1, T])."""
        scheduled = self._schedule()
        if self.static_decode and all(count == 1 and state.kv_length + 1 == len(state.tokens)
                                      for state, count in scheduled):
            return self._initialize_static_decode_step(scheduled, device)
        cs = self.chunk_size_tokens
        ids, positions, chunks_of, offsets, slots = [], [], [], [], []
        max_query = max(count for _, count in scheduled)
        max_chunks = max(math.ceil((s.kv_length + count) / cs) for s, count in scheduled)
        table = torch.full((len(scheduled), max_chunks), self.chunk_allocator.dummy_chunk_idx, dtype=torch.long)
        kv_ends, last_index = [], []
        for row, (state, count) in enumerate(scheduled):
            span = range(state.kv_length, state.kv_length + count)
            ids.extend(state.tokens[span.start:span.stop])
            positions.extend(span)
            chunks_of.extend(state.chunks[p // cs] for p in span)
            offsets.extend(p % cs for p in span)
            slots.extend(row * max_query + i for i in range(count))
            table[row, :len(state.chunks)] = torch.tensor(state.chunks[:max_chunks])
            kv_ends.append(span.stop)
            last_index.append(len(ids) - 1)
        device = self.memory_buffer.device if device is None else device
        position_tensor = torch.tensor(positions, dtype=torch.long)
        query_pos = torch.full((len(scheduled), max_query), -1, dtype=torch.long)
        query_pos.view(-1)[torch.tensor(slots)] = position_tensor
        key_pos = torch.arange(max_chunks * cs)
        allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # [R, Qmax, K]
        allowed[:, :, 0] |= query_pos < 0  # padding query slots: one key, so no row is all -inf
        to = dict(device=device)
        self.step_layout = _StepLayout(
            request_ids=[state.request_id for state, _ in scheduled],
            query_lengths=[count for _, count in scheduled],
            positions=position_tensor.to(**to),
            write_chunks=torch.tensor(chunks_of, dtype=torch.long, **to),
            write_offsets=torch.tensor(offsets, dtype=torch.long, **to),
            chunk_table=table.to(**to),
            query_slots=torch.tensor(slots, dtype=torch.long, **to),
            max_query=max_query,
            allowed=allowed.unsqueeze(1).to(**to),  # [R, Qmax, K] -> [R, 1, Qmax, K]
            last_token_index=torch.tensor(last_index, dtype=torch.long, **to),
            mamba_slots=torch.tensor([state.mamba_slot for state, _ in scheduled], dtype=torch.long, **to),
            segments=self._segments(scheduled),
        )
        self._scheduled = scheduled
        input_ids = torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0)  # [T] -> [1, T]
        return input_ids, self.step_layout.positions.unsqueeze(0)  # [T] -> [1, T]

    @staticmethod
    def _segments(scheduled) -> List[tuple]:
        """(first token, count, slot, fresh) of the scheduled requests, in layout order."""
        segments, first = [], 0
        for state, count in scheduled:
            segments.append((first, count, state.mamba_slot, state.kv_length == 0))
            first += count
        return segments

    def _static_step_buffers(self, requests: int, chunks: int, device):
        """(packed [R_b * (5 + C_b)] int64, last_token_index [R_b]) of one bucket pair, allocated once."""
        key = (requests, chunks)
        entry = self._static_buffers.get(key)
        if entry is None:
            entry = (torch.zeros(requests * (5 + chunks), dtype=torch.long, device=device),
                     torch.arange(requests, dtype=torch.long, device=device))
            self._static_buffers[key] = entry
        return entry

    def _initialize_static_decode_step(self, scheduled, device):
        """A decode-only step in the static buffers of its bucket pair; returns (input_ids, position_ids)."""
        cs = self.chunk_size_tokens
        rows = len(scheduled)
        r_b = batch_bucket(rows, max(self.max_requests, rows))
        needed = max(state.kv_length // cs + 1 for state, _ in scheduled)
        c_b = batch_bucket(needed, max(self.chunks_per_request, needed))
        device = self.memory_buffer.device if device is None else device
        packed, last_index = self._static_step_buffers(r_b, c_b, device)
        dummy = self.chunk_allocator.dummy_chunk_idx
        fields_host = [[0] * r_b, [0] * r_b, [dummy] * r_b, [0] * r_b, [self.mamba_dummy_slot] * r_b]
        table_host = []
        for row, (state, _) in enumerate(scheduled):
            position = state.kv_length
            fields_host[0][row], fields_host[1][row] = state.tokens[position], position
            fields_host[2][row], fields_host[3][row] = state.chunks[position // cs], position % cs
            fields_host[4][row] = state.mamba_slot
            used = state.chunks[:c_b]
            table_host.extend(used + [dummy] * (c_b - len(used)))
        table_host.extend([dummy] * (c_b * (r_b - rows)))
        flat = [value for column in fields_host for value in column] + table_host
        packed.copy_(torch.tensor(flat, dtype=torch.long), non_blocking=False)
        fields = packed[:5 * r_b].view(5, r_b)  # [5 * R_b] -> [5, R_b]
        self.step_layout = _StepLayout(
            request_ids=[state.request_id for state, _ in scheduled], query_lengths=[1] * rows,
            positions=fields[1], write_chunks=fields[2], write_offsets=fields[3],
            chunk_table=packed[5 * r_b:].view(r_b, c_b),  # [R_b * C_b] -> [R_b, C_b]
            query_slots=None, max_query=1, allowed=None, last_token_index=last_index,
            graph_key=(r_b, c_b), input_ids=fields[0], mamba_slots=fields[4], segments=None,
        )
        self._scheduled = scheduled
        return fields[0].unsqueeze(0), fields[1].unsqueeze(0)  # [R_b] -> [1, R_b]

    def sampling_request_ids(self) -> List[int]:
        """The scheduled requests whose last step token is the last known token (they get a new one)."""
        return [state.request_id for state, count in self._scheduled if state.kv_length + count == len(state.tokens)]

    def update_requests(self, new_tokens: torch.Tensor, termination_id: int) -> List[int]:
        """Record the step: cache lengths advance, sampled tokens ([R] per scheduled request) are appended for
        requests that finished their prompt; returns the ids of finished requests (memory released)."""
        finished = []
        new_tokens = new_tokens.tolist() if torch.is_tensor(new_tokens) else list(new_tokens)  # one host sync
        for row, (state, count) in enumerate(self._scheduled):
            state.kv_length += count
            if state.kv_length < len(state.tokens):  # chunked prefill: more prompt next step
                continue
            token = int(new_tokens[row])
            state.tokens.append(token)
            if token == termination_id or len(state.tokens) >= state.max_length:
                finished.append(state.request_id)
        for request_id in finished:
            self.release_request(request_id)
        self.step_layout = None
        return finished

    def request_tokens(self, request_id: int) -> List[int]:
        """Prompt + generated tokens of an active request."""
        return self.requests[request_id].tokens

    def _layer_memory(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """This layer's key and value memory [chunks, c, ng, hk] / [.., hv] (views of the buffer)."""
        head_dim = self.memory_buffer.shape[-1]
        if key.shape[-1] != self.key_channels or value.shape[-1] != self.value_channels:
            raise ValueError(f"the dynamic context holds keys of {self.key_channels} and values of "
                             f"{self.value_channels} channels per head; this layer gives {key.shape[-1]} and "
                             f"{value.shape[-1]}: build the context with kv_channels / value_channels of the model")
        index = self._kv_layer_index.get(layer_number)
        if index is None:
            raise ValueError(f"layer {layer_number} has no key/value memory in this dynamic context (its "
                             f"kv_layer_numbers are {self.kv_layer_numbers}): build it with the model's "
                             "attention_layer_numbers(model)")
        if self.cache_mla_latents:
            check_value_in_key(key, value)
            k_memory = self.memory_buffer[0, index]
            return k_memory, k_memory[..., :self.value_channels]
        k_memory, v_memory = self.memory_buffer[0, index], self.memory_buffer[1, index]
        if self.key_channels != head_dim:
            k_memory = k_memory[..., :self.key_channels]
        if self.value_channels != head_dim:
            v_memory = v_memory[..., :self.value_channels]
        return k_memory, v_memory

    @staticmethod
    def _gather_rows(memory: torch.Tensor, chunk_table: torch.Tensor) -> torch.Tensor:
        """The rows' chunks of `memory` [chunks, c, ng, d] laid end to end: [R, C * c, ng, d]."""
        rows, chunks = chunk_table.shape
        gathered = memory[chunk_table]  # [R, C, c, ng, d]
        span = chunks * gathered.shape[2]
        return gathered.reshape(rows, span, *gathered.shape[3:])  # [R, C, c, ng, d] -> [R, K, ng, d]

    def _gathered_values(self, keys: torch.Tensor, v_memory: torch.Tensor, chunk_table: torch.Tensor):
        """The rows' values [R, K, ng, hv]: under cache_mla_latents the gathered keys' leading channels."""
        if self.cache_mla_latents:
            return keys[..., :self.value_channels]
        return self._gather_rows(v_memory, chunk_table)

    def attend(self, layer_number, query, key, value, rotary_pos_emb, softmax_scale, config):
        """query [T, 1, np, hk], key [T, 1, ng, hk], value [T, 1, ng, hv] -> [T, 1, np * hv]."""
        layout = self.step_layout
        if layout is None:
            raise ValueError("DynamicInferenceContext.attend: call initialize_step() before the forward")
        table = rotary_table(rotary_pos_emb)
        query, key = rotate(query, key, None if table is None else table[layout.positions], config)
        k_memory, v_memory = self._layer_memory(layer_number, key, value)
        k_memory[layout.write_chunks, layout.write_offsets] = key[:, 0].to(k_memory.dtype)
        if not self.cache_mla_latents:
            v_memory[layout.write_chunks, layout.write_offsets] = value[:, 0].to(v_memory.dtype)
        rows = layout.chunk_table.shape[0]
        if layout.allowed is None:
            return self._attend_static_decode(query, k_memory, v_memory, layout, softmax_scale)
        keys = self._gather_rows(k_memory, layout.chunk_table)  # [R, K, ng, hk]
        values = self._gathered_values(keys, v_memory, layout.chunk_table)  # [R, K, ng, hv]
        padded = query.new_zeros(rows * layout.max_query, query.size(2), query.size(3))
        padded[layout.query_slots] = query[:, 0]
        padded = padded.view(rows, layout.max_query, query.size(2), query.size(3))  # [R*Q, np, hn] -> [R, Q, np, hn]
        out = attend_padded(padded, keys.to(query.dtype), values.to(query.dtype), layout.allowed, softmax_scale)
        out = out.reshape(rows * layout.max_query, -1)[layout.query_slots]  # [R, Q, np, hv] -> [T, np*hv]
        return out.unsqueeze(1)  # [T, np*hv] -> [T, 1, np*hv]

    def _attend_static_decode(self, query, k_memory, v_memory, layout, softmax_scale):
        """One token per row: query [R_b, 1, np, hk] over the rows' chunks -> [R_b, 1, np * hv]."""
        rows, chunks = layout.chunk_table.shape
        span = chunks * self.chunk_size_tokens
        keys = self._gather_rows(k_memory, layout.chunk_table)  # [R, K, ng, hk]
        values = self._gathered_values(keys, v_memory, layout.chunk_table)  # [R, K, ng, hv]
        key_positions = torch.arange(span, device=query.device)
        allowed = (key_positions[None, :] <= layout.positions[:, None]).view(rows, 1, 1, span)  # [R, K] -> [R, 1, 1, K]
        out = attend_padded(query, keys.to(query.dtype), values.to(query.dtype), allowed, softmax_scale)
        return out.reshape(rows, 1, -1)  # [R, 1, np, hv] -> [R, 1, np*hv]

    def last_token_hidden_states(self, hidden_states):
        """[T, 1, h] -> [R, 1, h]: the last token of every scheduled request."""
        return hidden_states.index_select(0, self.step_layout.last_token_index)


__all__ = [
    "DynamicInferenceContext",
    "kv_cache_dims",
    "attention_layer_numbers",
    "ContextOverflowError",
    "RequestOverflowError",
    "TokenOverflowError",
    "MaxSequenceLengthOverflowError",
    "ChunkOverflowError",
]
