"""Inference state of a Mamba mixer: the conv window and the SSM state of every sequence, for decoding.

Static context: kept in `key_value_memory_dict[layer_number]` as `(conv_state, ssm_state)` with the batch on
axis 1 like the attention caches (so `swap_key_value_dict` reorders them too):
`conv_state [d_conv, max_batch, conv_dim/tp]` (the last d_conv pre-conv inputs) and
`ssm_state [nheads/tp, max_batch, headdim, d_state]` (fp32). A prompt runs the chunked scan and keeps its
final states (`store_prefill`); each later one-token forward advances them (`decode_step`).

Dynamic context: the same two tensors per layer in `mamba_states[layer_number]`, indexed by the requests'
state slots (`max_requests + 1` of them, the last a dummy for padding rows). One step's flattened tokens
[T] are split by `context.mamba_segments()`: the one-token continuations (decodes) of all requests advance
together through the recurrence; every other segment (a prompt, or a later chunk of a chunked prefill) runs
the chunked scan, continuing the slot's conv window and SSM state unless the request starts there
(`dynamic_step`). A static-shape (CUDA graph) decode step advances all its rows by their slot tensor.
"""
import torch
import torch.nn.functional as F


def _states(mixer, context, batch_rows, device, dtype):
    """This layer's (conv_state, ssm_state) of the context, allocated at the context's max batch size."""
    memory = context.key_value_memory_dict.get(mixer.layer_number)
    if memory is None or memory[0].device != device or memory[0].dtype != dtype:
        conv = torch.zeros(mixer.d_conv, context.max_batch_size, mixer.conv_dim_local, device=device, dtype=dtype)
        ssm = torch.zeros(mixer.nheads_local, context.max_batch_size, mixer.headdim, mixer.d_state, device=device,
                          dtype=torch.float32)
        memory = (conv, ssm)
        context.key_value_memory_dict[mixer.layer_number] = memory
    if batch_rows.stop > memory[0].shape[1]:
        raise ValueError(f"the inference context holds {memory[0].shape[1]} rows; this forward needs "
                         f"{batch_rows.stop}: raise --inference-max-requests")
    return memory


def store_prefill(mixer, context, xbc, final_state):
    """After a prompt: keep the last d_conv pre-conv inputs xbc [b, l, c] and the final SSM state [b, h, p, n]."""
    b = xbc.shape[0]
    rows = slice(context.batch_size_offset, context.batch_size_offset + b)
    conv, ssm = _states(mixer, context, rows, xbc.device, xbc.dtype)
    window = F.pad(xbc.transpose(0, 1), (0, 0, 0, 0, max(mixer.d_conv - xbc.shape[1], 0), 0))[-mixer.d_conv:]
    conv[:, rows] = window  # [w, b, c]
    ssm[:, rows] = final_state.permute(1, 0, 2, 3).float()  # [b, h, p, n] -> [h, b, p, n]


def decode_step(mixer, context, zxbcdt):
    """One token per sequence: zxbcdt [b, rows/tp] -> y [b, d_inner/tp] (before the gate/norm), states advanced."""
    b = zxbcdt.shape[0]
    rows = slice(context.batch_size_offset, context.batch_size_offset + b)
    conv, ssm = _states(mixer, context, rows, zxbcdt.device, zxbcdt.dtype)
    return _advance(mixer, conv, ssm, rows, zxbcdt)


def _advance(mixer, conv, ssm, rows, zxbcdt):
    """The recurrence for one token of each of `rows` (a slice or a slot index tensor [b]) of the state
    tensors: zxbcdt [b, rows/tp] -> (y [b, d_inner/tp] before the gate/norm, z or None)."""
    b = zxbcdt.shape[0]
    groups_state = mixer.ngroups_local * mixer.d_state
    z, xbc, dt = torch.split(zxbcdt, [mixer.d_inner_local, mixer.conv_dim_local, mixer.nheads_local], dim=-1)
    window = torch.cat([conv[1:, rows], xbc[None]], dim=0)  # [w, b, c]
    conv[:, rows] = window
    weight = mixer.conv1d.weight.squeeze(1)  # [c, 1, w] -> [c, w]
    u = torch.einsum("wbc,cw->bc", window.float(), weight.float())
    if mixer.conv1d.bias is not None:
        u = u + mixer.conv1d.bias.float()
    u = F.silu(u)
    x, B, C = torch.split(u, [mixer.d_inner_local, groups_state, groups_state], dim=-1)
    heads_per_group = mixer.nheads_local // mixer.ngroups_local
    x = x.reshape(b, mixer.nheads_local, mixer.headdim)  # [b, d] -> [b, h, p]
    B = B.reshape(b, mixer.ngroups_local, mixer.d_state).repeat_interleave(heads_per_group, dim=1)  # [b, h, n]
    C = C.reshape(b, mixer.ngroups_local, mixer.d_state).repeat_interleave(heads_per_group, dim=1)  # [b, h, n]
    delta = F.softplus(dt.float() + mixer.dt_bias.float())  # [b, h]
    decay = torch.exp(delta * -torch.exp(mixer.A_log.float()))  # [b, h]
    state = ssm[:, rows].permute(1, 0, 2, 3)  # [h, b, p, n] -> [b, h, p, n]
    state = decay[..., None, None] * state + (delta[..., None] * x)[..., None] * B[:, :, None, :]
    ssm[:, rows] = state.permute(1, 0, 2, 3)
    D = mixer.D.float()
    y = torch.einsum("bhpn,bhn->bhp", state, C) + x * (D[:, None] if D.dim() == 1 else D)
    if mixer.use_mem_eff_path:
        y = y * F.silu(z.float().reshape(b, mixer.nheads_local, mixer.headdim))
        return y.reshape(b, mixer.d_inner_local).to(zxbcdt.dtype), None
    return y.reshape(b, mixer.d_inner_local).to(zxbcdt.dtype), z


