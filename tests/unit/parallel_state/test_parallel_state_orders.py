"""`initialize_model_parallel(order=...)` for many orders and sizes, every rank of worlds of up to 32,
without processes: `torch.distributed` is replaced by a recorder that plays one rank at a time.

Megatron's semantics (0.13.1 `parallel_state.initialize_model_parallel`): any order its RankGenerator
accepts; the dense generator (ep=1) and the expert generator (cp=1) read the same order; every group a
rank belongs to is the set of ranks that share all its coordinates except the named ones. The expected
groups here are computed from that definition (coordinates of every rank), not from the generator.
"""
import itertools
import types

import pytest

from megatron.core import parallel_state as ps


class _FakeGroup:
    def __init__(self, ranks):
        self.ranks = list(ranks)


def _fake_dist(world_size, rank):
    """The few torch.distributed calls parallel_state makes, for rank `rank` of `world_size`."""
    created = []

    def new_group(ranks=None, **kwargs):
        group = _FakeGroup(ranks)
        created.append(group)
        return group

    def get_rank(group=None):
        return rank if group is None else group.ranks.index(rank)

    def get_world_size(group=None):
        return world_size if group is None else len(group.ranks)

    fake = types.SimpleNamespace(
        is_initialized=lambda: True, is_available=lambda: True, get_world_size=get_world_size,
        get_rank=get_rank, get_backend=lambda group=None: "gloo", new_group=new_group,
        group=types.SimpleNamespace(WORLD=_FakeGroup(range(world_size))), distributed_c10d=types.SimpleNamespace(),
    )
    return fake, created


def _coordinates(sizes, order):
    """rank -> {dim: index}; the first name of the (completed) order varies fastest."""
    names = order.lower().split("-")
    names += [n for n in ("tp", "pp", "dp", "ep", "cp") if n not in names]
    coords = {}
    for rev in itertools.product(*[range(sizes[n]) for n in reversed(names)]):
        c = dict(zip(reversed(names), rev))
        rank, stride = 0, 1
        for name in names:
            rank += c[name] * stride
            stride *= sizes[name]
        coords[rank] = c
    return coords


def _peers(coords, rank, dims):
    me = coords[rank]
    return sorted(r for r, c in coords.items() if all(c[d] == me[d] for d in c if d not in dims))


# world, tp, pp, cp, ep, etp, order, instances
LAYOUTS = [
    (8, 2, 2, 1, 1, 2, "tp-cp-ep-dp-pp", 1),
    (8, 2, 2, 1, 1, 2, "tp-cp-ep-pp-dp", 2),
    (16, 2, 2, 2, 1, 4, "tp-cp-pp-ep-dp", 2),
    (16, 2, 2, 1, 2, 1, "tp-ep-dp-pp", 2),
    (16, 1, 2, 2, 2, 1, "tp-cp-ep-dp-pp", 2),
    (32, 2, 2, 2, 4, 1, "tp-cp-ep-dp-pp", 2),
    (12, 1, 3, 1, 1, 1, "pp-tp-dp", 1),
    (16, 2, 1, 2, 1, 2, "dp-cp-tp", 2),
    (16, 2, 1, 1, 2, 2, "tp-pp-ep-dp", 1),
]


