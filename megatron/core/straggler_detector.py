"""Megatron Core's straggler detector (`--log-straggler`), exported as `megatron.core.utils.StragglerDetector`.

A process-wide singleton times regions of every rank: `with stimer:` around the model's forward and
`with stimer(bdata=True):` around `get_batch`. Each region is timed by the host clock (`perf_counter_ns`)
and, on a GPU, by a pair of CUDA events; the larger of the two counts. Every `--log-interval` iterations
`report(flops, interval)` gathers each rank's mean forward time, the longest batch time, its estimated
throughput (flops / time / world size / 3, since only the forward is timed) and, on a GPU, temperature, power,
utilisation and clock (read through torch.cuda, which needs pynvml; 0 where unavailable), and rank 0 logs the
slowest and fastest ranks. `--straggler-minmax-count N` also lists the N slowest and fastest. Rank 0 listens on
`--straggler-ctrlr-port`: any HTTP request (e.g. `curl localhost:65535`) toggles collection at the next report,
and `--disable-straggler-on-startup` starts it off. On CPU only host timers exist (Megatron's detector stays off
without CUDA; here it measures with the host clock).
"""
import logging
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from typing import Dict, List, Optional, Tuple, Union

import torch

logger = logging.getLogger(__name__)


class _ValueWithRank:
    """A value with the rank it came from and its unit, ordered by value."""

    def __init__(self, value: float, rank: int, unit: str = "") -> None:
        self._rank = rank
        self._value = value
        self._unit = unit

    def __lt__(self, other) -> bool:
        return self._value < other._value

    def __gt__(self, other) -> bool:
        return self._value > other._value

    def __call__(self) -> Tuple[float, int, str]:
        """(value, rank, unit)."""
        return self._value, self._rank, self._unit

    def __str__(self) -> str:
        return f"{self._value:.2f}{self._unit}/{self._rank}"


_METRICS = (("elapsed", "time", "ms"), ("btime", "btime", "ms"), ("temp", "temp", "C"), ("power", "power", "W"),
            ("util", "util", "%"), ("clock", "clock", "MHz"))


@dataclass
class _StragglerData:
    """min/max of each metric with its rank (`min_elapsed`, `max_elapsed`, `min_btime`, ...) and every rank's
    estimated TFLOP/s, sorted (`aflops`)."""

    values: Dict[str, _ValueWithRank] = field(default_factory=dict)
    aflops: Optional[List[_ValueWithRank]] = None

    def __getattr__(self, name: str) -> _ValueWithRank:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)


def _gpu_metrics() -> Tuple[float, float, float, float]:
    """(temperature, power, utilisation, clock) of the current GPU; zeros where torch.cuda cannot read them."""
    readings = []
    for reader in (torch.cuda.temperature, torch.cuda.power_draw, torch.cuda.utilization, torch.cuda.clock_rate):
        try:
            readings.append(float(reader()))
        except Exception:  # noqa: BLE001  best effort: pynvml missing, or a reading the GPU does not support
            readings.append(0.0)
    return tuple(readings)


