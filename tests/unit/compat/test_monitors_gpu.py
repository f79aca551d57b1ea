"""GPU paths of the run monitors: StragglerDetector times with CUDA events (GPU work queued inside a region
counts even though the host returns at once) and reads the GPU's temperature/power/clock; EnergyMonitor reads
NVML's energy counter (needs the pynvml module; skipped without it)."""
import logging
import os
import tempfile
import time

import pytest
import torch

from megatron.core.energy_monitor import EnergyMonitor
from megatron.core.straggler_detector import StragglerDetector
from megatron.core.utils import module_available

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_rank_world():
    init = os.path.join(tempfile.mkdtemp(), "rendezvous")
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield
    torch.distributed.destroy_process_group()


def test_straggler_detector_times_gpu_work_with_events(one_rank_world, caplog):
    stimer = StragglerDetector()
    StragglerDetector._configured = False
    stimer._set_state(off=True)
    stimer.configure(1, 0, port=0, enabled=True, prefill=8)
    assert stimer.use_events
    a = torch.randn(4096, 4096, device="cuda")
    a = a @ a / 64.0  # cuBLAS set up outside the timed region
    torch.cuda.synchronize()
    start = time.perf_counter()
    with stimer:
        for _ in range(20):
            a = a @ a / 64.0  # queued: the host leaves the region long before the GPU is done
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    gpu_ms = stimer.start_gemm_ev[0].elapsed_time(stimer.stop_gemm_ev[0])
    with caplog.at_level(logging.INFO):
        assert stimer.report(total_flops=20 * 2 * 4096 ** 3, log_interval=1)
    line = next(m for m in caplog.messages if "MnRtt/Rnk" in m)
    assert gpu_ms > host_ms, (gpu_ms, host_ms)
    reported_ms = float(line.split("MnRtt/Rnk: ")[1].split("ms/")[0])
    assert reported_ms == pytest.approx(gpu_ms, rel=0.05)
    if module_available("pynvml"):
        assert float(line.split("MnTmp/Rnk: ")[1].split("C/")[0]) > 0  # read through torch.cuda (NVML)


@pytest.mark.skipif(not module_available("pynvml"), reason="pynvml (nvidia-ml-py) is not installed")
def test_energy_monitor_reads_nvml(one_rank_world):
    monitor = EnergyMonitor()
    monitor.setup()
    assert monitor.available
    monitor.resume()
    a = torch.randn(8192, 8192, device="cuda")
    deadline = time.time() + 1.0
    while time.time() < deadline:
        a = a @ a / 8192.0
    torch.cuda.synchronize()
    joules = monitor.lap()
    monitor.pause()
    assert joules > 10.0  # a busy H200 draws well over 10 W for a second
    assert monitor.get_total() == pytest.approx(joules)
    monitor.shutdown()
