"""Plot training runs: loss, learning rate, grad norm, throughput and memory, several runs side by side.

Usage:
    python tools/plot_logs.py RUN [RUN ...] --output plots.png [--labels a b] [--metrics loss lr]

Each RUN is a TensorBoard directory (the `--tensorboard-dir` of a run: event files are found recursively),
a single event file, or the text log of a run (what `pretrain_gpt.py` prints: the Megatron line
` iteration N/M | ... | lm loss: X | learning rate: Y | grad norm: Z | ...`, the validation block and the
`memory (MB)` reports). One PNG holds one panel per metric that at least one run has; with `--per-metric`
each panel is also written as `<output stem>_<metric>.png`. matplotlib is an optional extra
(`pip install matplotlib` or `megatron-lite[plot]`); reading event files needs `tensorboard`.
"""
import argparse
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

Series = Dict[str, List[Tuple[float, float]]]

# Panel name -> (TensorBoard tags in order of preference, log-line keys, y-axis label).
METRICS = {
    "loss": (("lm loss",), ("lm loss",), "training loss"),
    "validation loss": (("lm loss validation",), ("lm loss value",), "validation loss"),
    "learning rate": (("learning-rate",), ("learning rate",), "learning rate"),
    "grad norm": (("grad-norm",), ("grad norm",), "gradient norm"),
    "throughput": (("throughput",), ("throughput per GPU (TFLOP/s/GPU)",), "TFLOP/s per GPU"),
    "iteration time": (("iteration-time",), ("elapsed time per iteration (ms)",), "ms per iteration"),
    "memory": (("mem-max-allocated-bytes", "mem-allocated-bytes"), ("max allocated", "max resident (cpu)"),
               "MB"),
}
ALIASES = {"lr": "learning rate", "val": "validation loss", "mem": "memory", "time": "iteration time"}

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|")
_FIELD = re.compile(r"\s*([^|:]+?):\s*([-+0-9.eEinfa]+)\s*(?=\|)")
_VALIDATION_ITER = re.compile(r"validation loss at iteration\s+(\d+)\s*\|")
_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\)(.*)")


def _float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def read_log_text(path: Path) -> Series:
    """Metric series from a run's printed log (iteration lines, validation blocks, memory reports)."""
    series: Series = {name: [] for name in METRICS}
    key_to_metric = {key: name for name, (_, keys, _) in METRICS.items() for key in keys}
    last_iteration = 0
    with open(path, errors="replace") as handle:
        for line in handle:
            match = _ITERATION.search(line)
            if match:
                last_iteration = int(match.group(1))
                for key, value in _FIELD.findall(line[match.end():]):
                    metric, number = key_to_metric.get(key.strip()), _float(value)
                    if metric and metric != "memory" and number is not None:
                        series[metric].append((last_iteration, number))
                continue
            match = _VALIDATION_ITER.search(line)
            if match:
                value = re.search(r"lm loss value:\s*([-+0-9.eE]+)", line)
                if value:
                    series["validation loss"].append((int(match.group(1)), float(value.group(1))))
                continue
            match = _MEMORY.search(line)
            if match:
                for key in METRICS["memory"][1]:
                    value = re.search(re.escape(key) + r":\s*([0-9.eE+]+)", match.group(2))
                    if value:
                        series["memory"].append((int(match.group(1)), float(value.group(1))))
                        break
    return {name: points for name, points in series.items() if points}


def _event_files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and "tfevents" in p.name)


