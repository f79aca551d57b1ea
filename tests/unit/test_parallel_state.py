"""parallel_state on 8 gloo ranks: every group/rank getter against a brute-force layout, several layouts
in one launch; plus the single-process defaults and ModelParallelConfig rules (no processes)."""
import itertools

import pytest
import torch

from tests.harness import run_on_ranks


def _layout(sizes, order):
    """rank -> {dim: index} for a layout whose first `order` token varies fastest."""
    names = order.split("-")
    coords = {}
    for rev in itertools.product(*[range(sizes[n]) for n in reversed(names)]):
        c = dict(zip(reversed(names), rev))
        rank, stride = 0, 1
        for name in names:
            rank += c[name] * stride
            stride *= sizes[name]
        coords[rank] = c
    return coords


def _group_of(coords, rank, dims):
    """Ranks that share every coordinate of `rank` except those in `dims`, in rank order."""
    me = coords[rank]
    return sorted(r for r, c in coords.items() if all(c[d] == me[d] for d in c if d not in dims))


def _ranks(group):
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group))


def _check_groups(ps, dense, expert, rank):
    """Every group getter against the layout computed independently; returns the expected groups."""
    expected = {
        "tp": _group_of(dense, rank, {"tp"}), "pp": _group_of(dense, rank, {"pp"}),
        "dp": _group_of(dense, rank, {"dp"}), "cp": _group_of(dense, rank, {"cp"}),
        "dp_cp": _group_of(dense, rank, {"dp", "cp"}), "mp": _group_of(dense, rank, {"tp", "pp"}),
        "tp_dp": _group_of(dense, rank, {"tp", "dp"}), "tp_dp_cp": _group_of(dense, rank, {"tp", "dp", "cp"}),
        "tp_cp": _group_of(dense, rank, {"tp", "cp"}), "ep": _group_of(expert, rank, {"ep"}),
        "expt_tp": _group_of(expert, rank, {"tp"}), "tp_ep": _group_of(expert, rank, {"tp", "ep"}),
        "tp_ep_pp": _group_of(expert, rank, {"tp", "ep", "pp"}), "expt_dp": _group_of(expert, rank, {"dp"}),
    }
    got = {
        "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(), "cp": ps.get_context_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True), "mp": ps.get_model_parallel_group(),
        "tp_dp": ps.get_tensor_and_data_parallel_group(),
        "tp_dp_cp": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "tp_cp": ps.get_tensor_and_context_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
        "expt_tp": ps.get_expert_tensor_parallel_group(), "tp_ep": ps.get_expert_tensor_and_model_parallel_group(),
        "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group(),
        "expt_dp": ps.get_expert_data_parallel_group(),
    }
    for name, group in got.items():
        assert _ranks(group) == expected[name], (name, _ranks(group), expected[name])
    return expected


