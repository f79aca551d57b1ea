"""Cross-entropy over vocabulary-parallel logits (each TP rank holds a `V/tp` slice of the last dim).

Memory note: the forward keeps exactly one fp32 `[s, b, V/tp]` tensor (the softmax, computed in
place from the shifted logits) and the backward turns that same tensor into the gradient in place.

Label smoothing follows Megatron's formula: with K the vocabulary size and eps the smoothing,
`smoothing = eps * K / (K - 1)` and `loss = (1 - smoothing) * nll - smoothing * mean_k(log p_k)`.
The mean runs over the full vocabulary (all TP ranks), so the loss does not depend on the TP size.
"""
import torch

from megatron.core.process_groups_config import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
from megatron.core.tensor_parallel.mappings import ReduceOp, all_reduce_tensor
from megatron.core.tensor_parallel.utils import VocabUtility


class VocabParallelCrossEntropy:
    """The steps of the vocab-parallel cross-entropy, usable by fused implementations."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor):
        """fp32 logits (a new tensor) and their max over the local vocabulary slice."""
        logits = vocab_parallel_logits.float()
        if logits is vocab_parallel_logits:
            logits = logits.clone()
        return logits, torch.max(logits, dim=-1)[0]

    @staticmethod
    def calculate_predicted_logits(vocab_parallel_logits, target, logits_max, vocab_start_index, vocab_end_index):
        """Shift logits by the global max (in place) and pick each target's logit if this rank owns it.

        Returns (target_mask, masked_target_1d, predicted_logits, sum_shifted_logits, exp_logits): the
        exp of the shifted logits is written into `vocab_parallel_logits` in place.
        """
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        partition_vocab_size = vocab_parallel_logits.size(-1)
        # [s, b, V/tp] -> [s*b, V/tp]
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        # [s, b] -> [s*b]
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(0, logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().view_as(target)
        predicted_logits[target_mask] = 0.0
        sum_shifted_logits = vocab_parallel_logits.sum(dim=-1)
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        return target_mask, masked_target_1d, predicted_logits, sum_shifted_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(exp_logits, predicted_logits, sum_exp_logits):
        """Loss `log(sum exp) - predicted`; `exp_logits` becomes the softmax in place."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        return exp_logits, loss

    @staticmethod
    def prepare_gradient_calculation(softmax, target_mask, masked_target_1d):
        """Views used by the backward: the softmax as [s*b, V/tp] (modified in place), row indices, 1 - mask."""
        grad_input = softmax
        # [s, b, V/tp] -> [s*b, V/tp]
        grad_2d = grad_input.view(-1, softmax.size(-1))
        arange_1d = torch.arange(0, grad_2d.size(0), device=grad_2d.device)
        # [s, b] -> [s*b]
        softmax_update = 1.0 - target_mask.view(-1).float()
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def calculate_gradients(grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output):
        """d loss / d logits = softmax - onehot, scaled by the incoming per-token gradient."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
        all_reduce_tensor(logits_max, group, op=ReduceOp.MAX)
        partition_vocab_size = logits.size(-1)
        world_size = get_pg_size(group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, get_pg_rank(group), world_size
        )
        target_mask, masked_target_1d, predicted_logits, sum_shifted, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, vocab_start, vocab_end)
        )
        sum_exp_logits = exp_logits.sum(dim=-1)
        # One all-reduce for the three per-token sums: [3, s, b].
        sums = torch.stack([predicted_logits, sum_exp_logits, sum_shifted])
        all_reduce_tensor(sums, group)
        predicted_logits, sum_exp_logits, sum_shifted = sums[0], sums[1], sums[2]
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits
        )
        vocab_size = partition_vocab_size * world_size
        if label_smoothing > 0:
            if not 0.0 < label_smoothing < 1.0:
                raise ValueError(f"label_smoothing ({label_smoothing}) must be in (0, 1)")
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # mean_k log p_k = mean_k (shifted_k) - log(sum exp)
            mean_log_probs = sum_shifted / vocab_size - torch.log(sum_exp_logits)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = VocabParallelCrossEntropy.prepare_gradient_calculation(
            softmax, target_mask, masked_target_1d
        )
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * softmax_update
            grad_2d -= smoothing / ctx.vocab_size
            grad_input.mul_(grad_output.unsqueeze(dim=-1))
        else:
            grad_input = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
            )
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    """Per-token cross-entropy: logits `[s, b, V/tp]` (this rank's vocab slice), target `[s, b]` -> loss `[s, b]`.

    Forward: all-reduce MAX of the logit max, then all-reduce SUM of the target logit and exp sums
    over TP; backward: local (softmax - onehot) * grad, no communication.
    """
    group = get_tensor_model_parallel_group_if_none(tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)
