"""Run monitors on 2 gloo ranks (DP=2): `pretrain_gpt.py` with `--log-straggler`,
`--check-weight-hash-across-dp-replicas-interval` and `--log-energy` (CPU: energy not available, logged as 0);
then the pieces directly: StragglerDetector (host timers on CPU, the slower rank found, the HTTP toggle),
check_param_hashes_across_dp_replicas (equal, diverged, expert parameters), log_on_each_pipeline_stage and
EnergyMonitor without NVML."""
import logging
import socket
import time

import torch

from megatron.core import parallel_state
from megatron.core.energy_monitor import EnergyMonitor
from megatron.core.utils import StragglerDetector, check_param_hashes_across_dp_replicas, log_on_each_pipeline_stage
from megatron.training import training_monitors
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.harness import run_on_ranks

FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 4095 --eval-iters 0 --transformer-impl local --seed 7 --num-workers 0 --train-iters 4 "
    "--log-interval 2 --log-straggler --check-weight-hash-across-dp-replicas-interval 2 --log-energy"
).split()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command_line(records, port):
    checks = []
    real_check = training_monitors.check_param_hashes_across_dp_replicas

    def counting_check(model, cross_check=False):
        checks.append(cross_check)
        return real_check(model, cross_check)

    training_monitors.check_param_hashes_across_dp_replicas = counting_check
    try:
        code, losses = run_pretrain_in_process(FLAGS + ["--straggler-ctrlr-port", str(port)])
    finally:
        training_monitors.check_param_hashes_across_dp_replicas = real_check
    reset_training_state()
    assert code is None and len(losses) == 4
    reports = [m for m in records.messages if "MnRtt/Rnk" in m]
    energy = [m for m in records.messages if "GPU energy is not available" in m]
    return len(reports), len(energy), checks


def _straggler(records, rank, port):
    stimer = StragglerDetector()
    assert stimer is StragglerDetector()  # one instance per process
    StragglerDetector._configured = False
    stimer._set_state(off=True)
    stimer.configure(2, rank, port=port, enabled=True)
    assert stimer.enabled and stimer.configured and stimer.world_size == 2 and stimer.my_rank == rank
    for _ in range(3):
        with stimer(bdata=True):
            time.sleep(0.002)
        with stimer:
            time.sleep(0.02 if rank == 1 else 0.001)
    records.messages.clear()
    assert stimer.report(total_flops=3e9, log_interval=3) == (rank == 0)
    line = next((m for m in records.messages if "MnRtt/Rnk" in m), None)
    if rank == 0:
        assert line is not None and "MxRtt/Rnk: " in line and line.split("MxRtt/Rnk: ")[1].split(" |")[0].endswith("ms/1")
        assert line.split("MnEtpt/Rnk: ")[1].split(" |")[0].endswith("TF/1")  # the slow rank has the lowest TF/s
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            answer = conn.recv(1024).decode()
        assert "Will turn StragglerDetector OFF" in answer
    torch.distributed.barrier()
    stimer.report(total_flops=3e9, log_interval=3)  # applies the toggle on every rank
    assert not stimer.enabled and stimer.start == stimer.null_method
    return True


def _hashes(rank):
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    expert = torch.nn.Linear(2, 2)
    for param in expert.parameters():
        param.allreduce = False
    chunks.append(expert)
    same = check_param_hashes_across_dp_replicas(chunks)
    if rank == 1:
        with torch.no_grad():
            expert.weight[0, 0] += 1e-6
    # without cross_check each rank compares with replica 0; with it, with every replica
    return same, check_param_hashes_across_dp_replicas(chunks), check_param_hashes_across_dp_replicas(chunks, True)


def _logging(rank):
    logger = logging.getLogger("megatron.test.pipeline_stage")
    logger.setLevel(logging.INFO)
    records = _Records()
    logger.addHandler(records)
    log_on_each_pipeline_stage(logger, logging.INFO, "stage %d", 0)
    logger.removeHandler(records)
    return records.messages


def _energy():
    monitor = EnergyMonitor()
    monitor.setup()
    monitor.resume()
    monitor.pause()
    return monitor.available, monitor.lap(), monitor.get_total()


def _worker():
    rank = torch.distributed.get_rank()
    records = _Records()
    megatron_logger = logging.getLogger("megatron")
    megatron_logger.addHandler(records)
    megatron_logger.setLevel(logging.INFO)
    ports = [_free_port(), _free_port()]
    try:
        command_line = _command_line(records, ports[0])
        parallel_state.initialize_model_parallel(1, 1)
        return command_line, _straggler(records, rank, ports[1]), _hashes(rank), _logging(rank), _energy()
    finally:
        megatron_logger.removeHandler(records)


def test_training_monitors():
    results = run_on_ranks(_worker, 2)
    (reports0, energy0, checks0), straggler0, hashes0, logs0, energy_monitor0 = results[0]
    (reports1, _, checks1), straggler1, hashes1, logs1, _ = results[1]
    assert reports0 == 2 and reports1 == 0  # iterations 2 and 4, logged by rank 0
    assert checks0 == checks1 == [True, True]  # weight hashes cross-checked after iterations 2 and 4
    assert energy0 == 1  # CPU: one line saying why energy is not available
    assert straggler0 and straggler1
    assert hashes0 == (True, True, False) and hashes1 == (True, False, False)
    assert logs0 == ["stage 0"] and logs1 == []
    assert energy_monitor0 == (False, 0.0, 0.0)
