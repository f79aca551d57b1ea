"""Pipeline point-to-point communication: the only module that sends or receives between stages.

Activations travel forward (to the next stage) and gradients backward (to the previous stage);
stages form a ring so that, with a virtual pipeline, the last stage feeds stage 0's next chunk.
Tensors are `[s/cp (/tp with sequence parallel), b, h]` in `config.pipeline_dtype`.

Op order (why): two ranks may exchange several messages in one call (with PP=2 the next and the
previous rank are the same peer). Every call therefore issues activation ops before gradient ops
on both sides and tags them by direction, so messages pair up in the same order on gloo (which
honours tags) and on NCCL (which matches same-peer ops in issue order). With
`batch_p2p_comm=False` the ops are issued one by one in Megatron's even/odd rank order.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_torch_device_type

Shape = Union[List[int], torch.Size, Tuple[int, ...]]

_TAG_FORWARD = 0
_TAG_BACKWARD = 1
_TAG_FORWARD_SHAPE = 2
_TAG_BACKWARD_SHAPE = 3


def _device() -> torch.device:
    if get_torch_device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class P2PCommunicator:
    """Send/receive between neighbouring stages of one pipeline-parallel group."""

    def __init__(self, pp_group, config):
        self.pp_group = pp_group
        self.config = config
        ranks = dist.get_process_group_ranks(pp_group)
        self.pp_rank = dist.get_rank(group=pp_group)
        self.pp_size = len(ranks)
        self.next_rank = ranks[(self.pp_rank + 1) % self.pp_size]
        self.prev_rank = ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_pp_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def _empty(self, shape: Optional[Shape]) -> torch.Tensor:
        if shape is None:
            raise ValueError("tensor_shape must be given to receive a pipeline tensor (or set variable_seq_lengths)")
        dtype = self.config.pipeline_dtype
        if dtype is None:
            raise ValueError("pipeline_dtype is None: set it (usually to params_dtype) when pipeline_model_parallel_size > 1")
        return torch.empty(tuple(shape), requires_grad=True, device=_device(), dtype=dtype)

    def _sendable(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Contiguous, in pipeline_dtype: the receiver allocates exactly that (gloo aborts on a size mismatch)."""
        if tensor is None:
            return None
        dtype = self.config.pipeline_dtype or tensor.dtype
        return tensor.detach().to(dtype).contiguous()

    def _ops(self, send_next, recv_prev, send_prev, recv_next, tags) -> List[dist.P2POp]:
        """P2POps in a fixed order: activations (send next, recv prev) before gradients."""
        tag_f, tag_b = tags
        candidates = [
            (dist.isend, send_next, self.next_rank, tag_f),
            (dist.irecv, recv_prev, self.prev_rank, tag_f),
            (dist.isend, send_prev, self.prev_rank, tag_b),
            (dist.irecv, recv_next, self.next_rank, tag_b),
        ]
        if not self.config.batch_p2p_comm and self.pp_rank % 2 == 1:
            candidates = [candidates[1], candidates[0], candidates[3], candidates[2]]
        return [dist.P2POp(op, t, peer, self.pp_group, tag) for op, t, peer, tag in candidates if t is not None]

    def _run(self, ops: List[dist.P2POp], wait: bool) -> list:
        if not ops:
            return []
        if self.config.batch_p2p_comm:
            reqs = dist.batch_isend_irecv(ops)
        else:
            reqs = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        if wait:
            for req in reqs:
                req.wait()
            reqs = []
            if self.config.batch_p2p_comm and self.config.batch_p2p_sync and _device().type == "cuda":
                torch.cuda.synchronize()
        return reqs

    def _communicate_shapes(self, send_next, send_prev, recv_prev, recv_next):
        """Exchange the 3-d shapes of the tensors about to be sent (variable sequence lengths)."""
        device = _device()

        def shape_of(t):
            return None if t is None else torch.tensor(list(t.size()), dtype=torch.int64, device=device)

        recv_prev_shape = torch.empty(3, dtype=torch.int64, device=device) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64, device=device) if recv_next else None
        ops = self._ops(
            shape_of(send_next), recv_prev_shape, shape_of(send_prev), recv_next_shape,
            (_TAG_FORWARD_SHAPE, _TAG_BACKWARD_SHAPE),
        )
        self._run(ops, wait=True)
        return (
            None if recv_prev_shape is None else recv_prev_shape.tolist(),
            None if recv_next_shape is None else recv_next_shape.tolist(),
        )

    def communicate(
        self,
        *,
        tensor_send_next: Optional[torch.Tensor],
        tensor_send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Optional[Shape],
        recv_next_shape: Optional[Shape] = None,
        wait_on_reqs: bool = True,
    ):
        """One (batched) exchange with both neighbours; returns (recv from prev, recv from next, reqs).

        `recv_next_shape` defaults to `tensor_shape`; the executor passes it when the gradient
        received from the next stage has a different shape (adjust_tensor_shapes_fn).
        """
        prev_shape = tensor_shape
        next_shape = tensor_shape if recv_next_shape is None else recv_next_shape
        if self.config.variable_seq_lengths:
            prev_shape, next_shape = self._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        tensor_recv_prev = self._empty(prev_shape) if recv_prev else None
        tensor_recv_next = self._empty(next_shape) if recv_next else None
        tensor_send_next = self._sendable(tensor_send_next)
        tensor_send_prev = self._sendable(tensor_send_prev)
        ops = self._ops(
            tensor_send_next, tensor_recv_prev, tensor_send_prev, tensor_recv_next, (_TAG_FORWARD, _TAG_BACKWARD)
        )
        reqs = self._run(ops, wait=wait_on_reqs)
        return tensor_recv_prev, tensor_recv_next, reqs

    def recv_forward(self, tensor_shape: Shape, is_first_stage: Optional[bool] = None):
        """Receive the input activation from the previous stage (None on the first stage)."""
        if self.is_pp_first_stage if is_first_stage is None else is_first_stage:
            return None
        return self._timed("forward-recv", tensor_send_next=None, tensor_send_prev=None,
                           recv_prev=True, recv_next=False, tensor_shape=tensor_shape)[0]

    def recv_backward(self, tensor_shape: Shape, is_last_stage: Optional[bool] = None):
        """Receive the output gradient from the next stage (None on the last stage)."""
        if self.is_pp_last_stage if is_last_stage is None else is_last_stage:
            return None
        return self._timed("backward-recv", tensor_send_next=None, tensor_send_prev=None,
                           recv_prev=False, recv_next=True, tensor_shape=tensor_shape)[1]

    def send_forward(self, output_tensor, is_last_stage: Optional[bool] = None) -> None:
        """Send the output activation to the next stage (nothing on the last stage)."""
        if not (self.is_pp_last_stage if is_last_stage is None else is_last_stage):
            self._timed("forward-send", tensor_send_next=output_tensor, tensor_send_prev=None,
                        recv_prev=False, recv_next=False, tensor_shape=None)

    def send_backward(self, input_tensor_grad, is_first_stage: Optional[bool] = None) -> None:
        """Send the input gradient to the previous stage (nothing on the first stage)."""
        if not (self.is_pp_first_stage if is_first_stage is None else is_first_stage):
            self._timed("backward-send", tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                        recv_prev=False, recv_next=False, tensor_shape=None)

    def send_forward_recv_backward(self, output_tensor, tensor_shape, is_last_stage: Optional[bool] = None):
        """Batched: send the activation to the next stage, receive its output gradient."""
        if self.is_pp_last_stage if is_last_stage is None else is_last_stage:
            return None
        return self._timed("forward-send-backward-recv", tensor_send_next=output_tensor, tensor_send_prev=None,
                           recv_prev=False, recv_next=True, tensor_shape=tensor_shape)[1]

    def send_backward_recv_forward(self, input_tensor_grad, tensor_shape, is_first_stage: Optional[bool] = None):
        """Batched: send the input gradient to the previous stage, receive the next input activation."""
        if self.is_pp_first_stage if is_first_stage is None else is_first_stage:
            return None
        return self._timed("backward-send-forward-recv", tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                           recv_prev=True, recv_next=False, tensor_shape=tensor_shape)[0]

    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape, overlap_p2p_comm=False):
        """Batched: send an activation forward and receive one from the previous stage."""
        recv, _, reqs = self._timed("forward-send-forward-recv", tensor_send_next=output_tensor,
                                    tensor_send_prev=None, recv_prev=recv_prev, recv_next=False,
                                    tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm)
        return (recv, reqs) if overlap_p2p_comm else recv

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape, overlap_p2p_comm=False):
        """Batched: send a gradient backward and receive one from the next stage."""
        _, recv, reqs = self._timed("backward-send-backward-recv", tensor_send_next=None,
                                    tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=recv_next,
                                    tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm)
        return (recv, reqs) if overlap_p2p_comm else recv

    def send_forward_backward_recv_forward_backward(
        self, output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape
    ):
        """Batched: send an activation forward and a gradient backward, receive both."""
        recv_p, recv_n, _ = self._timed("forward-backward-send-forward-backward-recv",
                                        tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                                        recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape)
        return recv_p, recv_n

    def _timed(self, name: str, **kwargs):
        timers = self.config.timers
        if timers is not None:
            timers(name, log_level=2).start()
        result = self.communicate(**kwargs)
        if timers is not None:
            timers(name).stop()
        return result