def _check_sizes_and_ranks(ps, expected, me, expert, rank, sizes):
    """World sizes, ranks, source ranks and pipeline neighbours."""
    tp, pp, cp, dp, ep, etp, edp = sizes
    assert ps.get_tensor_model_parallel_world_size() == tp and ps.get_tensor_model_parallel_rank() == me["tp"]
    assert ps.get_pipeline_model_parallel_world_size() == pp and ps.get_pipeline_model_parallel_rank() == me["pp"]
    assert ps.get_data_parallel_world_size() == dp and ps.get_data_parallel_rank() == me["dp"]
    assert ps.get_context_parallel_world_size() == cp and ps.get_context_parallel_rank() == me["cp"]
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == dp * cp
    assert ps.get_data_parallel_rank(with_context_parallel=True) == expected["dp_cp"].index(rank)
    assert ps.get_expert_model_parallel_world_size() == ep and ps.get_expert_model_parallel_rank() == expert[rank]["ep"]
    assert ps.get_expert_tensor_parallel_world_size() == etp
    assert ps.get_expert_tensor_parallel_rank() == expert[rank]["tp"]
    assert ps.get_expert_data_parallel_world_size() == edp and ps.get_expert_data_parallel_rank() == expert[rank]["dp"]
    assert ps.get_tensor_and_context_parallel_world_size() == tp * cp
    assert ps.get_tensor_and_data_parallel_world_size(with_context_parallel=True) == tp * dp * cp
    assert ps.get_model_parallel_world_size() == tp * pp
    # src / pipeline neighbour ranks
    assert ps.get_tensor_model_parallel_src_rank() == expected["tp"][0]
    assert ps.get_data_parallel_src_rank() == expected["dp"][0]
    assert ps.get_data_parallel_src_rank(with_context_parallel=True) == expected["dp_cp"][0]
    pp_ranks = expected["pp"]
    assert ps.get_pipeline_model_parallel_first_rank() == pp_ranks[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pp_ranks[-1]
    assert ps.get_pipeline_model_parallel_next_rank() == pp_ranks[(me["pp"] + 1) % pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pp_ranks[(me["pp"] - 1) % pp]
    assert ps.get_context_parallel_global_ranks() == expected["cp"]
    assert ps.get_data_parallel_global_ranks(with_context_parallel=True) == expected["dp_cp"]


def _check_stages(ps, expected, me, rank, pp, vp):
    """Embedding groups and first/last (virtual) stage predicates."""
    pp_ranks = expected["pp"]
    embd = [pp_ranks[0], pp_ranks[-1]] if pp > 1 else [pp_ranks[0]]
    assert ps.is_rank_in_embedding_group() == (rank in embd)
    assert ps.is_rank_in_position_embedding_group() == (rank == pp_ranks[0])
    assert _ranks(ps.get_embedding_group()) == embd if rank in embd else True
    assert _ranks(ps.get_position_embedding_group()) == [pp_ranks[0]] if rank == pp_ranks[0] else True
    # stages
    assert ps.is_pipeline_first_stage() == (me["pp"] == 0)
    assert ps.is_pipeline_last_stage() == (me["pp"] == pp - 1)
    if vp:
        assert ps.get_virtual_pipeline_model_parallel_world_size() == vp
        assert ps.get_virtual_pipeline_model_parallel_rank() == 0
        assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == (me["pp"] == 0)
        assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
        assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
        assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp - 1) == (me["pp"] == pp - 1)
        ps.set_virtual_pipeline_model_parallel_rank(vp - 1)
        assert ps.is_pipeline_last_stage(ignore_virtual=False) == (me["pp"] == pp - 1)
        if rank in embd and pp > 1 and rank == pp_ranks[0]:
            assert not ps.is_rank_in_embedding_group(ignore_virtual=False)


def _check_twins_and_partial_dp(ps, expected, rank, instances, hcp):
    """amax groups, gloo twins, partial data-parallel and hierarchical context-parallel groups."""
    assert _ranks(ps.get_amax_reduction_group()) == expected["tp_dp"]
    assert _ranks(ps.get_amax_reduction_group(tp_only_amax_red=True)) == expected["tp"]
    assert _ranks(ps.get_data_parallel_group_gloo()) == expected["dp"]
    assert _ranks(ps.get_data_parallel_group_gloo(with_context_parallel=True)) == expected["dp_cp"]
    assert _ranks(ps.get_expert_data_parallel_group_gloo()) == expected["expt_dp"]
    dp_cp = expected["dp_cp"]
    size = len(dp_cp) // instances
    intra = [dp_cp[i * size:(i + 1) * size] for i in range(instances)]
    mine = next(g for g in intra if rank in g)
    assert _ranks(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)) == mine
    if instances > 1:
        assert _ranks(ps.get_inter_partial_data_parallel_group()) == sorted(dp_cp[dp_cp.index(rank) % size::size])
    if hcp:
        levels = ps.get_hierarchical_context_parallel_groups()
        assert [len(_ranks(g)) for g in levels] == list(hcp)


