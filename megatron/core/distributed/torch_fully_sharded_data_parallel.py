"""`TorchFullyShardedDataParallel`: PyTorch FSDP2 (`fully_shard`) behind the DDP wrapper's interface.

Each transformer layer (and embedding / rotary / column-parallel output layer) becomes one FSDP unit so
its parameters are all-gathered just in time; units nested in another unit (the linears of a layer) stay
part of the outer one; the root module is wrapped last. Gradients are
reduce-scattered by FSDP's own backward hooks, so `finish_grad_sync` only waits for them; `no_sync`
maps to `set_requires_gradient_sync(False)`. Parameters become DTensors sharded over the DP x CP group;
Megatron's parameter attributes (`tensor_model_parallel`, `shared`, ...) are carried over.

Design note: the default units are matched by class name rather than imported, because
`megatron.core.distributed` must not import `megatron.core.transformer` or `megatron.core.models`.
"""
from contextlib import contextmanager
from typing import Iterable, Optional, Set, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

try:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    HAVE_FSDP = True
except ImportError:
    HAVE_FSDP = False

_DEFAULT_UNIT_CLASS_NAMES = frozenset(
    {"TransformerLayer", "LanguageModelEmbedding", "RotaryEmbedding", "ColumnParallelLinear"}
)


def _is_unit(module: torch.nn.Module, classes: Set[type], names: Set[str]) -> bool:
    if classes and isinstance(module, tuple(classes)):
        return True
    return any(cls.__name__ in names for cls in type(module).__mro__)


def _outermost_units(root: torch.nn.Module, classes: Set[type], names: Set[str]):
    """Unit modules below `root` in forward (pre-)order, skipping units nested in another unit (a
    transformer layer's column-parallel linears belong to the layer's unit)."""
    chosen = []
    for name, module in root.named_modules():
        if module is root or not _is_unit(module, classes, names):
            continue
        if any(name.startswith(outer + ".") for outer, _ in chosen):
            continue
        chosen.append((name, module))
    return [module for _, module in chosen]


class TorchFullyShardedDataParallel(_BaseDataParallel):
    """Shard parameters, gradients and optimizer state over data-parallel ranks with torch FSDP2.

    Args:
        config: the model's TransformerConfig.
        ddp_config: the DistributedDataParallelConfig (kept for the training loop's checks).
        module: the model chunk to shard.
        sub_modules_to_wrap: classes or class names that each become an FSDP unit (default: transformer
            layers, embeddings, rotary embeddings and column-parallel linears).
        process_group: the group to shard over (default: DP x CP from parallel_state).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3; False gives ZeRO-2).
    """

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        sub_modules_to_wrap: Optional[Iterable[Union[type, str]]] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        reshard_after_forward: bool = True,
    ):
        if not HAVE_FSDP:
            raise RuntimeError("TorchFullyShardedDataParallel (--use-torch-fsdp2) needs torch.distributed.fsdp.fully_shard")
        super().__init__(config=config, module=module)
        self.ddp_config = ddp_config
        if process_group is None:
            process_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.process_group = process_group
        device_type = "cuda" if dist.get_backend(process_group) == "nccl" else "cpu"
        self.device_mesh = DeviceMesh.from_group(process_group, device_type)
        kwargs = {"mesh": self.device_mesh, "reshard_after_forward": reshard_after_forward}

        classes, names = set(), set()
        for entry in sub_modules_to_wrap if sub_modules_to_wrap is not None else _DEFAULT_UNIT_CLASS_NAMES:
            (names.add(entry) if isinstance(entry, str) else classes.add(entry))
        for sub_module in self.module.modules():
            for extra in getattr(sub_module, "_fsdp_modules", []):
                (names.add(extra) if isinstance(extra, str) else classes.add(extra))

        saved_attrs = {name: dict(vars(param)) for name, param in self.module.named_parameters()}
        recompute = getattr(config, "recompute_granularity", None) is not None
        previous = None
        for sub_module in _outermost_units(self.module, classes, names):
            fully_shard(sub_module, **kwargs)
            if recompute:
                # Recompute reorders backward; pin the prefetch order to the layer order.
                sub_module.set_modules_to_backward_prefetch([previous] if previous is not None else [])
            previous = sub_module
        fully_shard(self.module, **kwargs)
        for name, param in self.module.named_parameters():
            for attr, value in saved_attrs.get(name, {}).items():
                setattr(param, attr, value)
        # Per-token loss: gradients must be summed over DP (finalize_model_grads divides by the token
        # count). NCCL does that inside the reduce-scatter; gloo has no PREMUL_SUM, so FSDP's average
        # is multiplied back in finish_grad_sync.
        self._undo_average_factor = 1.0
        if getattr(config, "calculate_per_token_loss", False):
            if device_type == "cuda":
                self._set_divide_factor(1.0)
            else:
                self._undo_average_factor = float(process_group.size())

    def _set_divide_factor(self, factor: float):
        for sub_module in self.module.modules():
            setter = getattr(sub_module, "set_gradient_divide_factor", None)
            if setter is not None:
                setter(factor)

    @contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally; reduce-scatter only after the last microbatch."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish_grad_sync(self):
        """FSDP reduce-scatters in its backward hooks; only the per-token rescaling may be left to do."""
        if self._undo_average_factor != 1.0:
            self.scale_gradients(self._undo_average_factor)

    def scale_gradients(self, scaling_factor):
        """Multiply every (sharded) gradient by `scaling_factor` (a number or a 0-dim tensor)."""
        if isinstance(scaling_factor, torch.Tensor):
            scaling_factor = float(scaling_factor)
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)

    def zero_grad_buffer(self):
        """Drop gradients (FSDP keeps them in `param.grad`)."""
        for param in self.module.parameters():
            param.grad = None

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full (unsharded) or sharded state dict into the sharded module."""
        full = any(isinstance(v, torch.Tensor) and not hasattr(v, "device_mesh") for v in state_dict.values())
        options = StateDictOptions(full_state_dict=full, strict=strict)
        return set_model_state_dict(self.module, state_dict, options=options)
