"""Schedule tables: order, counts and cross-rank feasibility, with no model and no processes.

The feasibility check simulates every rank's action list together: each batched p2p call blocks
until every one of its sends and receives is matched by the neighbour's call (rendezvous, the
strictest semantics NCCL or gloo can show), channels match in FIFO order per (src, dst, direction),
and compute steps need their inputs. A schedule passes when all ranks run to completion.
"""
import itertools

import pytest

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import convert_schedule_table_to_order, get_pp_rank_microbatches
from megatron.core.pipeline_parallel.schedule_table import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    get_schedule,
    get_schedule_table,
    interleaved_schedule,
    num_warmup_microbatches_interleaved,
    one_f_one_b_schedule,
    validate_interleaved_sizes,
)


def _compute_order(actions):
    return [(a.kind[0].upper(), a.microbatch, a.chunk) for a in actions if not a.is_p2p]


def _calls(actions):
    """[(start index, [actions])] for each batched p2p call."""
    calls, i = [], 0
    while i < len(actions):
        if actions[i].is_p2p:
            j = i
            while j < len(actions) and actions[j].is_p2p and actions[j].batch == actions[i].batch:
                j += 1
            calls.append((i, actions[i:j]))
            i = j
        else:
            i += 1
    return calls


def _channel(rank, action, pp, chunks):
    """(channel key, (microbatch, consumer chunk)) of a p2p action."""
    m, c = action.microbatch, action.chunk
    if action.kind == SEND_FORWARD:
        consumer = c if rank < pp - 1 else c + 1
        return (rank, (rank + 1) % pp, "f"), (m, consumer)
    if action.kind == RECV_FORWARD:
        return ((rank - 1) % pp, rank, "f"), (m, c)
    if action.kind == SEND_BACKWARD:
        consumer = c if rank > 0 else c - 1
        return (rank, (rank - 1) % pp, "b"), (m, consumer)
    return ((rank + 1) % pp, rank, "b"), (m, c)


def _match_channels(lists, pp, chunks):
    """Pair every send with one receive (FIFO per channel); return partner call starts per action."""
    sends, recvs = {}, {}
    for rank, actions in enumerate(lists):
        for start, call in _calls(actions):
            for a in call:
                key, payload = _channel(rank, a, pp, chunks)
                side = sends if a.kind in (SEND_FORWARD, SEND_BACKWARD) else recvs
                side.setdefault(key, []).append((rank, start, payload))
    assert sends.keys() == recvs.keys(), (sorted(sends), sorted(recvs))
    partner = {}
    for key in sends:
        assert len(sends[key]) == len(recvs[key]), f"channel {key}: {len(sends[key])} sends, {len(recvs[key])} recvs"
        for (sr, ss, sp), (rr, rs, rp) in zip(sends[key], recvs[key]):
            assert sp == rp, f"channel {key}: send carries {sp} but the matching receive expects {rp}"
            partner.setdefault((sr, ss), []).append((rr, rs))
            partner.setdefault((rr, rs), []).append((sr, ss))
    return partner


def _simulate(lists, pp, chunks, num_microbatches, forward_only):
    partner = _match_channels(lists, pp, chunks)
    calls = [dict(_calls(actions)) for actions in lists]
    pos = [0] * pp
    fwd_done, bwd_done, have_input, have_grad = set(), set(), set(), set()
    while True:
        progress = False
        for r in range(pp):
            actions = lists[r]
            if pos[r] >= len(actions):
                continue
            a = actions[pos[r]]
            if not a.is_p2p:
                key = (r, a.microbatch, a.chunk)
                if a.kind == FORWARD:
                    assert key not in fwd_done, f"rank {r} forwards {key} twice"
                    if not (r == 0 and a.chunk == 0):
                        assert key in have_input, f"rank {r} forwards {key} before receiving its input"
                    fwd_done.add(key)
                else:
                    assert key in fwd_done and key not in bwd_done, f"rank {r} backward {key} out of order"
                    if not (r == pp - 1 and a.chunk == chunks - 1):
                        assert key in have_grad, f"rank {r} backward {key} before receiving its output grad"
                    bwd_done.add(key)
                pos[r] += 1
                progress = True
                continue
            start, call = pos[r], calls[r][pos[r]]
            if all(pos[pr] >= ps for pr, ps in partner.get((r, start), [])):
                for b in call:
                    key = (r, b.microbatch, b.chunk)
                    if b.kind == SEND_FORWARD:
                        assert key in fwd_done
                    elif b.kind == SEND_BACKWARD:
                        assert key in bwd_done
                    else:
                        (have_input if b.kind == RECV_FORWARD else have_grad).add(key)
                pos[r] = start + len(call)
                progress = True
        if all(pos[r] >= len(lists[r]) for r in range(pp)):
            break
        assert progress, f"deadlock: positions {pos} of lengths {[len(x) for x in lists]}"
    expected = {(r, m, c) for r in range(pp) for m in range(num_microbatches) for c in range(chunks)}
    assert fwd_done == expected
    assert bwd_done == (set() if forward_only else expected)


