"""RankGenerator and the pure layout helpers, checked against brute-force enumeration (no processes)."""
import itertools

import pytest

from megatron.core.rank_generator import (
    RankGenerator,
    build_rank_generators,
    check_parallel_sizes,
    generate_masked_orthogonal_rank_groups,
    hierarchical_context_parallel_rank_lists,
    intra_distributed_optimizer_instance_rank_lists,
    partial_data_parallel_rank_lists,
)


def brute_force_groups(sizes, order, token):
    """Enumerate every rank's coordinates (first token of `order` fastest) and group by the others."""
    names = order.split("-")
    wanted = set(token.split("-"))
    groups = {}
    ranges = [range(sizes[n]) for n in reversed(names)]
    for coords_rev in itertools.product(*ranges):
        coords = dict(zip(reversed(names), coords_rev))
        rank, stride = 0, 1
        for name in names:
            rank += coords[name] * stride
            stride *= sizes[name]
        key = tuple(coords[n] for n in names if n not in wanted)
        groups.setdefault(key, []).append(rank)
    return sorted(sorted(g) for g in groups.values())


TOKENS = ["tp", "pp", "dp", "cp", "ep", "tp-pp", "dp-cp", "tp-dp", "tp-cp", "tp-dp-cp", "tp-ep", "tp-ep-pp",
          "cp-dp", "pp-tp"]

LAYOUTS = [
    # (tp, ep, dp, pp, cp)
    (1, 1, 1, 1, 1),
    (2, 1, 2, 2, 1),
    (2, 1, 1, 4, 2),
    (4, 1, 3, 2, 1),
    (8, 1, 8, 8, 2),  # world 1024
    (4, 8, 4, 8, 1),  # expert layout, world 1024
    (2, 4, 2, 2, 1),
    (1, 2, 3, 1, 1),
]


ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-cp-pp-ep-dp", "tp-ep-dp-pp", "dp-tp-pp-cp-ep",
          "pp-dp-tp", "cp-tp-dp-pp-ep", "TP-CP-EP-DP-PP"]


def _completed(order, sizes):
    """Megatron's completion of an order: size-1 dimensions it leaves out are appended (tp pp dp ep cp)."""
    names = order.lower().split("-")
    return "-".join(names + [n for n in ("tp", "pp", "dp", "ep", "cp") if n not in names])


@pytest.mark.parametrize("order", ORDERS)
def test_rank_generator_matches_brute_force(order):
    """Megatron's RankGenerator accepts any arrangement of the five names (first one fastest); a name
    of size 1 may be omitted (appended at the end), one of size > 1 may not (Megatron raises)."""
    for tp, ep, dp, pp, cp in LAYOUTS:
        sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        missing = [n for n in sizes if n not in order.lower().split("-") and sizes[n] > 1]
        if missing:
            with pytest.raises(ValueError, match=f"lacks '{missing[0]}'"):
                RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
            continue
        gen = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
        full = _completed(order, sizes)
        assert gen.order == full
        assert gen.world_size == tp * ep * dp * pp * cp
        for token in TOKENS:
            got = gen.get_ranks(token)
            assert got == brute_force_groups(sizes, full, token), (order, tp, ep, dp, pp, cp, token)
            assert all(len(g) == _prod(sizes[n] for n in token.split("-")) for g in got)
            assert sorted(r for g in got for r in g) == list(range(gen.world_size))