def _dynamic_states(mixer, context, device, dtype):
    """This layer's (conv_state, ssm_state) of the dynamic context, `max_requests + 1` slots."""
    memory = context.mamba_states.get(mixer.layer_number)
    if memory is None or memory[0].device != device or memory[0].dtype != dtype:
        slots = context.max_requests + 1
        conv = torch.zeros(mixer.d_conv, slots, mixer.conv_dim_local, device=device, dtype=dtype)
        ssm = torch.zeros(mixer.nheads_local, slots, mixer.headdim, mixer.d_state, device=device,
                          dtype=torch.float32)
        memory = (conv, ssm)
        context.mamba_states[mixer.layer_number] = memory
    return memory


def _scan_segment(mixer, conv, ssm, slot, fresh, zxbcdt):
    """A prompt (or prompt chunk) of one request: zxbcdt [L, rows/tp] -> y [L, d_inner/tp] (gated, normed),
    starting from the slot's states unless `fresh`; the slot keeps the states after the segment."""
    z, xbc, dt = torch.split(zxbcdt[None], [mixer.d_inner_local, mixer.conv_dim_local, mixer.nheads_local],
                             dim=-1)  # [1, L, *]
    previous = None if fresh else conv[:, slot]  # [w, c]
    prefix = None if fresh else previous[1:][None]  # [1, w-1, c]
    initial = None if fresh else ssm[:, slot][None]  # [1, h, p, n]
    y, final_state = mixer._conv_scan_norm(z, xbc, dt, mixer._local_params(), True, initial_states=initial,
                                           conv_prefix=prefix)
    inputs = xbc[0] if fresh else torch.cat([previous, xbc[0]], dim=0)  # [L (+ w), c]
    window = F.pad(inputs, (0, 0, max(mixer.d_conv - inputs.shape[0], 0), 0))[-mixer.d_conv:]  # [w, c]
    conv[:, slot] = window
    ssm[:, slot] = final_state[0].float()
    return y[0]


def dynamic_step(mixer, context, zxbcdt):
    """One dynamic-context step: zxbcdt [T, 1, rows/tp] -> y [T, 1, d_inner/tp] (gated and normed)."""
    flat = zxbcdt[:, 0]  # [T, 1, r] -> [T, r]
    conv, ssm = _dynamic_states(mixer, context, flat.device, flat.dtype)
    layout = context.step_layout
    if layout.segments is None:  # static-shape decode: one token per row, padding rows in the dummy slot
        y, z = _advance(mixer, conv, ssm, layout.mamba_slots, flat)
        return mixer.norm(y, z)[:, None]  # [T, d] -> [T, 1, d]
    segments = context.mamba_segments()
    decodes = [seg for seg in segments if seg[1] == 1 and not seg[3]]
    y = flat.new_empty(flat.shape[0], mixer.d_inner_local)
    if decodes:
        tokens = torch.tensor([seg[0] for seg in decodes], dtype=torch.long, device=flat.device)
        slots = torch.tensor([seg[2] for seg in decodes], dtype=torch.long, device=flat.device)
        y_dec, z_dec = _advance(mixer, conv, ssm, slots, flat.index_select(0, tokens))
        y[tokens] = mixer.norm(y_dec, z_dec).to(y.dtype)
    for first, count, slot, fresh in segments:
        if count > 1 or fresh:
            y[first:first + count] = _scan_segment(mixer, conv, ssm, slot, fresh, flat[first:first + count])
    return y[:, None]  # [T, d] -> [T, 1, d]


__all__ = ["store_prefill", "decode_step", "dynamic_step"]
