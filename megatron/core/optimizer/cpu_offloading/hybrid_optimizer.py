"""`HybridDeviceOptimizer`: one optimizer whose step and state are split between the host and the device.

The first `offload_fraction` of the parameters (by number of elements, in param-group order, Megatron's
rule) is stepped by `cpu_optimizer_cls` on the host, the rest by `gpu_optimizer_cls` where the params live.
The host part keeps its own copies of those params (fp32 with `param_update_in_fp32`): each step copies
their gradients device -> host, steps the host optimizer and copies the updated values back into the params.
With `param_update_in_fp32`, low-precision params of the device part are stepped through fp32 copies too.

The wrapper is a `torch.optim.Optimizer` whose `param_groups` are the ones the caller (Megatron's
distributed optimizer, the LR scheduler) reads and writes; their hyper-parameters are pushed to the inner
optimizers before every step. `state` is keyed by the caller's params and holds, per param, the inner
optimizer's own state dict (the same dict object, so in-place loads reach the inner optimizer) plus the
inner param as `master_param` when `param_update_in_fp32`. Gradients are read from `decoupled_grad` (the
precision-aware optimizer's attribute) when set, else from `.grad`.

Design notes:
- Lazy split. The inner optimizers and the host/fp32 copies are made at the first step (or state access),
  not in the constructor: `get_megatron_optimizer` builds one over the full model and the distributed
  optimizer immediately rebuilds it over its shards (`HybridDeviceOptimizer(params, **defaults)`, as
  Megatron does); the throw-away one never allocates copies. Copies made late also start from the values
  the params have then (after a model-only checkpoint load, for example).
- `defaults` holds the optimizer hyper-parameters and the seven constructor options (Megatron's contract for
  the rebuild above), but the options are not written into the param groups: a class object there would
  end up in checkpoints, which load with `weights_only=True`.
- `dummy_step()` creates empty optimizer state (zeros, step 0) without changing any param; Megatron's
  version steps once on random gradients for the same purpose.
- On a CPU-only run all params are candidates for the host part, so the offload code path (separate host
  copies, gradient and param copies) runs as it does on a GPU.
"""
import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.core.optimizer.cpu_offloading.transfers import HostDeviceTransfers

# Keys of a param group that belong to one optimizer instance, not to the hyper-parameters.
_IMPLEMENTATION_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")


@dataclass
class _Slot:
    """Where one of the caller's params is stepped."""

    param: torch.Tensor
    """The caller's param (key of `state`)."""

    master: torch.Tensor
    """The tensor the inner optimizer steps: `param` itself, or its host / fp32 copy."""

    on_host: bool
    """Stepped by a host optimizer."""

    optimizer: Optional[torch.optim.Optimizer] = None
    """The inner optimizer that steps `master`."""

    group: Optional[Dict[str, Any]] = None
    """The param group of `optimizer` that holds `master`."""

    grad_buffer: Optional[torch.Tensor] = None
    """Host buffer the gradient is copied into (host slots with a copy)."""

    upload_buffer: Optional[torch.Tensor] = None
    """Pinned host buffer in the param's dtype, so the host -> device copy moves the param's bytes only."""


def _grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    grad = getattr(param, "decoupled_grad", None)
    return param.grad if grad is None else grad


def _empty_host(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)