def test_orders_place_dimensions_as_written():
    """A few groups written out by hand: the first name varies fastest, whatever the names are."""
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="pp-dp-tp")
    assert gen.get_ranks("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    expert = RankGenerator(tp=1, ep=2, dp=2, pp=2, cp=1, order="tp-ep-dp-pp")
    assert expert.get_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    middle = RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="tp-pp-ep-dp")
    assert middle.get_ranks("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_build_rank_generators_applies_megatron_rules():
    """initialize_model_parallel's two generators: dense (ep=1) and expert (cp=1) on one order; Megatron
    asserts that their PP groups are equal and, for an order not ending in pp, that EDP equals DP."""
    dense, expert = build_rank_generators(8, tp=2, pp=2, cp=1, ep=2, etp=1, order="tp-cp-ep-dp-pp")
    assert (dense.dp, expert.dp) == (2, 2) and dense.get_ranks("pp") == expert.get_ranks("pp")
    dense, expert = build_rank_generators(16, tp=2, pp=2, cp=2, ep=2, etp=2, order="tp-pp-cp-ep-dp")
    assert (dense.dp, expert.dp) == (2, 2)
    assert dense.get_ranks("pp") == expert.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                                               [12, 14], [13, 15]]
    # cp between tp and pp moves the dense pipeline stride but not the expert one (cp = 1 there).
    with pytest.raises(ValueError, match="pipeline groups must equal"):
        build_rank_generators(16, tp=2, pp=2, cp=2, ep=2, etp=2, order="tp-cp-pp-ep-dp")
    # tp-pp-dp mapping with EP: expert DP 1 != DP 2 (Megatron's pp-last assertion).
    with pytest.raises(ValueError, match="does not end in 'pp'"):
        build_rank_generators(8, tp=1, pp=4, cp=1, ep=2, etp=1, order="tp-cp-ep-pp-dp")
    # EDP equals DP, but ETP=1 changes the expert pipeline stride: the PP groups differ.
    with pytest.raises(ValueError, match="pipeline groups must equal"):
        build_rank_generators(8, tp=2, pp=2, cp=1, ep=2, etp=1, order="tp-pp-ep-dp-cp")
    with pytest.raises(ValueError, match=r"expert layout: .*lacks 'ep'"):
        build_rank_generators(8, tp=2, pp=1, cp=1, ep=2, etp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match=r"dense layout: .*lacks 'cp'"):
        build_rank_generators(8, tp=2, pp=1, cp=2, ep=1, etp=2, order="tp-dp-pp")


def test_intra_distributed_optimizer_instance_lists_concatenate_expert_groups():
    """Megatron walks the expert tp-ep-pp groups in order and closes an instance every EDP/N groups."""
    expert = RankGenerator(tp=1, ep=1, dp=4, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert expert.get_ranks("tp-ep-pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert intra_distributed_optimizer_instance_rank_lists(expert, 2) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert intra_distributed_optimizer_instance_rank_lists(expert, 1) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    wide = RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert intra_distributed_optimizer_instance_rank_lists(wide, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def test_rank_generator_known_megatron_example_and_offset():
    # Megatron's docstring example: 16 ranks, TP=2, PP=4 -> DP=2.
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert gen.coordinates(13) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 3}
    shifted = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp", rank_offset=4)
    assert shifted.get_ranks("dp") == [[4, 6], [5, 7]]
    # tp-pp-dp mapping: pp varies before dp.
    alt = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert alt.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert alt.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_generator_rejects_bad_input():
    with pytest.raises(ValueError, match="cannot both be > 1"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(ValueError, match="lacks 'pp'"):
        RankGenerator(tp=1, ep=1, dp=1, pp=2, cp=1, order="tp-dp")
    with pytest.raises(ValueError):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-xx")
    gen = RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-dp")
    assert gen.get_ranks("pp") == [[0], [1]]  # size-1 dimensions are appended to the order
    with pytest.raises(ValueError):
        generate_masked_orthogonal_rank_groups(8, [2, 2], [True, False])


def test_generate_masked_orthogonal_rank_groups_examples():
    assert generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [True, False, False]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False, True, False]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [True, False, True]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False] * 3) == [[r] for r in range(8)]


def test_check_parallel_sizes_collects_every_problem():
    assert check_parallel_sizes(16, 2, 2, 2, 1, 2, 1, 0, 0, "tp-cp-ep-dp-pp") == 2
    with pytest.raises(ValueError) as err:
        check_parallel_sizes(8, 0, 1, 1, 1, 1, 1, 2, 0, "pp-xx-pp")
    text = str(err.value)
    assert "tensor_model_parallel_size (0)" in text and "encoder" in text and "'pp-xx-pp'" in text
    assert "unknown: ['xx']" in text and "repeated: ['pp']" in text
    assert check_parallel_sizes(8, 2, 2, 1, 1, 2, 1, 0, 0, "pp-dp") == 2  # any spelling of the names
    with pytest.raises(ValueError, match=r"world size \(6\) must be divisible"):
        check_parallel_sizes(6, 4, 1, 1, 1, 4, 1, 0, 0, "tp-cp-ep-dp-pp")
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances"):
        check_parallel_sizes(8, 2, 1, 1, 1, 2, 3, 0, 0, "tp-cp-ep-dp-pp")


def test_partial_dp_and_hierarchical_cp_lists():
    intra, inter = partial_data_parallel_rank_lists([[0, 2, 4, 6], [1, 3, 5, 7]], 2)
    assert intra == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert inter == [[0, 4], [2, 6], [1, 5], [3, 7]]
    levels = hierarchical_context_parallel_rank_lists([[0, 1, 2, 3], [4, 5, 6, 7]], [2, 2])
    assert levels[0] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert levels[1] == [[0, 2], [1, 3], [4, 6], [5, 7]]