class StragglerDetector:
    """Per-rank timing of chosen regions, compared across ranks by `report()` (see the module docstring).

    Every construction returns the one instance (a singleton); `configure()` sets it up once per process.
    Off (start/stop do nothing) until configured with `enabled=True` or toggled on.
    """

    _configured = False

    def __new__(cls) -> "StragglerDetector":
        if not hasattr(cls, "_instance"):
            cls._instance = super().__new__(cls)
        return cls._instance

    def __init__(self) -> None:
        if getattr(self, "_initialized", False):
            return
        self._initialized = True
        self._off = True
        self.start = self.null_method
        self.stop = self.null_method
        self.world, self.rank, self.mmcnt, self.port, self.amp = 0, 0, 1, 0, 3.0
        self.toggle = False
        self.bdata = False
        self.dev: Union[torch.device, int, None] = None
        self.use_events = False
        self.evt_q: Optional[queue.LifoQueue] = None
        self._clear_records()
        self.sock: Optional[socket.socket] = None
        self.ctrlr: Optional[threading.Thread] = None

    def _clear_records(self) -> None:
        self.start_gemm_ev, self.stop_gemm_ev, self.start_data_ev, self.stop_data_ev = [], [], [], []
        self.start_gemm_tm, self.stop_gemm_tm, self.start_data_tm, self.stop_data_tm = [], [], [], []

    def configure(self, world: int, rank: int, mmcnt: int = 1, amp: float = 3.0, port: int = 65535,
                  prefill: int = 1024, enabled: bool = False) -> None:
        """Set up once per process: world size, this rank, how many slowest/fastest ranks to list (`mmcnt`), the
        throughput amplification (3.0: only forwards are timed), rank 0's control port, how many CUDA events to
        pre-allocate, and whether collection starts on."""
        if StragglerDetector._configured:
            return
        StragglerDetector._configured = True
        self.world, self.rank, self.mmcnt, self.amp, self.port = world, rank, max(1, mmcnt), amp, port
        self.toggle = self.bdata = False
        self._clear_records()
        self.use_events = torch.cuda.is_available()
        nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.evt_q = queue.LifoQueue()
        if self.use_events:
            for _ in range(prefill):
                self.evt_q.put(torch.cuda.Event(enable_timing=True))
        if self.rank == 0:
            self._controller()
        self._set_state(off=not enabled)

    def _set_state(self, off: bool) -> None:
        self._off = off
        self.start = self.null_method if off else self.start_method
        self.stop = self.null_method if off else self.stop_method

    def reset(self) -> None:
        """Forget the recorded regions (events go back to the pool); called by `elapsed()`."""
        if self._off:
            return
        if self.evt_q is not None:
            for event in self.start_gemm_ev + self.stop_gemm_ev + self.start_data_ev + self.stop_data_ev:
                self.evt_q.put(event)
        self._clear_records()
        self.bdata = False

    def _event_pair(self):
        if not self.use_events:
            return None, None
        if self.evt_q is not None and self.evt_q.qsize() > 1:
            return self.evt_q.get(), self.evt_q.get()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start_method(self) -> None:
        """Open a region: the batch region after `__call__(bdata=True)`, else a compute region (not re-entrant)."""
        start_event, stop_event = self._event_pair()
        data = self.bdata
        self.bdata = False
        events = (self.start_data_ev, self.stop_data_ev) if data else (self.start_gemm_ev, self.stop_gemm_ev)
        times = (self.start_data_tm, self.stop_data_tm) if data else (self.start_gemm_tm, self.stop_gemm_tm)
        events[0].append(start_event)
        events[1].append(stop_event)
        times[1].append(0)
        times[0].append(time.perf_counter_ns())
        if start_event is not None:
            start_event.record()

    def stop_method(self) -> None:
        """Close the open region (a batch region first, if one is open)."""
        for events, times in ((self.stop_data_ev, self.stop_data_tm), (self.stop_gemm_ev, self.stop_gemm_tm)):
            if times and times[-1] == 0:
                times[-1] = time.perf_counter_ns()
                if events[-1] is not None:
                    events[-1].record()
                return

    @staticmethod
    def _region_ms(start_event, stop_event, start_ns: int, stop_ns: int) -> float:
        host = (stop_ns - start_ns) / 1e6
        if start_event is None:
            return host
        return max(start_event.elapsed_time(stop_event), host)

    def elapsed(self) -> Tuple[float, float, float, float, float, float]:
        """(total compute ms, longest batch ms, temperature, power, utilisation, clock) since the last reset,
        then reset. All zeros while off or when a region was left open."""
        if self._off:
            return 0, 0, 0, 0, 0, 0
        delta = batch_delta = 0.0
        temp = power = util = clock = 0.0
        if len(self.start_gemm_tm) != len(self.stop_gemm_tm) or 0 in self.stop_gemm_tm:
            logger.warning("Event Start/Stop out of sync %d/%d", len(self.start_gemm_tm),
                           len([t for t in self.stop_gemm_tm if t]))
        elif 0 in self.stop_data_tm:
            logger.warning("get_batch Start/Stop out of sync")
        else:
            if self.use_events:
                temp, power, util, clock = _gpu_metrics()
                torch.cuda.synchronize()
            for i in range(len(self.start_gemm_tm)):
                delta += self._region_ms(self.start_gemm_ev[i], self.stop_gemm_ev[i], self.start_gemm_tm[i],
                                         self.stop_gemm_tm[i])
            for i in range(len(self.start_data_tm)):
                # batches are prefetched: the longest one counts, not the mean
                batch_delta = max(batch_delta, self._region_ms(self.start_data_ev[i], self.stop_data_ev[i],
                                                               self.start_data_tm[i], self.stop_data_tm[i]))
        self.reset()
        return delta, batch_delta, temp, power, util, clock

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """Compare the ranks over the last `log_interval` iterations (collective: every rank calls it; rank 0
        logs); then apply a pending toggle. True when a report was logged."""
        reported = False
        if not self._off and total_flops > 0.0 and log_interval > 0:
            elapsed, btime, temp, power, util, clock = self.elapsed()
            ptime = elapsed / float(log_interval)
            flops_per_iteration = total_flops / float(log_interval)
            tflops = flops_per_iteration / (max(ptime, 1e-9) * 10 ** 9 * self.world) / self.amp
            data = self._min_max(ptime, btime, temp, power, util, clock, tflops)
            if self.rank == 0 and data is not None and data.aflops is not None:
                self._log_report(data)
                reported = True
        self._check_toggle()
        return reported

    def _log_report(self, data: _StragglerData) -> None:
        now = f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
        min_flops, min_rank, _ = data.aflops[0]()
        max_flops, max_rank, _ = data.aflops[-1]()
        parts = [now]
        for short, name in (("Rtt", "elapsed"), ("Pwr", "power"), ("Tmp", "temp"), ("Utl", "util"),
                            ("Clk", "clock"), ("DRtt", "btime")):
            parts.append(f"Mn{short}/Rnk: {data.values['min_' + name]}")
            parts.append(f"Mx{short}/Rnk: {data.values['max_' + name]}")
        parts += [f"MnEtpt/Rnk: {min_flops:.2f}TF/{min_rank}", f"MxEtpt/Rnk: {max_flops:.2f}TF/{max_rank}"]
        logger.info(" | ".join(parts))
        if 1 < self.mmcnt < self.world:
            bottom = "".join(f" {data.aflops[i]}," for i in range(self.mmcnt))
            top = "".join(f" {data.aflops[i + self.world - self.mmcnt]}," for i in range(self.mmcnt))
            logger.info(f"^^^^ Bottom {self.mmcnt} Ranks with lowest  Etpt(TF):{bottom}")
            logger.info(f"^^^^ Top    {self.mmcnt} Ranks with highest Etpt(TF):{top}")

    def _check_toggle(self) -> None:
        """Broadcast rank 0's on/off state (flipped if a toggle was requested through its port)."""
        off = self._off
        if self.rank == 0 and self.toggle:
            off, self.toggle = not off, False
        state = torch.tensor(off, dtype=torch.bool, device=self.dev)
        torch.distributed.broadcast(state, 0)
        new_off = bool(state.item())
        if new_off != self._off:
            self._set_state(off=new_off)
            if self.rank == 0:
                logger.info("Toggling StragglerDetector State %s", "OFF" if new_off else "ON")

    def _handler(self) -> None:
        """Rank 0's control thread: each HTTP request toggles collection at the next report."""
        header = "HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: "
        logger.info("Controller ready to recv commands on port %d. Current state %s", self.port,
                    "OFF" if self._off else "ON")
        while self.sock is not None:
            try:
                conn, _ = self.sock.accept()
                conn.recv(1024)
                self.toggle = True
                message = f"Will turn StragglerDetector {'ON' if self._off else 'OFF'} at next logging interval"
                conn.send(f"{header}{len(message)}\r\n\r\n{message}".encode())
                conn.close()
                logger.info(message)
            except OSError as error:
                logger.error("Error in stragler handler.. %s", error)
                return

    def _controller(self) -> None:
        """Start rank 0's control thread on `port` (a warning if the port cannot be bound)."""
        try:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("0.0.0.0", self.port))
            self.sock.listen(128)
            self.ctrlr = threading.Thread(target=self._handler, name="straggler", daemon=True)
            self.ctrlr.start()
        except OSError as error:
            self.sock = None
            logger.warning("StragglerDetector cannot be controlled.. %s", error)

    def _min_max(self, ptime: float, btime: float, temp: float, power: float, util: float, clock: float,
                 flops: float) -> Optional[_StragglerData]:
        """Gather every rank's metrics on rank 0 (collective) and find each metric's min/max rank there."""
        if self._off:
            return None
        mine = {"rank": self.rank, "time": ptime, "btime": btime, "temp": temp, "power": power, "util": util,
                "clock": clock, "flops": flops}
        gathered = [None] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(mine, object_gather_list=gathered, dst=0)
        data = _StragglerData()
        if self.rank == 0:
            for name, key, unit in _METRICS:
                low = min(gathered, key=lambda d: d[key])
                high = max(gathered, key=lambda d: d[key])
                data.values[f"min_{name}"] = _ValueWithRank(low[key], int(low["rank"]), unit)
                data.values[f"max_{name}"] = _ValueWithRank(high[key], int(high["rank"]), unit)
            data.aflops = sorted((_ValueWithRank(d.get("flops", 0.0), int(d.get("rank", -1))) for d in gathered),
                                 key=lambda v: v()[0])
        torch.distributed.barrier()
        return data

    @property
    def enabled(self) -> bool:
        """Whether collection is on (a requested toggle applies at the end of the next `report()`)."""
        return not self._off

    @property
    def configured(self) -> bool:
        """Whether `configure()` ran."""
        return StragglerDetector._configured

    @property
    def my_rank(self) -> int:
        """The rank given to `configure()`."""
        return self.rank

    @property
    def world_size(self) -> int:
        """The world size given to `configure()`."""
        return self.world

    def null_method(self) -> None:
        """What start/stop are while collection is off."""

    def __enter__(self) -> "StragglerDetector":
        self.start()
        return self

    def __call__(self, bdata: bool = False) -> "StragglerDetector":
        """`with stimer(bdata=True):` times the region as a batch fetch."""
        self.bdata = bdata
        return self

    def __exit__(self, ex_type, ex_val, ex_tb) -> bool:
        if ex_type is not None:
            logger.warning("%s\n%s", ex_val, traceback.format_exception(ex_type, ex_val, ex_tb))
        self.stop()
        return False


__all__ = ["StragglerDetector"]