def _initial_state(optimizer: torch.optim.Optimizer, group: Dict[str, Any], param: torch.Tensor) -> Dict[str, Any]:
    """The state `optimizer` would create for `param` before its first update (empty when it has none)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        on_device = group.get("fused") or group.get("capturable")
        state = {
            "step": torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu"),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
    if isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) and not group.get("dampening"):
        # With dampening 0, a zero buffer gives the same first update as torch's lazy clone of the gradient.
        return {"momentum_buffer": torch.zeros_like(param)}
    return {}


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Megatron Core's hybrid host/device optimizer (`--optimizer-cpu-offload`).

    Args:
        params: params or param groups (as for any torch optimizer).
        offload_fraction: fraction of the params, by number of elements, stepped on the host.
        cpu_optimizer_cls: torch optimizer class of the host part (built over groups only).
        gpu_optimizer_cls: torch optimizer class of the device part.
        param_update_in_fp32: step fp32 copies of low-precision params.
        pin_cpu_grads: pin the host gradient buffers (faster, asynchronous copies).
        pin_cpu_params: pin the host param copies.
        overlap_cpu_optimizer_d2h_h2d: one host optimizer per param and side streams for the copies, so
            copies, the device step and the host steps overlap.
        **kwargs: hyper-parameters (lr, weight_decay, betas, eps, momentum, fused, ...) of every group.
    """

    def __init__(
        self,
        params,
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Optional[Callable] = None,
        gpu_optimizer_cls: Optional[Callable] = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs,
    ):
        if cpu_optimizer_cls is None or gpu_optimizer_cls is None:
            raise ValueError(
                "HybridDeviceOptimizer needs cpu_optimizer_cls and gpu_optimizer_cls (torch optimizer classes, "
                f"got {cpu_optimizer_cls!r} and {gpu_optimizer_cls!r})"
            )
        super().__init__(params, dict(kwargs))
        options = dict(
            offload_fraction=offload_fraction,
            cpu_optimizer_cls=cpu_optimizer_cls,
            gpu_optimizer_cls=gpu_optimizer_cls,
            param_update_in_fp32=param_update_in_fp32,
            pin_cpu_grads=pin_cpu_grads,
            pin_cpu_params=pin_cpu_params,
            overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
        )
        self.defaults.update(options)
        self.offload_fraction = offload_fraction
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads = pin_cpu_grads
        self.pin_cpu_params = pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.sub_optimizer_kwargs = kwargs
        self._slots: Optional[Dict[torch.Tensor, _Slot]] = None

    # ------------------------------------------------------------------------------------------------
    # Split into host and device parts (at first use)
    # ------------------------------------------------------------------------------------------------

    def _params(self) -> List[torch.Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def _make_slot(self, param: torch.Tensor, offload: bool, host_resident: bool) -> _Slot:
        """`offload`: a host copy is stepped; `host_resident`: a CPU param of a run on an accelerator, stepped
        on the host as it is (through an fp32 copy with `param_update_in_fp32`)."""
        fp32 = self.param_update_in_fp32 and param.dtype != torch.float32
        dtype = torch.float32 if fp32 else param.dtype
        if offload:
            master = _empty_host(param, dtype, self.pin_cpu_params and param.is_cuda)
            master.copy_(param.detach())
            return _Slot(param, master, on_host=True)
        master = param.detach().to(torch.float32, copy=True) if fp32 else param
        return _Slot(param, master, on_host=host_resident)

    def _split(self) -> Dict[torch.Tensor, _Slot]:
        """Megatron's rule: walk the groups in order and offload params while the offloaded element count is
        below `offload_fraction` x the elements on the device (all elements when everything is on the CPU)."""
        params = self._params()
        on_device = [p for p in params if p.device.type != "cpu"]
        candidates = {id(p) for p in (on_device or params)}
        threshold = self.offload_fraction * sum(p.numel() for p in params if id(p) in candidates)
        offloaded, slots = 0, {}
        for param in params:
            offload = id(param) in candidates and offloaded < threshold
            if offload:
                offloaded += param.numel()
            host_resident = bool(on_device) and param.device.type == "cpu"
            slots[param] = self._make_slot(param, offload, host_resident)
        return slots

    def _build(self) -> None:
        slots = self._split()
        device_groups, host_groups, group_of_master = [], [], {}
        for index, group in enumerate(self.param_groups):
            # Implementation flags (fused, foreach) are given at construction only: never changed afterwards.
            hyper = {k: v for k, v in group.items() if k != "params"}
            for on_host, target in ((False, device_groups), (True, host_groups)):
                masters = [slots[p].master for p in group["params"] if slots[p].on_host == on_host]
                group_of_master.update((id(m), index) for m in masters)
                if masters:
                    target.append({**hyper, "params": masters})
        self._gpu_optimizer = self.gpu_optimizer_cls(device_groups) if device_groups else None
        if self.overlap_cpu_optimizer_d2h_h2d:
            # One host optimizer per param: each steps as soon as its own gradient has arrived.
            self._cpu_optimizers = [
                self.cpu_optimizer_cls([{**{k: v for k, v in group.items() if k != "params"}, "params": [master]}])
                for group in host_groups for master in group["params"]
            ]
        else:
            self._cpu_optimizers = [self.cpu_optimizer_cls(host_groups)] if host_groups else []
        self._sub_groups = [[] for _ in self.param_groups]
        owner_of_master = {}
        for optimizer in self._cpu_optimizers + ([self._gpu_optimizer] if self._gpu_optimizer is not None else []):
            for sub_group in optimizer.param_groups:
                self._sub_groups[group_of_master[id(sub_group["params"][0])]].append(sub_group)
                owner_of_master.update((id(m), (optimizer, sub_group)) for m in sub_group["params"])
        for slot in slots.values():
            slot.optimizer, slot.group = owner_of_master[id(slot.master)]
        device = next((p.device for p in slots if p.device.type != "cpu"), torch.device("cpu"))
        self._transfers = HostDeviceTransfers(device, self.overlap_cpu_optimizer_d2h_h2d)
        slot_of_master = {id(slot.master): slot for slot in slots.values()}
        self._host_work = [(optimizer, [slot_of_master[id(m)] for g in optimizer.param_groups for m in g["params"]])
                           for optimizer in self._cpu_optimizers]
        self._device_slots = [slot for slot in slots.values() if not slot.on_host]
        self._slots = slots

    def _ensure_built(self) -> Dict[torch.Tensor, _Slot]:
        if self._slots is None:
            self._build()
        return self._slots

    @property
    def cpu_optimizers(self) -> List[torch.optim.Optimizer]:
        """The host optimizers (one per param with overlap, else at most one)."""
        self._ensure_built()
        return self._cpu_optimizers

    @property
    def gpu_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer of the device part (None when everything is offloaded)."""
        self._ensure_built()
        return self._gpu_optimizer

    @property
    def sub_optimizers(self) -> List[torch.optim.Optimizer]:
        """The host optimizers followed by the device optimizer (when there is one)."""
        self._ensure_built()
        return self._cpu_optimizers + ([self._gpu_optimizer] if self._gpu_optimizer is not None else [])

    @property
    def param_to_inner_param(self) -> Dict[torch.Tensor, torch.Tensor]:
        """{caller's param: the tensor its inner optimizer steps}."""
        return {param: slot.master for param, slot in self._ensure_built().items()}

    @property
    def inner_param_to_orig_param(self) -> Dict[torch.Tensor, torch.Tensor]:
        """{inner param: the caller's param}."""
        return {slot.master: param for param, slot in self._ensure_built().items()}

    # ------------------------------------------------------------------------------------------------
    # Step
    # ------------------------------------------------------------------------------------------------

    def _push_hyperparameters(self) -> None:
        """Copy lr, weight decay, ... of every group (the scheduler writes them here) to its inner groups."""
        for group, sub_groups in zip(self.param_groups, self._sub_groups):
            hyper = {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}
            for sub_group in sub_groups:
                sub_group.update(hyper)

    def _set_device_grads(self) -> None:
        for slot in self._device_slots:
            grad = _grad_of(slot.param)
            if grad is not None and grad.dtype != slot.master.dtype:
                grad = grad.to(slot.master.dtype)
            slot.master.grad = grad

    def _download_grads(self, slots: List[_Slot]) -> None:
        """Point every host master's .grad at the param's gradient, copied into a (pinned) host buffer."""
        for slot in slots:
            grad = _grad_of(slot.param)
            if grad is None or slot.master is slot.param:
                slot.master.grad = grad
                continue
            if slot.grad_buffer is None:
                slot.grad_buffer = _empty_host(slot.master, slot.master.dtype, self.pin_cpu_grads and grad.is_cuda)
            slot.grad_buffer.copy_(grad, non_blocking=True)
            slot.master.grad = slot.grad_buffer

    def _upload_params(self, slots: List[_Slot]) -> None:
        """Write the updated host masters into the params (through a pinned buffer in the param's dtype when
        the param is on a GPU, so the copy is asynchronous and moves only the param's bytes)."""
        for slot in slots:
            if slot.master is slot.param:
                continue
            source = slot.master
            if slot.param.is_cuda and slot.param.dtype != source.dtype:
                if slot.upload_buffer is None:
                    slot.upload_buffer = _empty_host(slot.param, slot.param.dtype, self.pin_cpu_params)
                slot.upload_buffer.copy_(source)
                source = slot.upload_buffer
            slot.param.detach().copy_(source, non_blocking=True)

    @torch.no_grad()
    def step(self, closure=None):
        """Push hyper-parameters, copy gradients to the host part, step every inner optimizer (the device part
        first, asynchronously), copy the updated values back into the params."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_built()
        self._push_hyperparameters()
        self._set_device_grads()
        ready = []
        with self._transfers.downloads():
            for _, slots in self._host_work:
                self._download_grads(slots)
                ready.append(self._transfers.record())
        if self._gpu_optimizer is not None:
            self._gpu_optimizer.step()
            for slot in self._device_slots:
                if slot.master is not slot.param:
                    slot.param.detach().copy_(slot.master)
        for (optimizer, slots), event in zip(self._host_work, ready):
            self._transfers.wait_on_host(event)
            optimizer.step()
            with self._transfers.uploads():
                self._upload_params(slots)
        self._transfers.device_waits_for_uploads()
        self._publish_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear `.grad` and `decoupled_grad` of the params and the inner params' gradients."""
        super().zero_grad(set_to_none)
        for param in self._params():
            decoupled = getattr(param, "decoupled_grad", None)
            if decoupled is not None:
                if set_to_none:
                    param.decoupled_grad = None
                else:
                    decoupled.zero_()
        for slot in (self._slots or {}).values():
            if slot.master is not slot.param:
                slot.master.grad = None

    # ------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------

    def _publish_state(self) -> None:
        """`state[param]` = the inner optimizer's state dict of that param (same object), with `master_param`."""
        state = defaultdict(dict)
        for param, slot in self._slots.items():
            entry = slot.optimizer.state.get(slot.master)
            if not entry:
                continue
            if self.param_update_in_fp32:
                entry["master_param"] = slot.master
            state[param] = entry
        self.state = state

    def dummy_step(self) -> None:
        """Create the optimizer state of every param that has none (zeros, step 0), leaving the params as
        they are, so that a checkpoint load can fill it in place."""
        for slot in self._ensure_built().values():
            entry = slot.optimizer.state[slot.master]
            if len(entry) == 0:
                entry.update(_initial_state(slot.optimizer, slot.group, slot.master))
        self._publish_state()

    def update_fp32_param_by_new_param(self) -> None:
        """Refresh every separate inner copy from its param (after the params were loaded or changed)."""
        if self._slots is None:
            return
        for slot in self._slots.values():
            if slot.master is not slot.param:
                slot.master.copy_(slot.param.detach())

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """After `state[param][key]` entries were replaced (not filled in place): copy `master_param` into the
        inner param and move the state tensors to where the inner optimizer keeps them."""
        for param, entry in list(self.state.items()):
            slot = self._ensure_built()[param]
            master = entry.get("master_param")
            if torch.is_tensor(master) and master is not slot.master:
                slot.master.copy_(master)
            for key, value in list(entry.items()):
                if torch.is_tensor(value) and value.shape == slot.master.shape and key != "master_param":
                    entry[key] = value.to(device=slot.master.device, dtype=slot.master.dtype)
            slot.optimizer.state[slot.master] = entry
        self._publish_state()

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout: {"state": {index: {step, exp_avg, exp_avg_sq, [master_param]}}, "param_groups"}."""
        self._ensure_built()
        self._publish_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore `state_dict()` output into the existing tensors (the host part stays on the host, fp32
        copies stay fp32); hyper-parameters are restored, implementation flags (fused, foreach) kept."""
        slots = self._ensure_built()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                f"the optimizer state has groups of sizes {[len(g['params']) for g in saved_groups]}, this "
                f"optimizer {[len(g['params']) for g in self.param_groups]}: the parameters or their grouping differ"
            )
        param_of_index = {}
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS})
            param_of_index.update(zip(saved["params"], group["params"]))
        self.dummy_step()
        for index, saved_entry in state_dict["state"].items():
            slot = slots[param_of_index[index]]
            entry = slot.optimizer.state[slot.master]
            for key, value in saved_entry.items():
                target = slot.master if key == "master_param" else entry.get(key)
                if torch.is_tensor(value) and torch.is_tensor(target) and target.shape == value.shape:
                    if target is not value:
                        target.copy_(value)
                elif key != "master_param":
                    entry[key] = copy.deepcopy(value)
        self._publish_state()


__all__ = ["HybridDeviceOptimizer"]