def _check_layout(tp, pp, cp, ep, etp, order, vp, instances, hcp):
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import GradCommProcessGroups, ModelCommProcessGroups

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order,
        num_distributed_optimizer_instances=instances, hierarchical_context_parallel_sizes=hcp,
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // (tp * pp * cp)
    dense = _layout({"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}, order)
    edp = world // (etp * ep * pp)
    expert = _layout({"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}, order)
    me = dense[rank]
    expected = _check_groups(ps, dense, expert, rank)
    _check_sizes_and_ranks(ps, expected, me, expert, rank, (tp, pp, cp, dp, ep, etp, edp))
    _check_stages(ps, expected, me, rank, pp, vp)
    _check_twins_and_partial_dp(ps, expected, rank, instances, hcp)
    # a real collective on the groups
    value = torch.tensor([float(rank)])
    torch.distributed.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    assert value.item() == sum(expected["tp"])
    value = torch.tensor([float(rank)])
    torch.distributed.all_reduce(value, group=ps.get_data_parallel_group(with_context_parallel=True))
    assert value.item() == sum(expected["dp_cp"])
    # process-group bundles
    model_pgs = ModelCommProcessGroups.use_mpu_process_groups()
    assert _ranks(model_pgs.tp) == expected["tp"] and _ranks(model_pgs.pp) == expected["pp"]
    assert _ranks(model_pgs.tp_ep_pp) == expected["tp_ep_pp"]
    grad_pgs = GradCommProcessGroups.use_mpu_process_groups(["dp", "dp_cp", "expt_dp"])
    assert _ranks(grad_pgs.dp_cp) == expected["dp_cp"]
    assert ps.model_parallel_is_initialized()
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    return True


LAYOUTS_8 = [
    # tp, pp, cp, ep, etp, order, vp, instances, hcp
    (2, 2, 1, 1, None, "tp-cp-ep-dp-pp", 2, 1, None),
    (2, 2, 1, 1, None, "tp-cp-ep-pp-dp", None, 1, None),
    (2, 1, 2, 2, 1, "tp-cp-ep-dp-pp", None, 2, None),
    (1, 1, 4, 1, None, "tp-cp-ep-dp-pp", None, 1, [2, 2]),
    (1, 4, 1, 2, 1, "tp-cp-ep-dp-pp", 2, 1, None),
]


def _misaligned_expert_layout_is_rejected():
    from megatron.core import parallel_state as ps

    # With tp-pp-dp order, EP > 1 changes the expert DP size: Megatron's pp-last assertion rejects it too.
    with pytest.raises(ValueError, match="does not end in 'pp'"):
        ps.initialize_model_parallel(pipeline_model_parallel_size=4, expert_model_parallel_size=2,
                                     order="tp-cp-ep-pp-dp")
    with pytest.raises(ValueError, match="must be divisible"):
        ps.initialize_model_parallel(tensor_model_parallel_size=3)


def _eight_rank_body():
    for tp, pp, cp, ep, etp, order, vp, instances, hcp in LAYOUTS_8:
        _check_layout(tp, pp, cp, ep, tp if etp is None else etp, order, vp, instances, hcp)
    _misaligned_expert_layout_is_rejected()
    return True


def test_parallel_state_groups_match_brute_force_layout_on_8_ranks():
    assert run_on_ranks(_eight_rank_body, 8, timeout=240) == [True] * 8


def test_parallel_state_single_process_defaults_and_setters():
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_data_parallel_world_size() == 0  # Megatron's value without torch.distributed
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(3)
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(1)
    ps.set_expert_model_parallel_world_size(2)
    assert ps.get_tensor_model_parallel_world_size() == 4 and ps.get_tensor_model_parallel_rank() == 3
    assert ps.get_expert_tensor_parallel_world_size() == 4  # falls back to the TP size
    assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    assert ps.get_expert_model_parallel_world_size() == 2
    buf = ps.get_global_memory_buffer()
    a = buf.get_tensor((2, 3), torch.float32, "x")
    b = buf.get_tensor((6,), torch.float32, "x")
    assert a.data_ptr() == b.data_ptr() and a.shape == (2, 3)
    ps.destroy_model_parallel()
    assert ps.get_tensor_model_parallel_world_size() == 1


def test_model_parallel_config_rules():
    from megatron.core.model_parallel_config import ModelParallelConfig

    cfg = ModelParallelConfig(tensor_model_parallel_size=2, params_dtype=torch.bfloat16, pipeline_model_parallel_size=4,
                              pipeline_dtype=torch.bfloat16)
    assert cfg.expert_tensor_parallel_size == 2 and cfg.autocast_dtype == torch.bfloat16
    assert cfg.microbatch_group_size_per_vp_stage == 4
    with pytest.raises(ValueError) as err:
        ModelParallelConfig(sequence_parallel=True, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                            defer_embedding_wgrad_compute=True)
    text = str(err.value)
    assert "sequence_parallel=True needs tensor_model_parallel_size > 1" in text
    assert "pipeline_dtype" in text and "gradient_accumulation_fusion" in text
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        ModelParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        ModelParallelConfig(defer_embedding_wgrad_compute=True, gradient_accumulation_fusion=True)
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    for name in ("tp_comm_overlap", "cross_entropy_fusion_impl", "barrier_with_L1_time", "cpu_offloading",
                 "finalize_model_grads_func", "use_te_rng_tracker", "overlap_p2p_comm_warmup_flush"):
        assert name in fields
