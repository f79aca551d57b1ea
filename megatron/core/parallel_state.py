"""Model-parallel process groups and the Megatron getters over them (alias `megatron.core.mpu`).

The rank layout comes from the pure `RankGenerator`; this module only turns rank lists into
`torch.distributed` groups and answers "which group / which rank am I" questions. All state lives in
one `_ParallelState` object (`_STATE`), reset by `destroy_model_parallel()`.

Design notes:
- Uninitialised defaults: the TP/PP/CP/EP size getters return 1 (rank 0) when no group exists, so a
  layer can be built in a single process without `initialize_model_parallel`; the DP size getters
  keep Megatron's 0 when `torch.distributed` is not initialised.
- Gloo worlds: when the default backend is gloo, every group is a gloo group; the "gloo twin" groups
  Megatron creates for DP are then the same objects, and groups with identical rank lists are shared
  (gloo runs each group's ops in issue order, and every rank issues them in the same order).
"""
import functools
import operator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.nccl_comm_config import (
    get_nccl_options, load_nccl_comm_cfgs, mark_high_priority_stream_groups, megatron_group_name)
from megatron.core.rank_generator import (  # generate_masked_orthogonal_rank_groups: Megatron exports it here
    RankGenerator, build_rank_generators, check_parallel_sizes, generate_masked_orthogonal_rank_groups,
    hierarchical_context_parallel_rank_lists, intra_distributed_optimizer_instance_rank_lists,
    partial_data_parallel_rank_lists)

_GLOO_TWINS = ("dp", "dp_cp", "intra_partial_dp_cp", "expt_dp", "intra_partial_expt_dp")


