"""Pipeline schedules as data: pure functions from sizes and rank to a list of `Action`s.

Each schedule function returns, for one pipeline rank, the exact sequence of compute steps
(`forward`, `backward`) and point-to-point intents (`recv_forward`, `send_forward`,
`recv_backward`, `send_backward`) that Megatron's schedule performs on that rank. P2P actions that
share a `batch` number are issued together in one `batch_isend_irecv` call, as Megatron's combined
helpers (`send_forward_recv_backward`, `send_forward_backward_recv_forward_backward`, ...) do. No
action list touches torch or a process group, so schedule order is tested without processes.

Naming of p2p intents, seen from the rank that owns the list:
- `recv_forward(m, c)`: receive the activation that is the input of chunk `c` for microbatch `m`.
- `send_forward(m, c)`: send the output of chunk `c` for microbatch `m` to the next rank.
- `recv_backward(m, c)`: receive the gradient of the output of chunk `c` for microbatch `m`.
- `send_backward(m, c)`: send the gradient of the input of chunk `c` for microbatch `m` to the
  previous rank.
Ranks form a ring for the virtual pipeline: the last rank's chunk `c` feeds rank 0's chunk `c + 1`.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

FORWARD = "forward"
BACKWARD = "backward"
RECV_FORWARD = "recv_forward"
SEND_FORWARD = "send_forward"
RECV_BACKWARD = "recv_backward"
SEND_BACKWARD = "send_backward"
COMPUTE_KINDS = (FORWARD, BACKWARD)
P2P_KINDS = (RECV_FORWARD, SEND_FORWARD, RECV_BACKWARD, SEND_BACKWARD)

MICROBATCH_GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


@dataclass(frozen=True)
class Action:
    """One step of a pipeline schedule on one rank."""

    kind: str
    """One of forward, backward, recv_forward, send_forward, recv_backward, send_backward."""

    microbatch: int
    """Microbatch index in [0, num_microbatches)."""

    chunk: int = 0
    """Model chunk (virtual pipeline stage on this rank) the step belongs to."""

    batch: int = -1
    """For p2p actions: index of the batched p2p call on this rank (equal = one batch_isend_irecv)."""

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS


class _ActionList:
    """Builder that numbers p2p calls: each `call(...)` becomes one batched communication."""

    def __init__(self):
        self.actions: List[Action] = []
        self._num_calls = 0

    def compute(self, kind: str, microbatch: int, chunk: int = 0) -> None:
        self.actions.append(Action(kind, microbatch, chunk))

    def call(self, *intents: Optional[Tuple[str, int, int]]) -> None:
        """Append one batched p2p call made of the non-None `(kind, microbatch, chunk)` intents."""
        present = [intent for intent in intents if intent is not None]
        if not present:
            return
        for kind, microbatch, chunk in present:
            self.actions.append(Action(kind, microbatch, chunk, self._num_calls))
        self._num_calls += 1


def _check_sizes(pp_size: int, pp_rank: int, num_microbatches: int) -> None:
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(
            f"pipeline rank {pp_rank} is outside [0, {pp_size}) for --pipeline-model-parallel-size {pp_size}"
        )
    if num_microbatches < 1:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) must be >= 1: --global-batch-size must be at least "
            "--micro-batch-size x data-parallel size"
        )


def no_pipelining_schedule(num_microbatches: int, forward_only: bool = False) -> List[Action]:
    """Forward then backward for every microbatch on a single stage (PP=1)."""
    _check_sizes(1, 0, num_microbatches)
    out = _ActionList()
    for m in range(num_microbatches):
        out.compute(FORWARD, m)
        if not forward_only:
            out.compute(BACKWARD, m)
    return out.actions


def num_warmup_microbatches_1f1b(pp_size: int, pp_rank: int, num_microbatches: int) -> int:
    """Forward passes run before the first backward in 1F1B: min(PP - rank - 1, M)."""
    return min(pp_size - pp_rank - 1, num_microbatches)


def one_f_one_b_schedule(
    pp_size: int, pp_rank: int, num_microbatches: int, forward_only: bool = False
) -> List[Action]:
    """Megatron's non-interleaved 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down."""
    _check_sizes(pp_size, pp_rank, num_microbatches)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def recv_f(m):
        return None if first else (RECV_FORWARD, m, 0)

    def send_f(m):
        return None if last else (SEND_FORWARD, m, 0)

    def recv_b(m):
        return None if last else (RECV_BACKWARD, m, 0)

    def send_b(m):
        return None if first else (SEND_BACKWARD, m, 0)

    warmup = num_warmup_microbatches_1f1b(pp_size, pp_rank, num_microbatches)
    remaining = num_microbatches - warmup
    out = _ActionList()
    for m in range(warmup):
        out.call(recv_f(m))
        out.compute(FORWARD, m)
        out.call(send_f(m))
    if remaining > 0:
        out.call(recv_f(warmup))
    for i in range(remaining):
        fwd, last_iteration = warmup + i, i == remaining - 1
        out.compute(FORWARD, fwd)
        if forward_only:
            out.call(send_f(fwd))
            if not last_iteration:
                out.call(recv_f(fwd + 1))
            continue
        out.call(send_f(fwd), recv_b(i))
        out.compute(BACKWARD, i)
        if last_iteration:
            out.call(send_b(i))
        else:
            out.call(send_b(i), recv_f(fwd + 1))
    if not forward_only:
        for m in range(remaining, num_microbatches):
            out.call(recv_b(m))
            out.compute(BACKWARD, m)
            out.call(send_b(m))
    return out.actions


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> List[Tuple[int, int]]:
    """(microbatch, chunk) of every virtual microbatch, in forward order (Megatron's lookup table).

    Microbatches are taken in groups of `microbatch_group_size_per_vp_stage`; each group runs through
    chunk 0, then chunk 1, ...; the last group absorbs the remainder. PP2 M5 VP2 group 3 gives
    microbatches 0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1.
    """
    table = []
    group = microbatch_group_size_per_vp_stage
    for start in range(0, num_microbatches, group):
        end = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((m, c) for c in range(num_model_chunks) for m in range(start, end))
    return table


