"""`peer_copy.PeerCopyTransport`: where one can exist, and the slot rule that makes reusing its symmetric
buffer safe (whether a layer uses it is the plan's `--tp-comm-overlap-transport`, tested with the plan).
The copies themselves need GPUs that map each other's memory: the NCCL parity test
(`tests/parity/test_tp_nccl_gpu.py`, copy-engine and NCCL overlap give bit-identical results) and the
CUDA-graph test cover them; the CPU parity test runs the same schedule with the data moved by gloo.
"""
import torch

from megatron.core.tensor_parallel import peer_copy
from tests.harness import run_on_ranks


class _FakeHandle:
    """Stands in for torch's symmetric-memory handle: buffers are plain tensors, barriers are counted."""

    def __init__(self):
        self.barriers = 0

    def get_buffer(self, rank, shape, dtype, offset):
        return torch.empty(shape, dtype=dtype)

    def barrier(self, channel=0, timeout_ms=0):
        self.barriers += 1


def _transport():
    transport = object.__new__(peer_copy.PeerCopyTransport)
    transport.world_size, transport.rank = 2, 0
    transport._handle, transport._slot_bytes, transport._open, transport._views = _FakeHandle(), 1 << 21, [], {}
    return transport


def test_open_operations_never_share_a_slot_and_a_third_finishes_the_oldest():
    transport = _transport()
    first = transport.begin((4, 8), torch.bfloat16)
    second = transport.begin((4, 8), torch.bfloat16)
    assert first._slot != second._slot
    assert transport._handle.barriers == 0
    third = transport.begin((4, 8), torch.bfloat16)  # both slots busy: the older operation is finished first
    assert transport._handle.barriers == 1 and first not in transport._open
    assert third._slot == first._slot and third._slot != second._slot
    second.finish()
    second.finish()  # finishing twice is one barrier
    assert transport._handle.barriers == 2
    fourth = transport.begin((4, 8), torch.bfloat16)
    assert fourth._slot != third._slot  # the finished operation's slot is the free one


def test_a_finished_operation_frees_its_slot_whatever_the_order():
    transport = _transport()
    first = transport.begin((2,), torch.float32)
    second = transport.begin((2,), torch.float32)
    second.finish()
    again = transport.begin((2,), torch.float32)
    assert again._slot == second._slot and first in transport._open


def _selection_body():
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    singles = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
    choices = {"gloo group": peer_copy.peer_copy_transport(group, torch.device("cpu")),
               "gloo group, cuda tensors": peer_copy.peer_copy_transport(group, torch.device("cuda")),
               "one rank": peer_copy.peer_copy_transport(singles[dist.get_rank()], torch.device("cuda"))}
    seeded = object()
    peer_copy._PEER_TRANSPORTS[group] = seeded
    choices["cached"] = peer_copy.peer_copy_transport(group, torch.device("cpu")) is seeded
    return choices


def test_transport_exists_only_where_it_can_work():
    for choices in run_on_ranks(_selection_body, 2, timeout=120):
        assert choices == {"gloo group": None, "gloo group, cuda tensors": None, "one rank": None, "cached": True}
