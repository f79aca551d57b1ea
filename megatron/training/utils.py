"""Helpers of the training framework: rank-aware printing, batches per TP/CP rank, norms, memory, progress.

Everything here reads the global args (`get_args`) where Megatron's versions do, so user scripts written
against `megatron.training.utils` keep working.
"""
import json
import math
import os
import resource
import sys
from datetime import datetime

import torch

from megatron.core import parallel_state as mpu
from megatron.core.context_parallel.batch import get_batch_on_this_cp_rank  # noqa: F401  (Megatron's import path)
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.fp8.params import weight_values
from megatron.core.utils import unwrap_model as _unwrap_model
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.train_step import (  # noqa: F401  Megatron's names in this module
    logical_and_across_model_parallel_group,
    reduce_max_stat_across_model_parallel_group,
)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_rank0() -> bool:
    """True on global rank 0 (and when torch.distributed is not initialized)."""
    return not _dist_ready() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    """True on the last global rank, where the training log line is printed."""
    if not _dist_ready():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_line(message) -> None:
    """Print `message` and its newline in ONE write, so lines of several ranks sharing a stream never mix."""
    sys.stdout.write(f"{message}\n")
    sys.stdout.flush()


def print_rank_0(message) -> None:
    """Print on global rank 0 only."""
    if is_rank0():
        print_line(message)


def print_rank_last(message) -> None:
    """Print on the last global rank only."""
    if is_last_rank():
        print_line(message)


def print_datetime(string: str) -> None:
    """`[string] datetime: YYYY-mm-dd HH:MM:SS` on rank 0 (after a barrier, like Megatron)."""
    if _dist_ready():
        torch.distributed.barrier()
    print_rank_0(f"[{string}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


def unwrap_model(model, module_instances=None):
    """Strip DDP / Float16Module / FSDP wrappers from a model or a list of model chunks."""
    return _unwrap_model(model, module_instances)


def _param_is_not_shared(param) -> bool:
    return not getattr(param, "shared", False)


def _param_is_not_tp_duplicate(param) -> bool:
    return getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_rank() == 0


def calc_params_l2_norm(model, force_create_fp32_copy: bool = False) -> float:
    """L2 norm of all parameters (fp32 master copies where they exist), summed over model-parallel ranks.

    Shared parameters (the tied output layer) and TP-duplicated parameters are counted once.
    """
    chunks = model if isinstance(model, list) else [model]
    total = torch.zeros(1, dtype=torch.float32, device=_device())
    for chunk in chunks:
        for param in chunk.parameters():
            if not (_param_is_not_shared(param) and _param_is_not_tp_duplicate(param)):
                continue
            main = getattr(param, "main_param", None)
            # an FP8-primary weight (`--fp8-param-gather`) holds only FP8 values: dequantized here
            data = main if main is not None and not force_create_fp32_copy else weight_values(param)
            total += data.detach().float().pow(2).sum().to(total.device)
    if _dist_ready():
        torch.distributed.all_reduce(total, group=mpu.get_model_parallel_group())
    return total.sqrt().item()


def average_losses_across_data_parallel_group(losses):
    """Mean of each loss over the data-parallel group (legacy helper kept for user scripts)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])  # n x [] -> [n]
    if _dist_ready():
        torch.distributed.all_reduce(averaged, group=mpu.get_data_parallel_group())
        averaged = averaged / torch.distributed.get_world_size(group=mpu.get_data_parallel_group())
    return averaged


def report_memory(name: str) -> None:
    """Print `[Rank r] (name) memory (MB) | allocated: .. | ...` (CPU: the peak resident set size)."""
    mega = 1024.0 * 1024.0
    if torch.cuda.is_available():
        string = name + " memory (MB)"
        string += " | allocated: {}".format(torch.cuda.memory_allocated() / mega)
        string += " | max allocated: {}".format(torch.cuda.max_memory_allocated() / mega)
        string += " | reserved: {}".format(torch.cuda.memory_reserved() / mega)
        string += " | max reserved: {}".format(torch.cuda.max_memory_reserved() / mega)
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mb = peak_kb / 1024.0 if sys.platform != "darwin" else peak_kb / mega
        string = name + " memory (MB) | max resident (cpu): {:.1f}".format(peak_mb)
    if mpu.get_data_parallel_rank() == 0:
        rank = torch.distributed.get_rank() if _dist_ready() else 0
        print_line("[Rank {}] {}".format(rank, string))


def append_to_progress_log(string: str, barrier: bool = True) -> None:
    """Append a tab-separated line to `<save>/progress.txt` (rank 0)."""
    args = get_args()
    if args.save is None:
        return
    if barrier and _dist_ready():
        torch.distributed.barrier()
    if is_rank0():
        os.makedirs(args.save, exist_ok=True)
        with open(os.path.join(args.save, "progress.txt"), "a") as f:
            job_id = os.getenv("SLURM_JOB_ID", "")
            stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            f.write(f"{stamp}\tJob ID: {job_id}\t# GPUs: {args.world_size}\t{string}\n")


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss,
                                    create_attention_mask: bool = True):
    """Causal mask (True = masked), loss mask and position ids for a `[b, s]` batch of token ids."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length), device=data.device))
        attention_mask = attention_mask.view(att_mask_batch, 1, seq_length, seq_length)  # [b, s, s] -> [b, 1, s, s]
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data).clone()  # [s] -> [b, s]
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            prev_index = 0
            for i in eod_index.tolist():
                if reset_attention_mask and attention_mask is not None:
                    attention_mask[b, 0, (i + 1):, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= i + 1 - prev_index
                    prev_index = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


def _broadcast(tensor):
    if tensor is not None and mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            tensor, mpu.get_tensor_model_parallel_src_rank(), group=mpu.get_tensor_model_parallel_group()
        )