def convert_schedule_table_to_order(
    num_warmup_microbatches: int, num_model_chunks: int, schedule_table: List[Tuple[int, int]]
) -> List[int]:
    """The chunk order in TE's `make_graphed_callables` format: chunk+1 for forwards, chunk-C for backwards.

    PP2 M5 VP2 group 3 with 5 warm-up steps gives 1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1.
    """
    chunk_ids = [chunk for _, chunk in schedule_table]
    forward_order = [chunk + 1 for chunk in chunk_ids]
    backward_order = [chunk - num_model_chunks for chunk in chunk_ids]
    order = forward_order[:num_warmup_microbatches]
    for i in range(num_warmup_microbatches, len(forward_order)):
        order.append(forward_order[i])
        order.append(backward_order[i - num_warmup_microbatches])
    if num_warmup_microbatches > 0:
        order.extend(backward_order[-num_warmup_microbatches:])
    return order


def validate_interleaved_sizes(pp_size: int, num_microbatches: int, microbatch_group_size: int) -> None:
    """Raise one ValueError listing every violated interleaved-schedule constraint."""
    problems = []
    if microbatch_group_size < pp_size:
        problems.append(
            f"{MICROBATCH_GROUP_FLAG} ({microbatch_group_size}) must be >= --pipeline-model-parallel-size "
            f"({pp_size}): raise the group size to at least {pp_size}"
        )
    if microbatch_group_size > num_microbatches:
        problems.append(
            f"{MICROBATCH_GROUP_FLAG} ({microbatch_group_size}) must be <= the number of microbatches "
            f"({num_microbatches}): raise --global-batch-size or lower the group size"
        )
    remainder = num_microbatches % microbatch_group_size
    if remainder != 0 and remainder < pp_size:
        problems.append(
            f"the number of microbatches ({num_microbatches}) modulo {MICROBATCH_GROUP_FLAG} "
            f"({microbatch_group_size}) is {remainder}, which must be 0 or >= --pipeline-model-parallel-size "
            f"({pp_size}): choose --global-batch-size so that the microbatch count is a multiple of the group size"
        )
    if problems:
        raise ValueError("interleaved pipeline schedule: " + "; ".join(problems))


