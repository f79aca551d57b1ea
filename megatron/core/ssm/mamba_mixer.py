"""`MambaMixer`: the Mamba-2 (SSD) token mixer with Megatron's parameter names and tensor-parallel layout.

Per rank (heads split over tensor parallelism, groups never straddle ranks):

    zxBCdt = in_proj(x)                       # [s, b, 2*d_in/tp + 2*G*N/tp + nh/tp], rows [z | x | B | C | dt]
    xBC    = silu(causal_conv1d(xBC))         # depthwise, width d_conv, channels [x | B | C]
    y      = SSD(x, softplus(dt + dt_bias), -exp(A_log), B, C) + D * x
    out    = out_proj(RMSNorm_grouped(y * silu(z)))   # row-parallel

The scan and the conv come from `megatron.core.ssm.ops` (pure PyTorch on CPU, Triton kernels on CUDA when they
import; `ssm_impl` picks explicitly). Distributed checkpoints split the TP-interleaved `in_proj.weight` and
`conv1d.{weight,bias}` into TP-invariant pieces (`in_proj.weight.z`, `.x`, `.B`, `.C`, `.dt`; `conv1d.weight.x`,
...), as Megatron does, so checkpoints reshard across TP sizes.
"""
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.ssm import ops
from megatron.core import parallel_state
from megatron.core.ssm.gated_rmsnorm import RMSNormGated, gated_rms_norm
from megatron.core.ssm.mamba_context_parallel import MambaCPSlices, cp_problems
from megatron.core.ssm.mamba_state import decode_step, dynamic_step, store_prefill
from megatron.core.tensor_parallel.utils import make_tp_sharded_tensor_for_checkpoint
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp, get_tp_world_size


@dataclass
class MambaMixerSubmodules:
    """Specs of the two projections of the mixer."""

    in_proj: Union[ModuleSpec, type] = None
    """Pre-norm + column-parallel projection to [z | x | B | C | dt]."""

    out_proj: Union[ModuleSpec, type] = None
    """Row-parallel projection d_inner -> hidden."""


def mamba_dims(config: TransformerConfig, d_model: int, expand: int = 2, tp_size: int = 1) -> dict:
    """The mixer's global and per-rank sizes (d_inner, nheads, groups, state, conv_dim, in_proj rows)."""
    headdim, ngroups, d_state = config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim
    if config.mamba_num_heads is not None:
        nheads = config.mamba_num_heads
        d_inner = nheads * headdim
    else:
        d_inner = expand * d_model
        nheads = d_inner // headdim
    return {
        "d_inner": d_inner, "nheads": nheads, "headdim": headdim, "ngroups": ngroups, "d_state": d_state,
        "d_inner_local": d_inner // tp_size, "nheads_local": nheads // tp_size, "ngroups_local": ngroups // tp_size,
        "in_proj_rows": 2 * d_inner + 2 * ngroups * d_state + nheads,
    }


def check_mamba_dims(config: TransformerConfig, d_model: int, tp_size: int, expand: int = 2) -> list:
    """The violated divisibility rules of the mixer's sizes, as messages naming the flags."""
    d = mamba_dims(config, d_model, expand)
    problems = []
    if config.mamba_num_heads is None and d["d_inner"] % d["headdim"]:
        problems.append(f"2 * --hidden-size ({d['d_inner']}) must be divisible by --mamba-head-dim ({d['headdim']}).")
    if d["nheads"] % tp_size:
        problems.append(f"the Mamba head count ({d['nheads']}) must be divisible by --tensor-model-parallel-size "
                        f"({tp_size}): set --mamba-num-heads or change the TP size.")
    if d["ngroups"] % tp_size:
        problems.append(f"--mamba-num-groups ({d['ngroups']}) must be divisible by --tensor-model-parallel-size "
                        f"({tp_size}).")
    if d["ngroups"] == 0 or d["nheads"] % max(d["ngroups"], 1):
        problems.append(f"the Mamba head count ({d['nheads']}) must be divisible by --mamba-num-groups "
                        f"({d['ngroups']}).")
    return problems