class GlobalMemoryBuffer:
    """Named scratch tensors reused across calls (e.g. the all-gather output of sequence parallelism)."""

    def __init__(self) -> None:
        self.buffer: Dict[Any, torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
        """A view of shape `tensor_shape` into the buffer `(name, dtype)`, grown when too small."""
        required = functools.reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        current = self.buffer.get(key)
        if current is None or current.numel() < required:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            self.buffer[key] = torch.empty(required, dtype=dtype, device=device, requires_grad=False)
        # [capacity] -> [required] -> tensor_shape
        return self.buffer[key][0:required].view(*tensor_shape)


@dataclass
class _ParallelState:
    """Everything `initialize_model_parallel` creates; one instance, module-private."""

    groups: Dict[str, Any] = field(default_factory=dict)
    """Process group of this rank per group name ('tp', 'pp', 'dp', 'dp_cp', 'ep', ...)."""

    global_ranks: Dict[str, List[int]] = field(default_factory=dict)
    """Global ranks of this rank's group per group name."""

    hierarchical_cp_groups: Optional[List[Any]] = None
    """This rank's hierarchical context-parallel groups, one per level."""

    overrides: Dict[str, Optional[int]] = field(default_factory=dict)
    """Values forced through the `set_*` setters (e.g. 'tp_size'), which win over the groups."""

    virtual_pipeline_rank: Optional[int] = None
    """Current virtual pipeline (model chunk) index, or None without interleaving."""

    virtual_pipeline_world_size: Optional[int] = None
    """Number of model chunks per pipeline rank, or None without interleaving."""

    pipeline_split_rank: Optional[int] = None
    """Deprecated encoder/decoder split rank."""

    memory_buffer: Optional[GlobalMemoryBuffer] = None
    """Scratch buffer returned by `get_global_memory_buffer`."""

    moe_logging_tracker: Dict[str, Any] = field(default_factory=dict)
    """Per-layer MoE auxiliary-loss values collected for logging."""

    rank_generators: Dict[str, RankGenerator] = field(default_factory=dict)
    """'decoder' and 'expert' rank generators used to build the groups."""


_STATE = _ParallelState()


def create_group(
    ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None
):
    """`torch.distributed.new_group` with Megatron's keyword set (group_desc only where torch has it)."""
    kwargs = {"ranks": ranks, "timeout": timeout, "backend": backend, "pg_options": pg_options}
    if use_local_synchronization:
        kwargs["use_local_synchronization"] = True
    if group_desc is not None:
        kwargs["group_desc"] = group_desc
    try:
        return dist.new_group(**kwargs)
    except TypeError:
        kwargs.pop("group_desc", None)
        return dist.new_group(**kwargs)


def update_pg_timeout(timeout: timedelta, pg=None) -> None:
    """Set the timeout of `pg`, or of the default group and every model-parallel group, after a barrier."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return
    dist.barrier(pg)
    groups = [pg] if pg is not None else [None] + list({id(g): g for g in _STATE.groups.values() if g}.values())
    for group in groups:
        setter(timeout, group)


def default_embedding_ranks(pp_ranks: List[int], split_rank: Optional[int] = None) -> List[int]:
    """Ranks sharing the word embedding: first and last pipeline stage (plus the split rank)."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    if split_rank is not None and pp_ranks[split_rank] not in (pp_ranks[0], pp_ranks[-1]):
        return [pp_ranks[0], pp_ranks[split_rank], pp_ranks[-1]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: List[int], split_rank: Optional[int] = None) -> List[int]:
    """Ranks sharing the learned position embedding: the first pipeline stage (plus the split rank)."""
    if split_rank is not None and pp_ranks[0] != pp_ranks[split_rank]:
        return [pp_ranks[0], pp_ranks[split_rank]]
    return [pp_ranks[0]]


class _GroupBuilder:
    """Creates groups in the same order on every rank and records the ones containing this rank. NCCL groups
    get the options of their entry in `nccl_comm_cfgs` (Megatron's group names, `nccl_comm_config`)."""

    def __init__(self, state: _ParallelState, timeout: timedelta, create_gloo: bool,
                 nccl_comm_cfgs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        self.state = state
        self.timeout = timeout
        self.create_gloo = create_gloo
        self.nccl_comm_cfgs = nccl_comm_cfgs or {}
        self.rank = dist.get_rank()
        self.world_is_gloo = dist.get_backend() == "gloo"
        self.cache: Dict[Any, Any] = {}

    def _nccl_options(self, name: Optional[str], backend: Optional[str]):
        pg_name = megatron_group_name(name) if name is not None else None
        if pg_name is None or not (backend == "nccl" or (backend is None and not self.world_is_gloo)):
            return None
        return get_nccl_options(pg_name, self.nccl_comm_cfgs)

    def new(self, ranks: List[int], backend: Optional[str] = None, desc: Optional[str] = None,
            name: Optional[str] = None):
        """A group over `ranks`; in a gloo world, gloo groups with the same ranks are created once."""
        if self.world_is_gloo and backend in (None, "gloo"):
            key = tuple(ranks)
            if key not in self.cache:
                self.cache[key] = create_group(ranks, timeout=self.timeout, group_desc=desc)
            return self.cache[key]
        return create_group(ranks, timeout=self.timeout, backend=backend, group_desc=desc,
                            pg_options=self._nccl_options(name, backend))

    def build(self, name: str, rank_lists: List[List[int]], backend: Optional[str] = None) -> None:
        """Create one group per rank list; keep this rank's under `name` (and its gloo twin if wanted)."""
        for ranks in rank_lists:
            group = self.new(ranks, backend=backend, desc=name.upper(), name=name)
            gloo = None
            if name in _GLOO_TWINS and self.create_gloo:
                gloo = self.new(ranks, backend="gloo", desc=name.upper() + "_GLOO")
            if self.rank in ranks:
                self.state.groups[name] = group
                self.state.global_ranks[name] = list(ranks)
                if gloo is not None:
                    self.state.groups[name + "_gloo"] = gloo


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    encoder_tensor_model_parallel_size: int = 0,
    encoder_pipeline_model_parallel_size: int = 0,
    get_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
) -> None:
    """Create every model/data-parallel group for the layout; `torch.distributed` must be initialised.

    `nccl_communicator_config_path` (YAML, see `nccl_comm_config`) and `high_priority_stream_groups` set the
    NCCL options of the groups; the file is read and checked on every backend. `use_sharp` is accepted for
    compatibility (SHARP needs NCCL's CollNet on InfiniBand switches).
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group() to have run")
    world_size = dist.get_world_size()
    tp, pp, cp, ep = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                      expert_model_parallel_size)
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    check_parallel_sizes(world_size, tp, pp, cp, ep, etp, num_distributed_optimizer_instances,
                         encoder_tensor_model_parallel_size, encoder_pipeline_model_parallel_size, order)
    if hierarchical_context_parallel_sizes and functools.reduce(operator.mul, hierarchical_context_parallel_sizes) != cp:
        raise ValueError(
            f"hierarchical_context_parallel_sizes {hierarchical_context_parallel_sizes} must multiply to "
            f"context_parallel_size ({cp})"
        )
    if virtual_pipeline_model_parallel_size is not None and pp <= 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size ({virtual_pipeline_model_parallel_size}) needs "
            f"pipeline_model_parallel_size > 1 (got {pp}): the interleaved schedule splits a pipeline"
        )
    nccl_comm_cfgs = load_nccl_comm_cfgs(nccl_communicator_config_path)
    mark_high_priority_stream_groups(nccl_comm_cfgs, high_priority_stream_groups)
    decoder, expert = build_rank_generators(world_size, tp, pp, cp, ep, etp, order)
    destroy_model_parallel()
    state = _STATE
    if virtual_pipeline_model_parallel_size is not None:
        state.virtual_pipeline_rank = 0
        state.virtual_pipeline_world_size = virtual_pipeline_model_parallel_size
    state.pipeline_split_rank = pipeline_model_parallel_split_rank
    state.rank_generators = {"decoder": decoder, "expert": expert}
    builder = _GroupBuilder(state, timedelta(minutes=distributed_timeout_minutes), create_gloo_process_groups,
                            nccl_comm_cfgs)
    _build_data_parallel_groups(builder, decoder, num_distributed_optimizer_instances)
    _build_model_groups(builder, decoder, pipeline_model_parallel_comm_backend, hierarchical_context_parallel_sizes,
                        get_embedding_ranks or default_embedding_ranks,
                        get_position_embedding_ranks or default_position_embedding_ranks)
    _build_expert_groups(builder, expert, num_distributed_optimizer_instances)
    state.memory_buffer = GlobalMemoryBuffer()


def _build_data_parallel_groups(builder: _GroupBuilder, gen: RankGenerator, num_instances: int) -> None:
    dp_cp_lists = gen.get_ranks("dp-cp")
    builder.build("dp_cp", dp_cp_lists)
    if num_instances > 1:
        intra, inter = partial_data_parallel_rank_lists(dp_cp_lists, num_instances)
        builder.build("intra_partial_dp_cp", intra)
        builder.build("inter_partial_dp", inter)
    else:
        state = builder.state
        state.groups["intra_partial_dp_cp"] = state.groups["dp_cp"]
        state.global_ranks["intra_partial_dp_cp"] = state.global_ranks["dp_cp"]
        if "dp_cp_gloo" in state.groups:
            state.groups["intra_partial_dp_cp_gloo"] = state.groups["dp_cp_gloo"]
    builder.build("dp", gen.get_ranks("dp"))


def _build_model_groups(builder, gen, pp_backend, hierarchical_sizes, embedding_ranks_fn, position_ranks_fn) -> None:
    state = builder.state
    cp_lists = gen.get_ranks("cp")
    builder.build("cp", cp_lists)
    if hierarchical_sizes:
        for level, level_lists in enumerate(hierarchical_context_parallel_rank_lists(cp_lists, list(hierarchical_sizes))):
            builder.build(f"hcp_{level}", level_lists)
        state.hierarchical_cp_groups = [state.groups[f"hcp_{i}"] for i in range(len(hierarchical_sizes))]
    builder.build("mp", gen.get_ranks("tp-pp"))
    builder.build("tp", gen.get_ranks("tp"))
    pp_lists = gen.get_ranks("pp")
    builder.build("pp", pp_lists, backend=pp_backend)
    split = state.pipeline_split_rank
    builder.build("embd", [embedding_ranks_fn(ranks, split) for ranks in pp_lists])
    builder.build("pos_embd", [position_ranks_fn(ranks, split) for ranks in pp_lists])
    for name in ("embd", "pos_embd"):
        if name not in state.global_ranks:
            state.global_ranks[name] = []
            state.groups[name] = None
    builder.build("tp_dp_cp", gen.get_ranks("tp-dp-cp"))
    builder.build("tp_dp", gen.get_ranks("tp-dp"))
    builder.build("tp_cp", gen.get_ranks("tp-cp"))


def _build_expert_groups(builder: _GroupBuilder, gen: RankGenerator, num_instances: int) -> None:
    builder.build("ep", gen.get_ranks("ep"))
    builder.build("expt_tp", gen.get_ranks("tp"))
    builder.build("tp_ep", gen.get_ranks("tp-ep"))
    builder.build("tp_ep_pp", gen.get_ranks("tp-ep-pp"))
    expt_dp_lists = gen.get_ranks("dp")
    builder.build("expt_dp", expt_dp_lists)
    state = builder.state
    if num_instances > 1:
        # Megatron builds one inter-instance group, from the expert DP lists, and uses it for dense
        # parameters too.
        intra, inter = partial_data_parallel_rank_lists(expt_dp_lists, num_instances)
        builder.build("intra_partial_expt_dp", intra)
        builder.build("inter_partial_expt_dp", inter)
    else:
        state.groups["intra_partial_expt_dp"] = state.groups["expt_dp"]
        state.global_ranks["intra_partial_expt_dp"] = state.global_ranks["expt_dp"]
        if "expt_dp_gloo" in state.groups:
            state.groups["intra_partial_expt_dp_gloo"] = state.groups["expt_dp_gloo"]
    builder.build("intra_dist_opt", intra_distributed_optimizer_instance_rank_lists(gen, num_instances))


def destroy_model_parallel() -> None:
    """Forget every group and setter override (the groups themselves are left to torch.distributed)."""
    global _STATE
    _STATE = _ParallelState()


def model_parallel_is_initialized() -> bool:
    """True once `initialize_model_parallel` has created the TP, PP and DP groups."""
    return all(_STATE.groups.get(name) is not None for name in ("tp", "pp", "dp"))


def is_initialized() -> bool:
    """True once the data-parallel group exists."""
    return _STATE.groups.get("dp") is not None


def is_unitialized() -> bool:
    """Deprecated spelling kept by Megatron: True when no data-parallel group exists."""
    return _STATE.groups.get("dp") is None


def _group(name: str, check_initialized: bool = True, what: str = ""):
    group = _STATE.groups.get(name)
    if group is None and check_initialized and name not in _STATE.groups:
        raise RuntimeError(
            f"{what or name} group is not initialized: call parallel_state.initialize_model_parallel() first"
        )
    return group


def _ranks(name: str) -> List[int]:
    ranks = _STATE.global_ranks.get(name)
    if ranks is None:
        raise RuntimeError(f"{name} group is not initialized: call parallel_state.initialize_model_parallel() first")
    return ranks


def _size(name: str, override: Optional[str] = None, default: int = 1) -> int:
    if override is not None and _STATE.overrides.get(override) is not None:
        return _STATE.overrides[override]
    group = _STATE.groups.get(name)
    if group is None:
        return default
    return dist.get_world_size(group=group)


def _rank(name: str, override: Optional[str] = None) -> int:
    if override is not None and _STATE.overrides.get(override) is not None:
        return _STATE.overrides[override]
    group = _STATE.groups.get(name)
    if group is None:
        return 0
    return dist.get_rank(group=group)


# Tensor model parallel
def get_tensor_model_parallel_group(check_initialized=True):
    return _group("tp", check_initialized, "tensor model parallel")


def get_tensor_model_parallel_world_size():
    return _size("tp", "tp_size")


def get_tensor_model_parallel_rank():
    return _rank("tp", "tp_rank")


def get_tensor_model_parallel_src_rank():
    return _ranks("tp")[0]


def get_tensor_model_parallel_ranks():
    return list(_ranks("tp"))


def set_tensor_model_parallel_world_size(world_size):
    _STATE.overrides["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank):
    _STATE.overrides["tp_rank"] = rank


# Pipeline model parallel
def get_pipeline_model_parallel_group(check_initialized=True):
    return _group("pp", check_initialized, "pipeline model parallel")


def get_pipeline_model_parallel_world_size():
    return _size("pp", "pp_size")


def get_pipeline_model_parallel_rank():
    return _rank("pp", "pp_rank")


def set_pipeline_model_parallel_world_size(world_size):
    _STATE.overrides["pp_size"] = world_size


def set_pipeline_model_parallel_rank(rank):
    _STATE.overrides["pp_rank"] = rank


def get_pipeline_model_parallel_split_rank():
    return _STATE.pipeline_split_rank


def set_pipeline_model_parallel_split_rank(rank):
    _STATE.pipeline_split_rank = rank


def get_pipeline_model_parallel_first_rank():
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank():
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (wrapping around)."""
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage (wrapping around)."""
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_rank():
    return _STATE.virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank):
    _STATE.virtual_pipeline_rank = rank


def get_virtual_pipeline_model_parallel_world_size():
    return _STATE.virtual_pipeline_world_size


def set_virtual_pipeline_model_parallel_world_size(world_size):
    _STATE.virtual_pipeline_world_size = world_size


def _vp_stage(vp_stage):
    return get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """True on pipeline stage 0 (and, unless ignore_virtual, only for model chunk 0)."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        if _vp_stage(vp_stage) != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """True on the last pipeline stage (and, unless ignore_virtual, only for the last model chunk)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        if _vp_stage(vp_stage) != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_inside_encoder(rank=None):
    """Always False: a separate encoder pipeline is not supported."""
    return False


def is_inside_decoder(rank=None):
    """Always True: every rank runs the decoder."""
    return True


# Embedding groups
def get_embedding_group(check_initialized=True):
    return _group("embd", check_initialized, "embedding")


def get_position_embedding_group(check_initialized=True):
    return _group("pos_embd", check_initialized, "position embedding")


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """True when this rank holds a copy of the shared word embedding."""
    rank = dist.get_rank()
    ranks = _STATE.global_ranks.get("embd", [])
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group():
    """True when this rank holds the shared position embedding."""
    return dist.get_rank() in _STATE.global_ranks.get("pos_embd", [])


# Model parallel (tp x pp)
def get_model_parallel_group(check_initialized=True):
    return _group("mp", check_initialized, "model parallel")


def get_model_parallel_world_size():
    return _size("mp")


def get_model_parallel_rank():
    return _rank("mp")


def get_model_parallel_src_rank():
    return _ranks("mp")[0]


# Data parallel
def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False):
    """This rank's DP group; with_context_parallel gives DP x CP; partial gives this optimizer instance's part."""
    if with_context_parallel:
        return _group("intra_partial_dp_cp" if partial_data_parallel else "dp_cp", what="data parallel with CP")
    if partial_data_parallel:
        raise ValueError("partial_data_parallel=True needs with_context_parallel=True: partial DP groups include CP")
    return _group("dp", what="data parallel")


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """Gloo twin of `get_data_parallel_group` (needs create_gloo_process_groups=True)."""
    if with_context_parallel:
        name = "intra_partial_dp_cp_gloo" if partial_data_parallel else "dp_cp_gloo"
    elif partial_data_parallel:
        raise ValueError("partial_data_parallel=True needs with_context_parallel=True: partial DP groups include CP")
    else:
        name = "dp_gloo"
    if name not in _STATE.groups:
        raise RuntimeError(f"{name} is not initialized: call initialize_model_parallel(create_gloo_process_groups=True)")
    return _STATE.groups[name]