def _communicator(config) -> P2PCommunicator:
    """A communicator over parallel_state's pipeline group (cheap: reads ranks only)."""
    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)


def _first(is_first_stage):
    return parallel_state.is_pipeline_first_stage() if is_first_stage is None else is_first_stage


def _last(is_last_stage):
    return parallel_state.is_pipeline_last_stage() if is_last_stage is None else is_last_stage


def recv_forward(tensor_shape: Shape, config, is_first_stage: Optional[bool] = None):
    """Receive the input activation from the previous pipeline stage (None on the first stage)."""
    if _first(is_first_stage):
        return None
    return _communicator(config).recv_forward(tensor_shape, False)


def recv_backward(tensor_shape: Shape, config, is_last_stage: Optional[bool] = None):
    """Receive the output gradient from the next pipeline stage (None on the last stage)."""
    if _last(is_last_stage):
        return None
    return _communicator(config).recv_backward(tensor_shape, False)


def send_forward(output_tensor: torch.Tensor, config, is_last_stage: Optional[bool] = None) -> None:
    """Send the output activation to the next pipeline stage (nothing on the last stage)."""
    if not _last(is_last_stage):
        _communicator(config).send_forward(output_tensor, False)


def send_backward(input_tensor_grad: torch.Tensor, config, is_first_stage: Optional[bool] = None) -> None:
    """Send the input gradient to the previous pipeline stage (nothing on the first stage)."""
    if not _first(is_first_stage):
        _communicator(config).send_backward(input_tensor_grad, False)