def is_first_or_last_pipeline_stage(vp_stage=None) -> bool:
    """True on the first or last (virtual) pipeline stage: the stages that read data."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return True
    ignore_virtual = mpu.get_virtual_pipeline_model_parallel_world_size() is None or vp_stage is None
    return mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage) or \
        mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def _stage_keys(args):
    """Which batch entries this pipeline stage needs (the rest are None).

    With --reset-attention-mask every stage (middle ones too: their attention layers need them) gets
    `document_ids` instead of the dense attention mask."""
    mtp = getattr(args, "mtp_num_layers", None)
    documents = {"document_ids"} if getattr(args, "reset_attention_mask", False) else set()
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"} | documents
    if mpu.is_pipeline_first_stage():
        keys = {"tokens", "attention_mask", "position_ids"}
    elif mpu.is_pipeline_last_stage():
        keys = {"labels", "loss_mask", "attention_mask"} | ({"tokens", "position_ids"} if mtp else set())
    else:
        keys = set()
    return keys | documents


def document_ids_from_tokens(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """[b, s] int32 document number of every token: the count of EOD tokens before it in its row (the EOD
    closes its document), i.e. exactly the blocks of the dataset's --reset-attention-mask mask."""
    is_eod = (tokens == eod_token).to(torch.int32)
    return torch.cumsum(is_eod, dim=1, dtype=torch.int32) - is_eod


def document_packed_seq_params(document_ids: torch.Tensor) -> PackedSeqParams:
    """Document boundaries of a [b, s] batch as `PackedSeqParams(qkv_format='sbhd')`: cumulative lengths over
    the flattened b * s tokens, every row start being a boundary. Reads the longest document length on the
    host (the varlen kernels need it): one synchronisation per micro-batch."""
    b, s = document_ids.shape
    flat = document_ids.reshape(-1)  # [b, s] -> [b*s]
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts.view(b, s)[:, 0] = True
    bounds = torch.nonzero(starts).view(-1)  # [n, 1] -> [n]
    cu = torch.cat([bounds, bounds.new_full((1,), b * s)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max().item())
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def get_batch_on_this_tp_rank(data_iterator):
    """TP rank 0 reads the next batch and broadcasts it over the TP group (§ TP batch broadcast).

    The first stage gets tokens/position_ids, the last stage labels/loss_mask; with --reset-attention-mask
    every stage also gets `document_ids` ([mbs, s] int32); entries a stage does not need are None. With TP > 1 the entries travel as one
    broadcast of one packed byte buffer (one host-to-device copy and one collective per micro-batch
    instead of one of each per entry).
    """
    args = get_args()
    device = _device()
    keys = _stage_keys(args)
    # Without --reset-attention-mask the dataloader's mask is the plain causal mask, which every causal
    # GPT layer applies by itself (SDPA's causal kernel): it is not copied to the GPU or broadcast over
    # TP ([mbs, 1, s, s] bool, 32 MB at micro-batch 8 and sequence 2048). The model sees None, as with
    # --no-create-attention-mask-in-dataloader.
    # With --reset-attention-mask the documents travel as [mbs, s] ids (from the EOD tokens) instead of the
    # [mbs, 1, s, s] mask: the attention restricts itself to documents without a dense mask.
    mbs, seq = args.micro_batch_size, args.seq_length
    shapes = {
        "tokens": ((mbs, seq), torch.int64),
        "labels": ((mbs, seq), torch.int64),
        "position_ids": ((mbs, seq), torch.int64),
        "loss_mask": ((mbs, seq), torch.float32),
        "document_ids": ((mbs, seq), torch.int32),
    }
    wanted = [key for key in shapes if key in keys]
    data = None
    if mpu.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator) if data_iterator is not None else None
        if data is None:
            raise RuntimeError("TP rank 0 has no data iterator but must read the batch for its TP group.")
        if "document_ids" in wanted:
            data = dict(data, document_ids=document_ids_from_tokens(data["tokens"], get_tokenizer().eod))
    batch = dict.fromkeys(shapes)
    batch["attention_mask"] = None
    if mpu.get_tensor_model_parallel_world_size() == 1:
        for key in wanted:
            value = data.get(key)
            batch[key] = value.to(device, non_blocking=True) if value is not None else None
        return batch
    batch.update(_broadcast_packed(data, {key: shapes[key] for key in wanted}, device))
    return batch