def get_inter_partial_data_parallel_group():
    """Same-position ranks of the dense partial DP groups (an older Megatron getter; DDP and the optimizer
    use `get_inter_distributed_optimizer_instance_group`, as Megatron 0.13 does)."""
    return _group("inter_partial_dp", what="inter partial data parallel")


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """All ranks of this rank's distributed-optimizer instance (every rank with one instance), members
    in Megatron's order: the expert tensor x expert x pipeline groups one after another."""
    return _group("intra_dist_opt", check_initialized, "intra distributed optimizer instance")


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """Group joining the same position of every distributed-optimizer instance (None with one instance).

    Built from the expert data-parallel groups and shared by dense and expert parameters (Megatron's choice)."""
    if check_initialized and _STATE.groups.get("inter_partial_expt_dp") is None:
        raise RuntimeError("inter distributed optimizer instance group exists only with num_distributed_optimizer_instances > 1")
    return _STATE.groups.get("inter_partial_expt_dp")


def get_data_parallel_global_ranks(with_context_parallel=False):
    return list(_ranks("dp_cp" if with_context_parallel else "dp"))


def get_data_parallel_src_rank(with_context_parallel=False):
    return _ranks("dp_cp" if with_context_parallel else "dp")[0]


def _dp_name(with_context_parallel, partial_data_parallel):
    if with_context_parallel:
        return "intra_partial_dp_cp" if partial_data_parallel else "dp_cp"
    return "dp"


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    """DP size (x CP with with_context_parallel); 0 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return _size(_dp_name(with_context_parallel, partial_data_parallel), "dp_size" if not with_context_parallel else None)


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    """This rank's DP index (x CP with with_context_parallel); 0 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return _rank(_dp_name(with_context_parallel, partial_data_parallel), "dp_rank" if not with_context_parallel else None)