def send_forward_recv_backward(output_tensor, tensor_shape: Shape, config, is_last_stage: Optional[bool] = None):
    """Batched send of the activation to the next stage and receive of its output gradient."""
    if _last(is_last_stage):
        return None
    return _communicator(config).send_forward_recv_backward(output_tensor, tensor_shape, False)


def send_backward_recv_forward(input_tensor_grad, tensor_shape: Shape, config, is_first_stage: Optional[bool] = None):
    """Batched send of the input gradient to the previous stage and receive of the next activation."""
    if _first(is_first_stage):
        return None
    return _communicator(config).send_backward_recv_forward(input_tensor_grad, tensor_shape, False)


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape: Shape, config, overlap_p2p_comm=False):
    """Batched send of an activation forward and receive of one from the previous stage."""
    return _communicator(config).send_forward_recv_forward(output_tensor, recv_prev, tensor_shape, overlap_p2p_comm)


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape: Shape, config, overlap_p2p_comm=False):
    """Batched send of a gradient backward and receive of one from the next stage."""
    return _communicator(config).send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm)


def send_forward_backward_recv_forward_backward(
    output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape: Shape, config
):
    """Batched send of an activation forward and a gradient backward, with both receives."""
    return _communicator(config).send_forward_backward_recv_forward_backward(
        output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape
    )