def read_tensorboard(path: Path) -> Series:
    """Metric series from TensorBoard event files (the first tag of each metric that is present)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise SystemExit("reading TensorBoard event files needs tensorboard: pip install tensorboard") from None
    scalars: Dict[str, Dict[float, float]] = {}
    for event_file in _event_files(path):
        accumulator = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags().get("scalars", []):
            for event in accumulator.Scalars(tag):
                scalars.setdefault(tag, {})[float(event.step)] = float(event.value)
    series: Series = {}
    for name, (tags, _, _) in METRICS.items():
        for tag in tags:
            if tag in scalars:
                scale = 1.0 / 2 ** 20 if tag.startswith("mem-") else 1.0
                if tag == "iteration-time":
                    scale = 1000.0
                series[name] = sorted((step, value * scale) for step, value in scalars[tag].items())
                break
    return series


def read_run(path: Path) -> Series:
    """A run's series from a TensorBoard directory / event file, or a text log."""
    if path.is_dir() or "tfevents" in path.name:
        return read_tensorboard(path)
    return read_log_text(path)


def plot_runs(runs: Sequence[Tuple[str, Series]], output: Path, metrics: Optional[Sequence[str]] = None,
              per_metric: bool = False) -> List[Path]:
    """Write the PNG(s); returns the written paths."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib (or megatron-lite[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = [ALIASES.get(m, m) for m in metrics] if metrics else list(METRICS)
    unknown = [m for m in wanted if m not in METRICS]
    if unknown:
        raise SystemExit(f"--metrics {' '.join(unknown)}: unknown; choose from {sorted(METRICS) + sorted(ALIASES)}")
    present = [m for m in wanted if any(m in series for _, series in runs)]
    if not present:
        raise SystemExit("none of the runs has any of the metrics " + ", ".join(wanted))
    columns = min(2, len(present))
    rows = (len(present) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.6 * rows), squeeze=False)
    for axis, metric in zip(axes.flat, present):
        _draw(axis, metric, runs)
    for axis in list(axes.flat)[len(present):]:
        axis.set_visible(False)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    written = [output]
    if per_metric:
        for metric in present:
            single, axis = plt.subplots(figsize=(6.5, 3.6))
            _draw(axis, metric, runs)
            single.tight_layout()
            path = output.with_name(f"{output.stem}_{metric.replace(' ', '_')}{output.suffix}")
            single.savefig(path, dpi=100)
            plt.close(single)
            written.append(path)
    return written


def _draw(axis, metric: str, runs: Sequence[Tuple[str, Series]]) -> None:
    for label, series in runs:
        if metric in series:
            steps, values = zip(*series[metric])
            axis.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
    axis.set_title(metric)
    axis.set_xlabel("iteration")
    axis.set_ylabel(METRICS[metric][2])
    if metric in ("loss", "validation loss") and all(v > 0 for _, s in runs for _, v in s.get(metric, [])):
        axis.set_yscale("log")
    axis.grid(alpha=0.3)
    if len(runs) > 1:
        axis.legend(fontsize=8)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("runs", nargs="+", help="TensorBoard dirs, event files or text logs.")
    parser.add_argument("--output", default="plots.png", help="The PNG to write (default plots.png).")
    parser.add_argument("--labels", nargs="+", help="One legend label per run (default: the paths).")
    parser.add_argument("--metrics", nargs="+", help=f"Panels to draw (default all): {', '.join(METRICS)}.")
    parser.add_argument("--per-metric", action="store_true", help="Also write one PNG per metric.")
    args = parser.parse_args(argv)
    problems = [f"{run}: no such file or directory" for run in args.runs if not os.path.exists(run)]
    if args.labels and len(args.labels) != len(args.runs):
        problems.append(f"--labels has {len(args.labels)} names for {len(args.runs)} runs: give one per run")
    if problems:
        parser.error("; ".join(problems))
    labels = args.labels or args.runs
    runs = [(label, read_run(Path(run))) for label, run in zip(labels, args.runs)]
    for label, series in runs:
        counts = ", ".join(f"{name} ({len(points)})" for name, points in series.items()) or "nothing"
        print(f"[plot_logs] {label}: {counts}")
    for path in plot_runs(runs, Path(args.output), args.metrics, args.per_metric):
        print(f"[plot_logs] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