def num_warmup_microbatches_interleaved(
    pp_size: int, pp_rank: int, num_microbatches: int, num_model_chunks: int, group: int, forward_only: bool
) -> int:
    """Virtual forwards before the first backward: (PP-rank-1)*2 + (chunks-1)*group, capped at M*chunks."""
    total = num_microbatches * num_model_chunks
    if forward_only:
        return total
    return min((pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * group, total)


class _Interleaved:
    """Index arithmetic of the interleaved schedule for one rank (virtual microbatch ids)."""

    def __init__(self, pp_size, pp_rank, num_microbatches, num_model_chunks, group):
        self.pp_size, self.pp_rank, self.chunks = pp_size, pp_rank, num_model_chunks
        self.table = get_schedule_table(num_microbatches, num_model_chunks, group)
        self.total = len(self.table)

    def fwd(self, k: int) -> Tuple[int, int]:
        return self.table[k]

    def bwd(self, k: int) -> Tuple[int, int]:
        microbatch, chunk = self.table[k]
        return microbatch, self.chunks - 1 - chunk

    def send_forward(self, k):
        m, c = self.fwd(k)
        is_last = self.pp_rank == self.pp_size - 1 and c == self.chunks - 1
        return None if is_last else (SEND_FORWARD, m, c)

    def send_backward(self, k):
        m, c = self.bwd(k)
        return None if (self.pp_rank == 0 and c == 0) else (SEND_BACKWARD, m, c)

    def recv_forward_after(self, k):
        """What is received in the call after virtual forward `k` (Megatron's recv_prev rule)."""
        if k + 1 >= self.total:
            return None
        if self.pp_rank != 0:
            return (RECV_FORWARD, *self.fwd(k + 1))
        if k < self.pp_size - 1:
            return None
        m, c = self.fwd(k - (self.pp_size - 1))
        return None if c == self.chunks - 1 else (RECV_FORWARD, m, c + 1)

    def recv_backward_after(self, k):
        """What is received in the call after virtual backward `k` (Megatron's recv_next rule)."""
        if k + 1 >= self.total:
            return None
        if self.pp_rank != self.pp_size - 1:
            return (RECV_BACKWARD, *self.bwd(k + 1))
        if k < self.pp_size - 1:
            return None
        m, c = self.bwd(k - (self.pp_size - 1))
        return None if c == 0 else (RECV_BACKWARD, m, c - 1)


def interleaved_schedule(
    pp_size: int,
    vp_size: int,
    num_microbatches: int,
    pp_rank: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    forward_only: bool = False,
) -> List[Action]:
    """Megatron's interleaved 1F1B over `vp_size` model chunks per rank."""
    _check_sizes(pp_size, pp_rank, num_microbatches)
    group = microbatch_group_size_per_vp_stage or pp_size
    validate_interleaved_sizes(pp_size, num_microbatches, group)
    s = _Interleaved(pp_size, pp_rank, num_microbatches, vp_size, group)
    warmup = num_warmup_microbatches_interleaved(pp_size, pp_rank, num_microbatches, vp_size, group, forward_only)
    all_warmup = warmup == s.total
    remaining = s.total - warmup
    is_last_rank = pp_rank == pp_size - 1
    out = _ActionList()
    if pp_rank != 0:
        out.call((RECV_FORWARD, *s.fwd(0)))
    for k in range(warmup):
        out.compute(FORWARD, *s.fwd(k))
        first_backward_grad = None
        if k == warmup - 1 and not forward_only and not all_warmup and not is_last_rank:
            first_backward_grad = (RECV_BACKWARD, *s.bwd(0))
        out.call(s.send_forward(k), s.recv_forward_after(k), first_backward_grad)
    for k in range(remaining):
        fwd = k + warmup
        out.compute(FORWARD, *s.fwd(fwd))
        out.compute(BACKWARD, *s.bwd(k))
        recv_prev = None if k == remaining - 1 else s.recv_forward_after(fwd)
        out.call(s.send_forward(fwd), s.send_backward(k), recv_prev, s.recv_backward_after(k))
    if not forward_only:
        if all_warmup and not is_last_rank:
            out.call((RECV_BACKWARD, *s.bwd(0)))
        for k in range(remaining, s.total):
            out.compute(BACKWARD, *s.bwd(k))
            out.call(s.send_backward(k), s.recv_backward_after(k))
    return out.actions


def get_schedule(
    pp_size: int,
    vp_size: Optional[int],
    num_microbatches: int,
    pp_rank: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    forward_only: bool = False,
) -> List[Action]:
    """The action list `get_forward_backward_func()` would run for these sizes on rank `pp_rank`."""
    if pp_size == 1:
        return no_pipelining_schedule(num_microbatches, forward_only)
    if vp_size is None or vp_size == 1:
        return one_f_one_b_schedule(pp_size, pp_rank, num_microbatches, forward_only)
    return interleaved_schedule(
        pp_size, vp_size, num_microbatches, pp_rank, microbatch_group_size_per_vp_stage, forward_only
    )