def _expected(world, tp, pp, cp, ep, etp, order, instances, rank):
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    dense = _coordinates({"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}, order)
    expert = _coordinates({"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}, order)
    groups = {name: _peers(dense, rank, set(dims)) for name, dims in (
        ("tp", ["tp"]), ("pp", ["pp"]), ("dp", ["dp"]), ("cp", ["cp"]), ("dp_cp", ["dp", "cp"]),
        ("mp", ["tp", "pp"]), ("tp_dp", ["tp", "dp"]), ("tp_dp_cp", ["tp", "dp", "cp"]), ("tp_cp", ["tp", "cp"]))}
    groups.update({name: _peers(expert, rank, set(dims)) for name, dims in (
        ("ep", ["ep"]), ("expt_tp", ["tp"]), ("tp_ep", ["tp", "ep"]), ("tp_ep_pp", ["tp", "ep", "pp"]),
        ("expt_dp", ["dp"]))})
    # Partial DP: chunks of the DP-with-CP / expert-DP lists (their members in rank order).
    for name, full in (("intra_partial_dp_cp", groups["dp_cp"]), ("intra_partial_expt_dp", groups["expt_dp"])):
        size = len(full) // instances
        groups[name] = full[full.index(rank) // size * size:][:size]
    size = edp // instances
    if instances > 1:
        groups["inter_partial_expt_dp"] = groups["expt_dp"][groups["expt_dp"].index(rank) % size::size]
    # One instance = the ranks whose expert-DP index falls in my chunk, ordered by (EDP index, rank).
    chunk = expert[rank]["dp"] // size
    members = [r for r in range(world) if expert[r]["dp"] // size == chunk]
    groups["intra_dist_opt"] = sorted(members, key=lambda r: (expert[r]["dp"], r))
    pp_ranks = groups["pp"]
    groups["embd"] = [pp_ranks[0], pp_ranks[-1]] if pp > 1 else [pp_ranks[0]]
    groups["pos_embd"] = [pp_ranks[0]]
    return groups, dense[rank], expert[rank]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"w{layout[0]}-{layout[6]}")
def test_every_group_of_every_rank_follows_the_order(monkeypatch, layout):
    world, tp, pp, cp, ep, etp, order, instances = layout
    for rank in range(world):
        fake, created = _fake_dist(world, rank)
        monkeypatch.setattr(ps, "dist", fake)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order,
            num_distributed_optimizer_instances=instances,
        )
        groups, me, me_expert = _expected(*layout, rank)
        for name, ranks in groups.items():
            group_ranks = ps._STATE.global_ranks.get(name)
            if name in ("embd", "pos_embd") and rank not in ranks:
                assert group_ranks == [], (name, rank)
                continue
            exact = name == "intra_dist_opt"  # Megatron's member order is not sorted: compare as is
            got = group_ranks if exact else sorted(group_ranks)
            assert got == ranks, (layout, rank, name, group_ranks, ranks)
            assert ps._STATE.groups[name].ranks == group_ranks
        assert ps.get_tensor_model_parallel_rank() == me["tp"] and ps.get_pipeline_model_parallel_rank() == me["pp"]
        assert ps.get_data_parallel_rank() == me["dp"] and ps.get_context_parallel_rank() == me["cp"]
        assert ps.get_expert_model_parallel_rank() == me_expert["ep"]
        assert ps.get_expert_data_parallel_rank() == me_expert["dp"]
        if instances > 1:
            inter = ps.get_inter_distributed_optimizer_instance_group()
            assert inter.ranks == groups["inter_partial_expt_dp"]
            assert len(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True).ranks) == (
                world // (tp * pp) // instances)
        else:
            with pytest.raises(RuntimeError, match="num_distributed_optimizer_instances > 1"):
                ps.get_inter_distributed_optimizer_instance_group()
        # Every group is created on every rank, in the same order (a collective requirement).
        if rank == 0:
            reference = [g.ranks for g in created]
        assert [g.ranks for g in created] == reference
        ps.destroy_model_parallel()


def test_orders_megatron_rejects(monkeypatch):
    """Megatron raises for an order that leaves out a dimension of size > 1, for an order not ending in pp
    whose expert DP differs from DP, and for expert sizes that break the shared pipeline groups; it also
    refuses a virtual pipeline without pipeline parallelism."""
    fake, _ = _fake_dist(8, 0)
    monkeypatch.setattr(ps, "dist", fake)
    cases = [
        (dict(tensor_model_parallel_size=2, context_parallel_size=2, order="tp-dp-pp"), "lacks 'cp'"),
        (dict(pipeline_model_parallel_size=4, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp"),
         "does not end in 'pp'"),
        (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
              expert_tensor_parallel_size=1, order="tp-pp-ep-dp-cp"), "pipeline groups must equal"),
        (dict(order="tp-dp-dp-pp"), "repeated"),
        (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ps.initialize_model_parallel(**kwargs)
        assert not ps.model_parallel_is_initialized()