def _broadcast_packed(data, shapes, device):
    """TP rank 0's `data[key]` for each key of `shapes` ({key: (shape, dtype)}) on every TP rank, moved as one
    byte buffer: each entry at an 8-byte aligned offset, so every slice views back as its dtype."""
    layout, total = [], 0
    for key, (shape, dtype) in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append((key, shape, dtype, total, nbytes))
        total += -(-nbytes // 8) * 8
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    if data is not None:  # TP rank 0
        host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        for key, shape, dtype, offset, nbytes in layout:
            value = data.get(key)
            if value is None or tuple(value.shape) != tuple(shape):
                found = None if value is None else tuple(value.shape)
                raise RuntimeError(f"TP batch broadcast: the batch's {key!r} is {found}, expected shape {tuple(shape)} "
                                   f"(--micro-batch-size {shape[0]}, --seq-length {shape[-1]}).")
            # [mbs, ...] -> [nbytes] bytes
            host[offset:offset + nbytes].copy_(value.to(dtype).contiguous().view(-1).view(torch.uint8))
        packed.copy_(host, non_blocking=True)
    _broadcast(packed)
    # [nbytes] bytes -> [mbs, ...] of each entry's dtype
    return {key: packed[offset:offset + nbytes].view(dtype).view(shape)
            for key, shape, dtype, offset, nbytes in layout}


def get_gpt_batch_with_documents(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params) of this TP/CP rank.

    `packed_seq_params` holds the --reset-attention-mask documents (None without the flag): taken before
    the CP split, so every CP rank knows all of them, and read on every pipeline stage (middle stages get
    only it). Without the flag, middle stages get Nones (docs/design.md, "Document masking")."""
    documents = get_args().reset_attention_mask
    if not documents and not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    document_ids = batch.pop("document_ids", None)
    packed_seq_params = document_packed_seq_params(document_ids) if document_ids is not None else None
    batch = get_batch_on_this_cp_rank(batch)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"],
            packed_seq_params)


def get_blend_and_blend_per_split(args):
    """(blend, blend_per_split) from --data-path / --data-args-path or the per-split flags."""
    use_data_path = args.data_path is not None or getattr(args, "data_args_path", None) is not None
    use_per_split = any(
        getattr(args, name, None) is not None
        for name in ("train_data_path", "valid_data_path", "test_data_path", "per_split_data_args_path")
    )
    blend, blend_per_split = None, None
    if use_data_path:
        if getattr(args, "data_args_path", None) is not None:
            with open(args.data_args_path) as f:
                blend = get_blend_from_list(f.read().split())
        else:
            blend = get_blend_from_list(args.data_path)
    elif use_per_split:
        if getattr(args, "per_split_data_args_path", None) is not None:
            with open(args.per_split_data_args_path) as f:
                per_split = json.load(f)
            blend_per_split = [
                get_blend_from_list(per_split[key].split() if isinstance(per_split[key], str) else per_split[key])
                for key in ("train", "valid", "test")
            ]
        else:
            blend_per_split = [
                get_blend_from_list(args.train_data_path),
                get_blend_from_list(args.valid_data_path),
                get_blend_from_list(args.test_data_path),
            ]
    return blend, blend_per_split


def print_params_min_max_norm(optimizer, iteration: int) -> None:
    """Print one line per parameter of `optimizer.optimizer`'s groups: iteration, rank, index, whether it is
    tensor-parallel, its min, max and L2 norm (Megatron's debugging table)."""
    rank = torch.distributed.get_rank() if _dist_ready() else 0
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm\n"]
    index = 0
    for param_group in optimizer.optimizer.param_groups:
        for param in param_group["params"]:
            index += 1
            lines.append("{:7d}, {:4d}, {:4d}, {:2d}, ".format(
                iteration, rank, index, int(getattr(param, "tensor_model_parallel", False))))
            lines.append("{:.6E}, {:.6E}, {:.6E}\n".format(
                param.data.min(), param.data.max(), torch.linalg.norm(param.data)))
    print("".join(lines), flush=True)


def update_use_dist_ckpt(args) -> None:
    """`args.use_dist_ckpt`: every --ckpt-format but the legacy `torch` is a distributed checkpoint."""
    args.use_dist_ckpt = args.ckpt_format != "torch"


def to_empty_if_meta_device(module: torch.nn.Module, *, device: torch.device, recurse: bool = True):
    """Move `module`'s parameters and buffers to `device`, materialising (uninitialised, as `empty_like`) only
    the ones on the meta device: unlike `Module.to_empty`, buffers that already hold values keep them."""

    def _empty_like_if_meta(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == torch.device("meta"):
            return torch.empty_like(tensor, device=device)
        return tensor.to(device)

    return module._apply(_empty_like_if_meta, recurse=recurse)


def get_device_arch_version() -> int:
    """The major compute capability of GPU 0 (8: Ampere, 9: Hopper, 10: Blackwell, ...)."""
    if not torch.cuda.is_available():
        raise RuntimeError("get_device_arch_version needs a CUDA device (none is available)")
    return torch.cuda.get_device_properties(torch.device("cuda:0")).major