def _check_per_rank_order(actions, num_microbatches, chunks, forward_only):
    seen_fwd, seen_bwd = set(), set()
    for a in actions:
        if a.kind == FORWARD:
            seen_fwd.add((a.microbatch, a.chunk))
        elif a.kind == BACKWARD:
            assert (a.microbatch, a.chunk) in seen_fwd
            seen_bwd.add((a.microbatch, a.chunk))
    forwards = [a for a in actions if a.kind == FORWARD]
    backwards = [a for a in actions if a.kind == BACKWARD]
    assert len(forwards) == num_microbatches * chunks == len(seen_fwd)
    assert len(backwards) == (0 if forward_only else num_microbatches * chunks) == len(seen_bwd)


def _cases():
    for pp, vp, m in itertools.product(range(1, 9), range(1, 5), (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)):
        if pp == 1 and vp > 1:
            continue
        groups = [None] if vp == 1 else sorted({pp, pp + 1, m})
        for group in groups:
            yield pp, vp, m, group


def test_all_schedules_are_complete_ordered_and_deadlock_free():
    checked = rejected = 0
    for pp, vp, m, group in _cases():
        for forward_only in (False, True):
            vp_arg = None if vp == 1 else vp
            try:
                lists = [get_schedule(pp, vp_arg, m, r, group, forward_only) for r in range(pp)]
            except ValueError as err:
                g = group or pp
                assert vp > 1 and (g < pp or g > m or (m % g and m % g < pp)), (pp, vp, m, group, err)
                rejected += 1
                continue
            for actions in lists:
                _check_per_rank_order(actions, m, vp, forward_only)
            _simulate(lists, pp, vp, m, forward_only)
            checked += 1
    assert checked > 400 and rejected > 50, (checked, rejected)


def test_1f1b_order_matches_megatron():
    order = _compute_order(one_f_one_b_schedule(4, 0, 6))
    assert [f"{k}{m}" for k, m, _ in order] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    last = _compute_order(one_f_one_b_schedule(4, 3, 3))
    assert [f"{k}{m}" for k, m, _ in last] == "F0 B0 F1 B1 F2 B2".split()
    mid = one_f_one_b_schedule(3, 1, 4)
    steady_call = [a for a in mid if a.is_p2p and a.kind == RECV_BACKWARD][0]
    partners = [a.kind for a in mid if a.is_p2p and a.batch == steady_call.batch]
    assert sorted(partners) == [RECV_BACKWARD, SEND_FORWARD]
    few = _compute_order(one_f_one_b_schedule(8, 0, 3))
    assert [f"{k}{m}" for k, m, _ in few] == "F0 F1 F2 B0 B1 B2".split()
    assert not any(a.is_p2p and a.kind in (RECV_FORWARD, SEND_BACKWARD) for a in one_f_one_b_schedule(4, 0, 5))
    assert not any(a.is_p2p and a.kind in (SEND_FORWARD, RECV_BACKWARD) for a in one_f_one_b_schedule(4, 3, 5))


def test_schedule_table_and_interleaved_order():
    table = get_schedule_table(5, 2, 3)
    assert [m for m, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert get_schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert num_warmup_microbatches_interleaved(4, 0, 8, 2, 4, False) == 10
    assert num_warmup_microbatches_interleaved(4, 3, 8, 2, 4, False) == 4
    assert num_warmup_microbatches_interleaved(4, 0, 4, 2, 4, False) == 8
    assert num_warmup_microbatches_interleaved(2, 0, 4, 2, 2, True) == 8
    order = _compute_order(interleaved_schedule(2, 2, 4, 0))
    forwards = [(m, c) for k, m, c in order if k == "F"]
    assert forwards == get_schedule_table(4, 2, 2)
    backwards = [(m, c) for k, m, c in order if k == "B"]
    assert backwards == [(m, 1 - c) for m, c in get_schedule_table(4, 2, 2)]
    first_b = next(i for i, x in enumerate(order) if x[0] == "B")
    assert first_b == num_warmup_microbatches_interleaved(2, 0, 4, 2, 2, False) + 1


def test_interleaved_constraints_raise_naming_the_flag():
    with pytest.raises(ValueError, match="--microbatch-group-size-per-virtual-pipeline-stage") as err:
        validate_interleaved_sizes(4, 6, 4)
    assert "--global-batch-size" in str(err.value) and "6" in str(err.value)
    with pytest.raises(ValueError, match=r"\(2\) must be >= --pipeline-model-parallel-size \(4\)"):
        validate_interleaved_sizes(4, 8, 2)
    with pytest.raises(ValueError, match=r"must be <= the number of microbatches \(3\)"):
        interleaved_schedule(2, 2, 3, 0, microbatch_group_size_per_vp_stage=4)
    validate_interleaved_sizes(2, 7, 4)
    validate_interleaved_sizes(4, 8, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        one_f_one_b_schedule(2, 0, 0)


def test_convert_schedule_table_to_order_and_rank_microbatches():
    order = convert_schedule_table_to_order(5, 2, get_schedule_table(5, 2, 3))
    assert order == [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    parallel_state.set_pipeline_model_parallel_world_size(4)
    parallel_state.set_pipeline_model_parallel_rank(1)
    assert get_pp_rank_microbatches(8, 1, None) == (8, False, 2, 6)
    assert get_pp_rank_microbatches(8, 1, None, forward_only=True) == (8, True, 8, 0)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    assert get_pp_rank_microbatches(8, 2, 4) == (16, False, 8, 8)
    assert get_pp_rank_microbatches(4, 2, 4) == (8, True, 8, 0)
    parallel_state.destroy_model_parallel()