def set_data_parallel_rank(rank):
    _STATE.overrides["dp_rank"] = rank


# Context parallel
def get_context_parallel_group(check_initialized=True):
    return _group("cp", check_initialized, "context parallel")


def get_context_parallel_global_ranks(check_initialized=True):
    return list(_ranks("cp")) if check_initialized or "cp" in _STATE.global_ranks else None


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's hierarchical CP groups, one per level."""
    if check_initialized and _STATE.hierarchical_cp_groups is None:
        raise RuntimeError("hierarchical context parallel groups are not initialized")
    return _STATE.hierarchical_cp_groups


def get_context_parallel_world_size():
    return _size("cp")


def get_context_parallel_rank():
    return _rank("cp")


# Tensor x data / tensor x context
def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    """This rank's TP x DP (x CP) group."""
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized, "tensor and data parallel")


def get_tensor_and_data_parallel_world_size(with_context_parallel=False):
    return _size("tp_dp_cp" if with_context_parallel else "tp_dp", default=0)


def get_tensor_and_data_parallel_rank(with_context_parallel=False):
    return _rank("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_group(check_initialized=True):
    return _group("tp_cp", check_initialized, "tensor and context parallel")


def get_tensor_and_context_parallel_world_size():
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank():
    return _rank("tp_cp")


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """Group over which FP8 amax values are reduced."""
    if with_context_parallel:
        return _group("tp_cp" if tp_only_amax_red else "tp_dp_cp", what="amax reduction")
    return _group("tp" if tp_only_amax_red else "tp_dp", what="amax reduction")


# Expert parallel
def get_expert_model_parallel_group(check_initialized=True):
    return _group("ep", check_initialized, "expert model parallel")


def get_expert_model_parallel_src_rank():
    return _ranks("ep")[0]


def get_expert_model_parallel_world_size():
    return _size("ep", "ep_size")


def get_expert_model_parallel_rank():
    return _rank("ep", "ep_rank")


def set_expert_model_parallel_world_size(world_size):
    _STATE.overrides["ep_size"] = world_size


def set_expert_model_parallel_rank(rank):
    _STATE.overrides["ep_rank"] = rank


def get_expert_tensor_parallel_group(check_initialized=True):
    return _group("expt_tp", check_initialized, "expert tensor parallel")


def get_expert_tensor_parallel_world_size():
    """Expert TP size (the dense TP size when expert groups do not exist)."""
    if _STATE.overrides.get("etp_size") is not None:
        return _STATE.overrides["etp_size"]
    if _STATE.groups.get("expt_tp") is None:
        return get_tensor_model_parallel_world_size()
    return _size("expt_tp")


def get_expert_tensor_parallel_rank():
    """This rank's expert TP index (the dense TP rank when expert groups do not exist)."""
    if _STATE.overrides.get("etp_rank") is not None:
        return _STATE.overrides["etp_rank"]
    if _STATE.groups.get("expt_tp") is None:
        return get_tensor_model_parallel_rank()
    return _rank("expt_tp")


def set_expert_tensor_parallel_world_size(world_size):
    _STATE.overrides["etp_size"] = world_size


def set_expert_tensor_parallel_rank(rank):
    _STATE.overrides["etp_rank"] = rank


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    return _group("tp_ep", check_initialized, "expert tensor and model parallel")


def get_expert_tensor_and_model_parallel_world_size():
    return _size("tp_ep")


def get_expert_tensor_and_model_parallel_rank():
    return _rank("tp_ep")


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True):
    return _group("tp_ep_pp", check_initialized, "expert tensor, model and pipeline parallel")


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    """This rank's expert data-parallel group (the part inside this optimizer instance when partial)."""
    name = "intra_partial_expt_dp" if partial_expert_data_parallel else "expt_dp"
    return _group(name, check_initialized, "expert data parallel")


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    """Gloo twin of the expert data-parallel group."""
    name = "intra_partial_expt_dp_gloo" if partial_expert_data_parallel else "expt_dp_gloo"
    if name not in _STATE.groups:
        raise RuntimeError(f"{name} is not initialized: call initialize_model_parallel(create_gloo_process_groups=True)")
    return _STATE.groups[name]