def _split_sharded_factory(original: ShardedTensor, sizes, names) -> ShardedTensorFactory:
    """Save a per-rank tensor made of pieces along axis 0 as one TP-sharded tensor per piece (`<key>.<name>`)."""
    axis = original.prepend_axis_num
    tp_size = original.axis_fragmentations[axis]
    tp_rank = original.global_offset[axis] // original.local_shape[0]
    prepend = tuple((i, original.global_offset[i], original.global_shape[i]) for i in range(axis))

    def build(key, data, replica_id, flattened_range):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        # narrow, not split: the loader writes into these views in place
        pieces = [data.narrow(0, start, size) for start, size in zip(starts, sizes)]
        return {name: ShardedTensor.from_rank_offsets(f"{key}.{name}", piece, *prepend, (axis, tp_rank, tp_size),
                                                      replica_id=replica_id, prepend_axis_num=axis)
                for name, piece in zip(names, pieces)}

    def merge(loaded):
        return torch.cat([loaded[name] for name in names], dim=0)

    return ShardedTensorFactory(original.key, original.data, build, merge, original.replica_id)


class MambaMixer(MegatronModule):
    """Mamba-2 mixer of one layer: [s, b, h] -> ([s, b, h], bias)."""

    def __init__(self, config: TransformerConfig, submodules: MambaMixerSubmodules, d_model: int, d_conv: int = 4,
                 conv_init: Optional[float] = None, expand: int = 2, A_init_range=(1, 16), D_has_hdim: bool = False,
                 rmsnorm: bool = True, norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init: str = "random", dt_scale: float = 1.0, dt_init_floor: float = 1e-4, bias: bool = False,
                 conv_bias: bool = True, chunk_size: int = 128, use_mem_eff_path: Optional[bool] = None,
                 layer_number: Optional[int] = None, model_comm_pgs=None, ssm_impl: str = "auto"):
        super().__init__(config)
        if not rmsnorm or norm_before_gate or bias:
            raise ValueError("MambaMixer: rmsnorm=True, norm_before_gate=False and bias=False are required "
                             "(Megatron asserts the same).")
        self.tp_group = get_model_comm_pgs_tp(model_comm_pgs)
        tp_size = get_tp_world_size(self.tp_group)
        self.cp_group = None
        if config.context_parallel_size > 1:
            cp_group = getattr(model_comm_pgs, "cp", None) if model_comm_pgs is not None else None
            self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        problems = check_mamba_dims(config, d_model, tp_size, expand)
        if not problems and config.context_parallel_size > 1:
            d = mamba_dims(config, d_model, expand, tp_size)
            problems = cp_problems(d["nheads_local"], d["ngroups_local"], config.context_parallel_size)
        if problems:
            raise ValueError("MambaMixer: " + " ".join(problems))
        dims = mamba_dims(config, d_model, expand, tp_size)
        for name, value in dims.items():
            setattr(self, name, value)
        self.d_model, self.d_conv, self.chunk_size, self.D_has_hdim = d_model, d_conv, chunk_size, D_has_hdim
        self.layer_number = layer_number
        self.ssm_impl = ssm_impl
        self.use_mem_eff_path = config.use_mamba_mem_eff_path if use_mem_eff_path is None else use_mem_eff_path
        self.conv_dim_local = self.d_inner_local + 2 * self.ngroups_local * self.d_state
        self.in_proj = build_module(submodules.in_proj, d_model, dims["in_proj_rows"], config=config,
                                    init_method=config.init_method, gather_output=False, bias=bias,
                                    skip_bias_add=False, is_expert=False, tp_group=self.tp_group)
        self._build_ssm_parameters(conv_init, conv_bias, A_init_range, dt_min, dt_max, dt_init_floor)
        self.norm = RMSNormGated(self.d_inner_local, eps=1e-5, group_size=self.d_inner_local // self.ngroups_local,
                                 norm_before_gate=False, dtype=config.params_dtype)
        std = config.init_method_std / math.sqrt(config.num_layers)
        self.out_proj = build_module(submodules.out_proj, self.d_inner, d_model, config=config,
                                     init_method=lambda w: torch.nn.init.normal_(w, mean=0.0, std=std), bias=bias,
                                     input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)
        for param in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            if param is not None:
                param.tensor_model_parallel = True
                param.partition_dim = 0
                param.partition_stride = 1

    def _build_ssm_parameters(self, conv_init, conv_bias, A_init_range, dt_min, dt_max, dt_init_floor):
        """conv1d, dt_bias, A_log and D with Mamba-2's initialisation (this rank's heads)."""
        dtype = self.config.params_dtype
        self.conv1d = torch.nn.Conv1d(self.conv_dim_local, self.conv_dim_local, kernel_size=self.d_conv,
                                      groups=self.conv_dim_local, padding=self.d_conv - 1, bias=conv_bias,
                                      dtype=dtype)
        if conv_init is not None:
            torch.nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        dt = torch.exp(torch.rand(self.nheads_local) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        self.dt_bias = torch.nn.Parameter(inv_dt.to(dtype))
        A = torch.empty(self.nheads_local, dtype=torch.float32).uniform_(*A_init_range)
        self.A_log = torch.nn.Parameter(torch.log(A))
        D_shape = (self.nheads_local, self.headdim) if self.D_has_hdim else (self.nheads_local,)
        self.D = torch.nn.Parameter(torch.ones(D_shape, dtype=torch.float32))
        for param in (self.dt_bias, self.A_log, self.D):
            param._no_weight_decay = True

    def forward(self, hidden_states: torch.Tensor, inference_context=None, *, inference_params=None):
        """[s, b, h] (or [s/tp, b, h] with SP) -> (out [s, b, h] or [s/tp, b, h], out_proj bias).

        With a static inference context the prompt's final conv/SSM states are kept and later single-token
        forwards (`sequence_len_offset > 0`) advance them; a dynamic context keeps them per request slot
        (`mamba_state.py`)."""
        context = inference_context if inference_context is not None else inference_params
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, in_proj_rows/tp]
        if context is not None and context.is_dynamic_batching():  # flattened requests, per-request states
            return self.out_proj(dynamic_step(self, context, zxbcdt))
        if context is not None and context.sequence_len_offset > 0:
            if zxbcdt.shape[0] != 1:
                raise ValueError(f"MambaMixer decodes one token per step, got {zxbcdt.shape[0]}")
            y, z = decode_step(self, context, zxbcdt[0])
            y = self.norm(y, z)[None]  # [b, d] -> [1, b, d]
            return self.out_proj(y)
        if self.cp_group is not None and context is None:
            return self.out_proj(self._context_parallel_ssm(zxbcdt))
        zxbcdt = zxbcdt.transpose(0, 1)  # [s, b, r] -> [b, s, r]
        y = self.ssm(zxbcdt, context)  # [b, s, d_inner/tp]
        y = y.transpose(0, 1).contiguous()  # [b, s, d] -> [s, b, d]
        return self.out_proj(y)

    def _local_params(self) -> dict:
        """This rank's conv / SSM / norm parameters and sizes (all of the TP rank's heads)."""
        return {"conv_w": self.conv1d.weight.squeeze(1), "conv_b": self.conv1d.bias, "dt_bias": self.dt_bias,
                "A_log": self.A_log, "D": self.D, "norm_w": self.norm.weight, "heads": self.nheads_local,
                "groups": self.ngroups_local}

    def ssm(self, zxbcdt: torch.Tensor, context=None) -> torch.Tensor:
        """Conv, scan, gate and norm: zxbcdt [b, l, rows/tp] -> y [b, l, d_inner/tp]."""
        z, xbc_in, dt = torch.split(zxbcdt, [self.d_inner_local, self.conv_dim_local, self.nheads_local], dim=-1)
        y, final_state = self._conv_scan_norm(z, xbc_in, dt, self._local_params(), context is not None)
        if context is not None:
            store_prefill(self, context, xbc_in, final_state)
        return y

    def _conv_scan_norm(self, z, xbc_in, dt, params: dict, want_state: bool = False, initial_states=None,
                        conv_prefix=None):
        """z [b, l, H*P], xbc_in [b, l, H*P + 2*G*N], dt [b, l, H] for `params`' H heads and G groups ->
        (y [b, l, H*P], final SSM state or None). Inference continues a sequence with `conv_prefix`
        [b, d_conv - 1, channels] (its last pre-conv inputs) and `initial_states` [b, H, P, N]."""
        b, length, _ = z.shape
        heads, groups = params["heads"], params["groups"]
        inner, groups_state = heads * self.headdim, groups * self.d_state
        if conv_prefix is not None:
            xbc_in = torch.cat([conv_prefix.to(xbc_in.dtype), xbc_in], dim=1)  # [b, w-1+l, c]
        xbc = ops.causal_conv1d(xbc_in.transpose(1, 2), params["conv_w"], params["conv_b"], activation="silu",
                                impl=self.ssm_impl).transpose(1, 2)  # [b, l (+ w-1), conv channels]
        xbc = xbc[:, xbc.shape[1] - length:]  # the prefix's own outputs are not this segment's
        x, B, C = torch.split(xbc, [inner, groups_state, groups_state], dim=-1)
        x = x.reshape(b, length, heads, self.headdim)  # [b, l, d] -> [b, l, h, p]
        B = B.reshape(b, length, groups, self.d_state)  # [b, l, G*N] -> [b, l, G, N]
        C = C.reshape(b, length, groups, self.d_state)  # [b, l, G*N] -> [b, l, G, N]
        A = -torch.exp(params["A_log"].float())
        z_heads = z.reshape(b, length, heads, self.headdim) if self.use_mem_eff_path else None
        out = ops.ssd_chunk_scan(x, dt, A, B, C, self.chunk_size, D=params["D"], z=z_heads,
                                 dt_bias=params["dt_bias"], dt_softplus=True, initial_states=initial_states,
                                 return_final_states=want_state, impl=self.ssm_impl)
        out, final_state = out if want_state else (out, None)
        y = out.reshape(b, length, inner)  # [b, l, h, p] -> [b, l, d]
        y = gated_rms_norm(y, None if self.use_mem_eff_path else z, params["norm_w"], self.norm.group_size,
                           self.norm.eps)
        return y, final_state

    def _context_parallel_ssm(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """zxbcdt [s/cp, b, rows/tp] (load-balanced shard) -> y [s/cp, b, d_inner/tp] (`mamba_context_parallel`)."""
        cp = MambaCPSlices(self, self.cp_group)
        s_local, b, _ = zxbcdt.shape
        groups_state = self.ngroups_local * self.d_state
        z, x, B, C, dt = torch.split(zxbcdt, [self.d_inner_local, self.d_inner_local, groups_state, groups_state,
                                              self.nheads_local], dim=-1)
        z, x = (cp.to_heads(t.reshape(s_local, b, self.nheads_local, self.headdim)) for t in (z, x))  # [s, b, h/cp, p]
        B, C = (cp.to_heads(t.reshape(s_local, b, self.ngroups_local, self.d_state)) for t in (B, C))  # [s, b, G/cp, N]
        dt = cp.to_heads(dt.reshape(s_local, b, self.nheads_local, 1))  # [s, b, h/cp, 1]
        seq = z.shape[0]
        flat = [t.reshape(seq, b, -1).transpose(0, 1) for t in (z, x, B, C, dt)]  # [s, b, n, d] -> [b, s, n*d]
        xbc_in = torch.cat(flat[1:4], dim=-1)
        channels = cp.channels.to(self.conv1d.weight.device)
        conv_b = self.conv1d.bias.index_select(0, channels) if self.conv1d.bias is not None else None
        params = {"conv_w": self.conv1d.weight.squeeze(1).index_select(0, channels), "conv_b": conv_b,
                  "dt_bias": self.dt_bias[cp.head_slice], "A_log": self.A_log[cp.head_slice],
                  "D": self.D[cp.head_slice], "norm_w": self.norm.weight[cp.inner], "heads": cp.heads,
                  "groups": cp.groups}
        y, _ = self._conv_scan_norm(flat[0], xbc_in, flat[4], params)  # [b, s, d/cp]
        y = y.transpose(0, 1).reshape(seq, b, cp.heads, self.headdim)  # [b, s, d/cp] -> [s, b, h/cp, p]
        return cp.to_sequence(y).reshape(s_local, b, self.d_inner_local)  # [s/cp, b, h, p] -> [s/cp, b, d]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's dist keys: in_proj/conv1d split into TP-invariant pieces, the per-head tensors TP-sharded."""
        sharded = {}
        for name, child in (("in_proj", self.in_proj), ("out_proj", self.out_proj)):
            sharded.update(child.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        for name in ("dt_bias", "A_log", "D"):
            sharded[f"{prefix}{name}"] = make_tp_sharded_tensor_for_checkpoint(
                getattr(self, name), f"{prefix}{name}", 0, prepend_offsets=sharded_offsets)
        sharded[f"{prefix}norm.weight"] = make_tp_sharded_tensor_for_checkpoint(
            self.norm.weight, f"{prefix}norm.weight", 0, prepend_offsets=sharded_offsets)
        groups_state = self.ngroups_local * self.d_state
        in_key = f"{prefix}in_proj.weight"
        sharded[in_key] = _split_sharded_factory(
            sharded[in_key], [self.d_inner_local, self.d_inner_local, groups_state, groups_state, self.nheads_local],
            ["z", "x", "B", "C", "dt"])
        for name in ("weight", "bias"):
            param = getattr(self.conv1d, name)
            if param is None:
                continue
            key = f"{prefix}conv1d.{name}"
            whole = make_tp_sharded_tensor_for_checkpoint(param, key, 0, prepend_offsets=sharded_offsets)
            sharded[key] = _split_sharded_factory(whole, [self.d_inner_local, groups_state, groups_state],
                                                  ["x", "B", "C"])
        return sharded


__all__ = ["MambaMixer", "MambaMixerSubmodules", "mamba_dims", "check_mamba_dims"]
