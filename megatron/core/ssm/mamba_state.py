"""Inference state of a Mamba mixer: the conv window and the SSM state of every sequence, for decoding.

Kept in the static inference context's `key_value_memory_dict[layer_number]` as `(conv_state, ssm_state)` with
the batch on axis 1 like the attention caches (so `swap_key_value_dict` reorders them too):
`conv_state [d_conv, max_batch, conv_dim/tp]` (the last d_conv pre-conv inputs) and
`ssm_state [nheads/tp, max_batch, headdim, d_state]` (fp32).
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
    groups_state = mixer.ngroups_local * mixer.d_state
    z, xbc, dt = torch.split(zxbcdt, [mixer.d_inner_local, mixer.conv_dim_local, mixer.nheads_local], dim=-1)
    conv, ssm = _states(mixer, context, rows, xbc.device, xbc.dtype)
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


__all__ = ["store_prefill", "decode_step"]
