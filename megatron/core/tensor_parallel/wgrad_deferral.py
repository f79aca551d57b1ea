"""The deferred weight-gradient GEMMs of the output layer (`--defer-embedding-wgrad-compute`).

On the last pipeline stage the output layer (`ColumnParallelLinear` with `embedding_activation_buffer` and
`grad_output_buffer`) keeps each microbatch's input and output gradient instead of computing its weight
gradient in the backward (at most `wgrad_deferral_limit` microbatches when that is non-zero; the others are
computed at once). `drain_embedding_wgrad_compute` (exported by `megatron.core.utils`, as in Megatron) computes
the kept ones at the end of the schedule, during the pipeline flush, adding them into `weight.main_grad`; with
sequence parallelism the all-gather of the next microbatch's input overlaps the current GEMM.
"""
import torch

from megatron.core.process_groups_config import get_tensor_model_parallel_group_if_none
from megatron.core.tensor_parallel.wgrad_accumulation import accumulate_wgrad_fp32_, addmm_fp32_out_supported
from megatron.core.tensor_parallel.mappings import all_gather_along_first_dim_async
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute


def _add_weight_grad(weight, grad_output, total_input) -> None:
    """weight.main_grad [out, in] += grad_output^T [out, s*b] @ input [s*b, in]."""
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("defer_embedding_wgrad_compute adds the output layer's weight gradient into "
                           "weight.main_grad: wrap the model in DistributedDataParallel (with "
                           "gradient_accumulation_fusion), as Megatron requires")
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.dtype == torch.float32 and addmm_fp32_out_supported(main_grad.device, grad_output.dtype):
        accumulate_wgrad_fp32_(main_grad, grad_output, total_input)
    else:
        main_grad.add_(torch.matmul(grad_output.t(), total_input).to(main_grad.dtype))


@torch.no_grad()
def drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group=None):
    """Compute the weight gradients kept in the two buffers (same length, emptied here) into
    `weight.main_grad`. With `config.sequence_parallel` the kept inputs are this rank's sequence shards and are
    all-gathered over `tp_group` (default: the TP group), one microbatch ahead of the GEMMs. No autograd: the
    kept inputs are forward activations, and the accumulation into main_grad must not join their graph."""
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise ValueError(f"{len(embedding_activation_buffer)} kept activations but {len(grad_output_buffer)} kept "
                         f"output gradients: the two buffers must have equal length")
    inputs, grads = list(embedding_activation_buffer), list(grad_output_buffer)
    embedding_activation_buffer.clear()
    grad_output_buffer.clear()
    if not inputs:
        return
    group = get_tensor_model_parallel_group_if_none(tp_group) if config.sequence_parallel else None

    def gather(index):
        # [s/tp, b, h] -> [s, b, h] with sequence parallelism
        return all_gather_along_first_dim_async(inputs[index], group) if group is not None else None

    pending = gather(0)
    for i, grad_output in enumerate(grads):
        total_input = pending.wait() if pending is not None else inputs[i]
        pending = gather(i + 1) if i + 1 < len(inputs) else None
        inputs[i] = None
        _add_weight_grad(weight, grad_output, total_input)
        grads[i] = None


__all__ = ["drain_embedding_wgrad_compute"]
