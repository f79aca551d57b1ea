"""Where the time of a batch-1 decode step goes (one GPU; prints JSON lines).

Llama-1B-shaped model (random weights, `inference_bench.SHAPE`), static engine, batch 1, CUDA-graph decode:
(1) end-to-end ms per token through `engine.generate` (as `inference_bench.batch1_decode_ms`), (2) the GPU time
of the captured decode graph alone (the graph replayed back to back), (3) the kernels of one generate call
under `torch.profiler` (top kernels by total time, kernels per decoded token) and the host time per token.
With `--compile-step` the same for the graphs of the `torch.compile`d step.

    python benchmarks/gpu/decode_profile.py [--prompt-len 128] [--new-tokens 128] [--compile-step]
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
import inference_bench as bench  # noqa: E402


def _graph_replay_ms(engine, repeats=200):
    """GPU ms of one replay of each captured decode graph (back to back, no host work in between)."""
    runner = engine.text_generation_controller.inference_wrapped_model.decode_graphs
    out = {}
    for key, (graph, _) in list(runner._graphs.items()):
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
        out[str(key)] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def _kernel_table(prof, tokens, top=25):
    rows = []
    total_us, count = 0.0, 0
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", None)
        if device_us is None:
            device_us = getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and device_us > 0:
            rows.append((device_us, evt.count, evt.key[:110]))
            total_us += device_us
            count += evt.count
    rows.sort(reverse=True)
    return {"kernels_per_token": count / tokens, "gpu_us_per_token": total_us / tokens,
            "top": [{"us_per_token": round(us / tokens, 2), "calls_per_token": round(n / tokens, 2), "kernel": k}
                    for us, n, k in rows[:top]]}


def profile(model, args, compile_step):
    from megatron.core.inference.sampling_params import SamplingParams

    tag = "compiled_step" if compile_step else "graphed"
    engine = bench.static_engine(model, 1, graphs=True, compile_step=compile_step)
    prompt = list(range(1, args.prompt_len + 1))
    text = bench._Tok().detokenize(prompt)
    run = lambda n: engine.generate([text], sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=n))
    run(8)
    short = min(bench._timed(lambda: run(8))[1] for _ in range(2))
    long = min(bench._timed(lambda: run(args.new_tokens))[1] for _ in range(2))
    e2e = (long - short) / (args.new_tokens - 8) * 1e3
    print(json.dumps({f"{tag}_e2e_ms_per_token": e2e}), flush=True)
    print(json.dumps({f"{tag}_graph_replay_ms": _graph_replay_ms(engine)}), flush=True)
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(args.new_tokens)
        torch.cuda.synchronize()
    table = _kernel_table(prof, args.new_tokens)
    print(json.dumps({f"{tag}_profile": table}, indent=1), flush=True)
    cpu = sorted(((e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()
                  if e.self_cpu_time_total > 0), reverse=True)[:25]
    print(json.dumps({f"{tag}_host_top": [{"self_cpu_us_per_token": round(us / args.new_tokens, 1),
                                            "calls_per_token": round(n / args.new_tokens, 2), "op": k[:90]}
                                           for us, n, k in cpu]}, indent=1), flush=True)
    return e2e


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compile-step", action="store_true")
    parser.add_argument("--hbm-gbps", type=float, default=4800.0)
    args = parser.parse_args()
    model = bench.build_ours()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"weight_bytes": weights, "weight_bound_ms": weights / (args.hbm_gbps * 1e9) * 1e3}), flush=True)
    profile(model, args, False)
    if args.compile_step:
        profile(model, args, True)


if __name__ == "__main__":
    main()
