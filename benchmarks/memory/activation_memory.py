"""Activation memory of a GPT forward pass with and without activation recompute (CPU or GPU).

Counts the bytes autograd keeps for the backward pass (tensors saved by every op and autograd function,
parameters excluded, each storage counted once) through `torch.autograd.graph.saved_tensors_hooks`.
On CUDA it also reports the peak allocated memory of forward+backward.

  python benchmarks/memory/activation_memory.py --layers 4 --hidden 256 --heads 8 --seq 512 --mbs 2
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

MODES = {
    "none": {},
    "selective (core_attn)": {"recompute_granularity": "selective"},
    "selective (core_attn, mlp, layernorm)": {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp", "layernorm"]},
    "full uniform (1 layer)": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full block (all layers)": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 10**6},
}


def saved_activation_bytes(model, run):
    """Bytes of distinct non-parameter storages saved for backward while `run()` executes."""
    params = {p.data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return total[0], out


def measure(args, mode_kwargs, device):
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    kwargs = dict(mode_kwargs)
    if kwargs.get("recompute_method") == "block":
        kwargs["recompute_num_layers"] = args.layers
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, **kwargs)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq)
    model.to(device)
    ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device=device)
    pos = torch.arange(args.seq, device=device)[None].expand(args.mbs, -1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    saved, loss = saved_activation_bytes(model, lambda: model(ids, pos, None, labels=ids))
    loss.sum().backward()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return saved, peak


def init_single_process():
    if not dist.is_initialized():
        init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    init_single_process()
    print(f"GPT {args.layers} layers, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, mbs {args.mbs}, "
          f"vocab {args.vocab}, fp32, {device}")
    base = None
    for name, kwargs in MODES.items():
        saved, peak = measure(args, kwargs, device)
        base = base or saved
        peak_txt = f" | peak {peak / 2**20:8.1f} MiB" if peak is not None else ""
        print(f"{name:40s} saved for backward {saved / 2**20:8.2f} MiB ({saved / base:5.2f} of none){peak_txt}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
