"""Single-process behaviour of small Megatron Core names: module conversion helpers, LinearWithFrozenWeight,
the NCCL communicator config, dict_utils.map_reduce, validate_integrity_and_strict_load, _IndexWriter and
get_mlp_module_spec_for_backend."""
import logging

import numpy
import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core import nccl_comm_config, parallel_state
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, _IndexWriter, get_idx_path
from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor, StrictHandling
from megatron.core.dist_checkpointing.dict_utils import map_reduce
from megatron.core.dist_checkpointing.validation import validate_integrity_and_strict_load
from megatron.core.models.backends import LocalSpecProvider, TECompatibleLocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec, get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight, linear_with_frozen_weight
from megatron.core.transformer.module import conversion_helper, float16_to_fp32, fp32_to_float16, param_is_not_shared


def test_module_conversion_helpers():
    shared = torch.nn.Parameter(torch.zeros(2))
    shared.shared = True
    plain = torch.nn.Parameter(torch.zeros(2))
    assert not param_is_not_shared(shared) and param_is_not_shared(plain)
    plain.shared = False
    assert param_is_not_shared(plain)

    value = (torch.ones(2), [torch.ones(1, dtype=torch.int64), (torch.ones(3),)], {"d": torch.ones(1)}, 3)
    converted = conversion_helper(value, lambda v: v * 2 if torch.is_tensor(v) and v.is_floating_point() else v)
    assert isinstance(converted, tuple) and isinstance(converted[1], list) and isinstance(converted[1][1], tuple)
    assert converted[0].tolist() == [2.0, 2.0] and converted[1][1][0].tolist() == [2.0] * 3
    assert converted[1][0].dtype == torch.int64 and converted[3] == 3
    assert converted[2] is value[2]  # a dict is handed to the conversion whole, as in Megatron

    half = fp32_to_float16(value, lambda t: t.bfloat16())
    assert half[0].dtype == torch.bfloat16 and half[1][1][0].dtype == torch.bfloat16
    assert half[1][0].dtype == torch.int64 and half[2]["d"].dtype == torch.float32
    back = float16_to_fp32(half)
    assert back[0].dtype == torch.float32 and back[1][1][0].dtype == torch.float32
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    assert float16_to_fp32([param])[0].dtype == torch.float32


def test_linear_with_frozen_weight_single_rank():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, requires_grad=True)
    weight = torch.randn(6, 4)
    bias = torch.randn(6, requires_grad=True)
    out = LinearWithFrozenWeight.apply(x, weight, bias, False, None)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight)
    assert bias.grad is None  # Megatron's frozen linear returns no bias gradient either

    x.grad = None
    out = linear_with_frozen_weight(x, weight, None, True, False, False)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight)
    with pytest.raises(ValueError, match="grad_output_buffer"):
        linear_with_frozen_weight(x, weight, None, True, False, False, grad_output_buffer=[])


def _nccl_yaml(tmp_path, text):
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    return str(path)


class _FakeNcclOptions:
    """Stands in for torch.distributed.ProcessGroupNCCL.Options (CPU builds of torch have no NCCL)."""

    def __init__(self, is_high_priority_stream=False):
        self.is_high_priority_stream = is_high_priority_stream
        self.config = type("Config", (), {})()


def test_nccl_communicator_config(tmp_path, monkeypatch):
    path = _nccl_yaml(tmp_path, "tp:\n  max_ctas: 8\n  net_name: IB\ndp:\n  is_high_priority_stream: true\n")
    cfgs = nccl_comm_config.load_nccl_comm_cfgs(path)
    assert cfgs == {"tp": {"max_ctas": 8, "net_name": "IB"}, "dp": {"is_high_priority_stream": True}}
    assert parallel_state.get_nccl_options("pp", cfgs) is None
    if not torch.distributed.is_nccl_available():
        assert parallel_state.get_nccl_options("tp", cfgs) is None  # read and checked, nothing to hand to gloo
    fake = type("FakeProcessGroupNCCL", (), {"Options": _FakeNcclOptions})
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", fake, raising=False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    tp = parallel_state.get_nccl_options("tp", cfgs)
    assert not tp.is_high_priority_stream and tp.config.max_ctas == 8 and tp.config.net_name == "IB"
    assert not hasattr(tp.config, "min_ctas")
    assert parallel_state.get_nccl_options("dp", cfgs).is_high_priority_stream
    nccl_comm_config.mark_high_priority_stream_groups(cfgs, ["pp"])
    assert parallel_state.get_nccl_options("pp", cfgs).is_high_priority_stream
    assert nccl_comm_config.megatron_group_name("expt_dp") == "ep_dp"
    assert nccl_comm_config.megatron_group_name("hcp_1") == "hcp"

    with pytest.raises(RuntimeError, match="net_name"):
        nccl_comm_config.load_nccl_comm_cfgs(_nccl_yaml(tmp_path, "tp:\n  net_name: ethernet\n"))
    with pytest.raises(ValueError, match="--nccl-communicator-config-path"):
        nccl_comm_config.load_nccl_comm_cfgs(_nccl_yaml(tmp_path, "- tp\n"))
    assert nccl_comm_config.load_nccl_comm_cfgs(None) == {}


