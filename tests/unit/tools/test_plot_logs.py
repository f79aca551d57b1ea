"""tools/plot_logs.py: the series read from a text log and from TensorBoard event files equal what was
written, and the PNG comparing runs is produced (a real PNG with one panel per metric present)."""
import pytest

from tools import plot_logs

LOG = """\
 [2026-01-01 10:00:00] iteration       10/      30 | consumed samples:           80 | elapsed time per iteration (ms): 120.5 | learning rate: 1.000000E-03 | global batch size:     8 | lm loss: 7.500000E+00 | loss scale: 1.0 | grad norm: 2.250 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 10 iterations) memory (MB) | max resident (cpu): 512.5
 [2026-01-01 10:00:01] iteration       20/      30 | consumed samples:          160 | elapsed time per iteration (ms): 110.0 | throughput per GPU (TFLOP/s/GPU): 0.4 | learning rate: 5.000000E-04 | global batch size:     8 | lm loss: 6.250000E+00 | loss scale: 1.0 | grad norm: 1.500 | number of skipped iterations:   0 | number of nan iterations:   0 |
------------------------------------------------------------------------------------------------
 validation loss at iteration 20 | lm loss value: 6.400000E+00 | lm loss PPL: 6.018450E+02 |
------------------------------------------------------------------------------------------------
 validation loss at iteration 30 on test set | lm loss value: 6.900000E+00 | lm loss PPL: 9.9E+02 |
"""


def test_text_log_series(tmp_path):
    path = tmp_path / "run.log"
    path.write_text(LOG)
    series = plot_logs.read_log_text(path)
    assert series["loss"] == [(10, 7.5), (20, 6.25)]
    assert series["learning rate"] == [(10, 1e-3), (20, 5e-4)]
    assert series["grad norm"] == [(10, 2.25), (20, 1.5)]
    assert series["iteration time"] == [(10, 120.5), (20, 110.0)]
    assert series["throughput"] == [(20, 0.4)]
    assert series["validation loss"] == [(20, 6.4)]
    assert series["memory"] == [(10, 512.5)]


def test_tensorboard_series_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "tb"
    writer = SummaryWriter(log_dir=str(run_dir))
    for step in (1, 2, 3):
        writer.add_scalar("lm loss", 10.0 / step, step)
        writer.add_scalar("lm loss vs samples", 99.0, step * 8)
        writer.add_scalar("learning-rate", 1e-3 * step, step)
        writer.add_scalar("mem-max-allocated-bytes", step * 2 ** 20, step)
        writer.add_scalar("iteration-time", 0.5, step)
    writer.close()
    series = plot_logs.read_run(run_dir)

    def flat(points):
        return [x for point in points for x in point]

    assert flat(series["loss"]) == pytest.approx(flat([(1, 10.0), (2, 5.0), (3, 10.0 / 3)]))
    assert flat(series["learning rate"]) == pytest.approx(flat([(1, 1e-3), (2, 2e-3), (3, 3e-3)]))
    assert flat(series["memory"]) == pytest.approx(flat([(1, 1.0), (2, 2.0), (3, 3.0)]))
    assert flat(series["iteration time"]) == pytest.approx(flat([(1, 500.0), (2, 500.0), (3, 500.0)]))
    assert "grad norm" not in series

    log = tmp_path / "run.log"
    log.write_text(LOG)
    output = tmp_path / "out" / "cmp.png"
    assert plot_logs.main([str(run_dir), str(log), "--labels", "tb", "text", "--output", str(output),
                           "--per-metric"]) == 0
    for path in [output, output.with_name("cmp_loss.png"), output.with_name("cmp_grad_norm.png")]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert not output.with_name("cmp_nonexistent.png").exists()


def test_bad_arguments_are_reported_together(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot_logs.main([str(tmp_path / "missing.log"), "--labels", "a", "b"])
    err = capsys.readouterr().err
    assert "missing.log: no such file" in err and "--labels has 2 names for 1 runs" in err