def get_inter_partial_expert_data_parallel_group():
    return _group("inter_partial_expt_dp", what="inter partial expert data parallel")


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    """This rank's expert-DP index; 0 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return _rank("intra_partial_expt_dp" if partial_expert_data_parallel else "expt_dp")


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    """Expert-DP size; 0 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return _size("intra_partial_expt_dp" if partial_expert_data_parallel else "expt_dp", default=0)


# Misc
def get_global_memory_buffer():
    """The process-wide scratch buffer (created on first use if needed)."""
    if _STATE.memory_buffer is None:
        _STATE.memory_buffer = GlobalMemoryBuffer()
    return _STATE.memory_buffer


def destroy_global_memory_buffer():
    """Drop the scratch buffer."""
    _STATE.memory_buffer = None


def get_moe_layer_wise_logging_tracker():
    """Dict of per-layer MoE auxiliary losses collected for logging."""
    return _STATE.moe_logging_tracker


def get_all_ranks():
    """This rank's TP, DP, CP, PP and EP indices joined by '_' (e.g. '1_0_0_1_0')."""
    ranks = [get_tensor_model_parallel_rank(), get_data_parallel_rank(), get_context_parallel_rank(),
             get_pipeline_model_parallel_rank(), get_expert_model_parallel_rank()]
    return "_".join(str(r or 0) for r in ranks)


def get_rank_generator(name: str = "decoder") -> RankGenerator:
    """The 'decoder' (dense) or 'expert' rank generator of the current layout."""
    return _STATE.rank_generators[name]