def test_map_reduce():
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    assert map_reduce(words, key_fn=lambda w: w[0]) == {
        "a": ["apple", "avocado"], "b": ["banana", "blueberry"], "c": ["cherry"]}
    assert map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum) == {"a": 12, "b": 15, "c": 6}
    assert list(map_reduce([3, 1, 3, 2])) == [3, 1, 2]  # first-seen key order
    assert map_reduce([]) == {}


def _stored_checkpoint(tmp_path):
    state = {"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
             "b": ShardedTensor.from_rank_offsets("b", torch.ones(2)),
             "o": ShardedObject("obj", {"x": 1}, (1,), (0,))}
    dc.save(state, str(tmp_path))
    return dc.load_sharded_metadata(str(tmp_path))


def test_validate_integrity_and_strict_load(tmp_path, caplog):
    ckpt = _stored_checkpoint(tmp_path)
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4)),
               "new": ShardedTensor.from_rank_offsets("new", torch.zeros(3)), "plain": 5}
    local = [request["a"].without_data(), request["new"].without_data()]
    everyone = [local]

    kept, missing, unexpected = validate_integrity_and_strict_load(
        request, StrictHandling.RETURN_ALL, False, local, everyone, ckpt)
    # Megatron's naming: unexpected = requested but not stored, missing = stored but requested by nobody.
    assert unexpected == {"new"} and missing == {"b", "obj"}
    assert set(kept) == {"a", "plain"} and set(request) == {"a", "new", "plain"}

    _, missing, unexpected = validate_integrity_and_strict_load(
        request, StrictHandling.RETURN_UNEXPECTED, False, local, everyone, ckpt)
    assert unexpected == {"new"} and missing == set()
    assert validate_integrity_and_strict_load(request, "ignore_all", False, local, everyone, ckpt)[1:] == (set(), set())
    with pytest.raises(CheckpointingException, match="new"):
        validate_integrity_and_strict_load(request, StrictHandling.RAISE_UNEXPECTED, False, local, everyone, ckpt)
    with caplog.at_level(logging.WARNING):
        validate_integrity_and_strict_load(request, StrictHandling.LOG_ALL, False, None, everyone, ckpt)
    assert "new" in caplog.text and "'b'" in caplog.text
    with pytest.raises(CheckpointingException, match="ckpt_sharded_metadata=None"):
        validate_integrity_and_strict_load(request, StrictHandling.LOG_ALL, False)
    kept, missing, unexpected = validate_integrity_and_strict_load(request, StrictHandling.ASSUME_OK_UNEXPECTED, False)
    assert kept is request and missing == unexpected == set()

    half = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), (0, 0, 2))}  # covers half of "a" only
    with pytest.raises(CheckpointingException, match="cover"):
        validate_integrity_and_strict_load(half, StrictHandling.ASSUME_OK_UNEXPECTED, True,
                                           global_metadata=[[half["a"].without_data()]])


@pytest.mark.parametrize("dtype, multimodal", [(numpy.uint16, False), (numpy.int32, True)])
def test_index_writer_matches_builder(tmp_path, dtype, multimodal):
    builder = IndexedDatasetBuilder(str(tmp_path / "built.bin"), dtype=dtype, multimodal=multimodal)
    sequences = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    modes = [0, 1, 0, 2]
    for i, sequence in enumerate(sequences):
        builder.add_item(torch.tensor(sequence), mode=modes[i] if multimodal else 0)
        if i in (1, 3):
            builder.end_document()
    builder.finalize(str(tmp_path / "built.idx"))
    built = IndexedDataset(str(tmp_path / "built"), multimodal=multimodal)

    path = get_idx_path(str(tmp_path / "written"))
    with _IndexWriter(path, dtype) as writer:
        writer.write(built.sequence_lengths.tolist(), modes if multimodal else None, built.document_indices.tolist())
    assert (tmp_path / "written.idx").read_bytes() == (tmp_path / "built.idx").read_bytes()
    assert _IndexWriter(path, dtype)._sequence_pointers([3, 1, 2]) == [0, 3 * numpy.dtype(dtype).itemsize,
                                                                       4 * numpy.dtype(dtype).itemsize]


def test_get_mlp_module_spec_for_backend():
    def layout(spec):
        return spec.module, spec.submodules.linear_fc1, spec.submodules.linear_fc2

    assert layout(get_mlp_module_spec_for_backend(LocalSpecProvider())) == layout(get_mlp_module_spec(use_te=False))
    fused = get_mlp_module_spec_for_backend(TECompatibleLocalSpecProvider())
    assert fused.submodules.linear_fc1 is TECompatibleLocalSpecProvider().column_parallel_layer_norm_linear()
    assert fused.submodules.linear_fc1 is not LocalSpecProvider().column_parallel_linear()
    with pytest.raises(ValueError, match="num_experts"):
        get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=4)
    with pytest.raises(ValueError, match="use_te_op_fuser"):
        get_mlp_module_spec_for_backend(LocalSpecProvider(), use_te_op_fuser=True)