def exchange(
    communicator: P2PCommunicator,
    sends_next: Sequence[Optional[torch.Tensor]],
    sends_prev: Sequence[Optional[torch.Tensor]],
    recv_prev_shapes: Sequence[Optional[Shape]],
    recv_next_shapes: Sequence[Optional[Shape]],
):
    """One batched call per tensor slot (Megatron's list-of-shapes wrappers); used by the executor.

    Slot `i` sends `sends_next[i]` / `sends_prev[i]` and receives with shapes `recv_*_shapes[i]`
    (a None shape means no receive in that direction). Returns (received from prev, from next).
    """
    slots = max(len(sends_next), len(sends_prev), len(recv_prev_shapes), len(recv_next_shapes))

    def at(seq, i):
        return seq[i] if i < len(seq) else None

    from_prev, from_next = [], []
    for i in range(slots):
        prev_shape, next_shape = at(recv_prev_shapes, i), at(recv_next_shapes, i)
        got_prev, got_next, _ = communicator.communicate(
            tensor_send_next=at(sends_next, i),
            tensor_send_prev=at(sends_prev, i),
            recv_prev=prev_shape is not None,
            recv_next=next_shape is not None,
            tensor_shape=prev_shape,
            recv_next_shape=next_shape,
        )
        from_prev.append(got_prev)
        from_next.append(got_next)
    return from_prev, from_next


# Inference (`megatron.core.inference`): one forward at a time, no gradients, activations in the dtype the
# wrapper names (no TransformerConfig at hand), and the last stage's logits shared with every stage.


@dataclass
class _InferenceP2PConfig:
    """The fields of a model config that `P2PCommunicator` reads, for inference forwards."""

    pipeline_dtype: torch.dtype
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = False
    variable_seq_lengths: bool = False
    timers: Optional[object] = None


def _inference_communicator(pp_group, dtype: torch.dtype) -> P2PCommunicator:
    return P2PCommunicator(pp_group, _InferenceP2PConfig(dtype))


def recv_from_prev_pipeline_rank(tensor_shape: Shape, dtype: torch.dtype, pp_group) -> torch.Tensor:
    """An inference forward's input activation [s, b, h] from the previous stage (not on the first stage)."""
    return _inference_communicator(pp_group, dtype).recv_forward(tensor_shape, is_first_stage=False).detach()


def send_to_next_pipeline_rank(tensor: torch.Tensor, pp_group) -> None:
    """An inference forward's output activation [s, b, h] to the next stage (not on the last stage)."""
    _inference_communicator(pp_group, tensor.dtype).send_forward(tensor, is_last_stage=False)


def broadcast_from_last_pipeline_stage(tensor_shape: Shape, dtype: torch.dtype, pp_group,
                                       tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The last stage's `tensor` (logits or sampled tokens) on every stage of `pp_group`.

    The last stage passes `tensor` (sent as `dtype`, and returned as sent, so every stage holds the same
    values); the other stages' `tensor` is ignored (None will do): they receive a new one of `tensor_shape`."""
    ranks = dist.get_process_group_ranks(pp_group)
    is_last = dist.get_rank(group=pp_group) == len(ranks) - 1
    if is_last:
        if tensor is None:
            raise ValueError("broadcast_from_last_pipeline_stage: the last stage must pass the tensor")
        tensor = tensor.detach().to(dtype).contiguous()
        if tuple(tensor.shape) != tuple(tensor_shape):
            raise ValueError(f"broadcast_from_last_pipeline_stage: tensor shape {tuple(tensor.shape)} differs from "
                             f"the shape the other stages expect, {tuple(tensor_shape)}")
    else:
        tensor = torch.empty(tuple(tensor_shape), dtype=dtype, device=_device())
    if len(ranks) > 1:
        dist.broadcast(tensor, ranks[-1], group=pp_group)
    return tensor
