"""The rerun state machine on one process, driven the way `train_step` drives it: the loop
`while should_run_forward_backward(it)` around a forward that validates its result, then
`should_checkpoint_and_exit()`. Covers every diagnostic path, the RNG and data replay of a re-run, error
injection, the determinism statistics, the tracker file and the checkpoint state."""
import logging
import math

import pytest
import torch

from megatron.core import rerun_state_machine as rsm
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    QuickStats,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    RerunValidationStatus,
)


@pytest.fixture(autouse=True)
def _fresh_machine():
    rsm.destroy_rerun_state_machine()
    yield
    rsm.destroy_rerun_state_machine()


def _machine(mode, **kwargs):
    rsm.initialize_rerun_state_machine(mode=mode, **kwargs)
    return rsm.get_rerun_state_machine()


def _iteration(machine, data, value_of, message="check", rejection=torch.isnan, fatal=True, tolerance=0.0):
    """One train_step: returns (results of every run of the iteration, should_checkpoint_and_exit())."""
    results = []
    while machine.should_run_forward_backward(data):
        batch = next(data)
        result = value_of(batch, len(results))
        results.append(result)
        machine.validate_result(result, rejection, message, tolerance=tolerance, fatal=fatal)
    return results, machine.should_checkpoint_and_exit()


def _data():
    return RerunDataIterator(iter([torch.tensor(float(i)) for i in range(100)]))


def test_disabled_mode_raises_for_every_rejection(tmp_path):
    tracker = tmp_path / "rejected.txt"
    machine = _machine(RerunMode.DISABLED, result_rejected_tracker_filename=str(tracker))
    data = _data()
    results, decision = _iteration(machine, data, lambda batch, run: batch)
    assert len(results) == 1 and decision == (False, False, 0)
    assert data.saved_microbatches == []  # nothing kept for replay when disabled
    with pytest.raises(RuntimeError, match=r"Rank 0, node .*, device .*, iteration 1: Unexpected result nan "
                                           r"\(message='found NaN'\)"):
        _iteration(machine, data, lambda batch, run: torch.tensor(math.nan), message="found NaN")
    machine.state = RerunState.NOT_RUNNING_YET
    with pytest.raises(RuntimeError, match="Spiky"):  # Megatron 0.13.1 raises in disabled mode even when not fatal
        _iteration(machine, data, lambda batch, run: batch, message="Spiky loss", rejection=lambda r: True,
                   fatal=False)
    lines = tracker.read_text().splitlines()
    assert len(lines) == 2 and all("status=RerunValidationStatus.RERUN_DISABLED" in line for line in lines)
    assert "iteration=1 " in lines[0] and "message='found NaN'" in lines[0]
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(str(tracker)) == []
    with open(tracker, "a") as f:
        f.write(lines[0] + "\n")  # the same rank rejected iteration 1 twice: skipped on the next attempt
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(str(tracker)) == [1]
    with pytest.raises(RuntimeError, match="cannot be appended"):
        RerunStateMachine(result_rejected_tracker_filename=str(tmp_path / "missing_dir" / "x.txt"))


def test_transient_error_reruns_in_place_with_the_same_rng_and_data(tmp_path, caplog):
    tracker = tmp_path / "rejected.txt"
    machine = _machine(RerunMode.VALIDATE_RESULTS, result_rejected_tracker_filename=str(tracker))
    data = _data()
    draws = []

    def forward(batch, run):
        draws.append(torch.rand(3))  # restored RNG: the re-run draws the same numbers
        if machine.current_iteration == 1 and run == 0:
            return torch.tensor(math.nan)  # the initial run of iteration 1 goes wrong, the re-run does not
        return batch * 2

    first, decision = _iteration(machine, data, forward)
    assert [float(r) for r in first] == [0.0] and decision == (False, False, 0)
    with caplog.at_level(logging.WARNING):
        results, decision = _iteration(machine, data, forward)
    assert math.isnan(results[0]) and float(results[1]) == 2.0  # batch 1 replayed
    assert torch.equal(draws[1], draws[2]) and not torch.equal(draws[0], draws[1])
    assert decision == (True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert machine.state == RerunState.RERUNNING_IN_PLACE and "Possible transient error" in caplog.text
    statuses = [line.split("status=")[1].split()[0] for line in tracker.read_text().splitlines()]
    assert statuses == [str(RerunValidationStatus.INITIAL_RUN), str(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE)]


def test_first_iteration_is_never_validated():
    machine = _machine(RerunMode.VALIDATE_RESULTS)
    results, decision = _iteration(machine, _data(), lambda batch, run: torch.tensor(math.nan))
    assert len(results) == 1 and decision == (False, False, 0)


def _reproducible_failure(machine, data):
    _iteration(machine, data, lambda batch, run: batch)
    return _iteration(machine, data, lambda batch, run: torch.tensor(math.inf), rejection=torch.isinf)


def test_reproducible_error_resumes_from_a_checkpoint_on_another_gpu(monkeypatch):
    machine = _machine(RerunMode.VALIDATE_RESULTS)
    data = _data()
    results, decision = _reproducible_failure(machine, data)
    assert len(results) == 2 and decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT and machine.suspicious_node is not None
    saved = machine.state_dict(data, ckpt_format="torch")
    assert saved["sharded"]["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert saved["sharded"]["failed_validation_call"].caller.message == "check"
    assert [float(t) for t in saved["sharded"]["data_iterator_checkpoints"][0]["saved_microbatches"]] == [1.0]

    def resumed(node, value):
        rsm.destroy_rerun_state_machine()
        again = _machine(RerunMode.VALIDATE_RESULTS)
        again.load_state_dict(saved)
        monkeypatch.setattr(rsm, "_node_name", lambda: node)
        fresh = RerunDataIterator(iter([torch.tensor(1.0)] * 3))  # the resumed job's loader, at iteration 1
        return again, _iteration(again, fresh, lambda batch, run: value, rejection=torch.isinf)

    again, (results, decision) = resumed(machine.suspicious_node, torch.tensor(math.inf))
    assert decision == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)  # same GPU: resume again
    assert again.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
    again, (results, decision) = resumed("another-node", torch.tensor(3.0))
    assert decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)  # differs elsewhere: persistent error
    again, (results, decision) = resumed("another-node", torch.tensor(math.inf))
    assert decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)  # correct, but the check is fatal


def test_correct_non_fatal_result_continues_training(monkeypatch):
    machine = _machine(RerunMode.VALIDATE_RESULTS)
    data = _data()
    _iteration(machine, data, lambda batch, run: batch, fatal=False)
    _, decision = _iteration(machine, data, lambda batch, run: torch.tensor(7.0), rejection=lambda r: r > 5,
                             fatal=False)
    assert decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    monkeypatch.setattr(rsm, "_node_name", lambda: "another-node")
    results, decision = _iteration(machine, data, lambda batch, run: torch.tensor(7.0), rejection=lambda r: r > 5,
                                   fatal=False)
    assert len(results) == 1 and decision == (False, False, 0) and machine.state == RerunState.NOT_RUNNING_YET
    results, decision = _iteration(machine, data, lambda batch, run: batch, fatal=False)
    assert decision == (False, False, 0)


@pytest.mark.parametrize("kind, first_exit, final_exit", [
    (RerunDiagnostic.TRANSIENT_ERROR, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, None),
    (RerunDiagnostic.PERSISTENT_ERROR, EXIT_CODE_RESUME_TO_DISAMBIGUATE, EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
    (RerunDiagnostic.CORRECT_RESULT, EXIT_CODE_RESUME_TO_DISAMBIGUATE, 0),
])
def test_error_injection(monkeypatch, kind, first_exit, final_exit):
    machine = _machine(RerunMode.VALIDATE_RESULTS, error_injector=RerunErrorInjector(1, kind))
    data = _data()
    _iteration(machine, data, lambda batch, run: batch, fatal=False)
    results, (checkpoint, exit_now, code) = _iteration(machine, data, lambda batch, run: batch, fatal=False)
    assert len(results) == 2 and results[0] == results[1] and checkpoint and exit_now and code == first_exit
    if final_exit is None:
        assert machine.error_injector.injected_error_type is None
        return
    monkeypatch.setattr(rsm, "_node_name", lambda: "another-node")
    _, (checkpoint, exit_now, code) = _iteration(machine, data, lambda batch, run: batch, fatal=False)
    assert not checkpoint and code == final_exit and exit_now == bool(final_exit)
    assert machine.error_injector.injected_error_type is None


def test_injector_rate_and_state():
    assert not any(RerunErrorInjector(0).maybe_inject() for _ in range(5))
    injector = RerunErrorInjector(4, RerunDiagnostic.PERSISTENT_ERROR)
    hits = 0
    for _ in range(400):
        if injector.maybe_inject():
            hits += 1
            injector.injected_error_type = None
    assert 50 < hits < 150  # about one in four
    injector.maybe_inject()
    while injector.injected_error_type is None:
        injector.maybe_inject()
    assert not injector.maybe_inject()  # one injection at a time
    state = injector.state_dict()
    restored = RerunErrorInjector()
    restored.load_state_dict(state)
    assert restored.should_inject_errors and restored.injected_error_type == RerunDiagnostic.PERSISTENT_ERROR
    with pytest.raises(ValueError, match="--error-injection-type"):
        RerunErrorInjector(1, "transient_error")


def test_report_stats_reruns_every_iteration(caplog):
    machine = _machine(RerunMode.REPORT_DETERMINISM_STATS)
    data = _data()
    noise = iter([0.0, 0.0, 0.0, 1e-3, 0.0, 0.0, 0.0, 0.0])
    with caplog.at_level(logging.INFO):
        for _ in range(4):
            results, decision = _iteration(machine, data, lambda batch, run: batch + 1 + next(noise))
            assert len(results) == 2 and decision == (False, False, 0)
    assert "Stats on computation determinism" in caplog.text
    stats = machine.stats[rsm.Caller(message="check", rank=0)]
    assert stats.zero_cnt == 3 and len(stats.samples) == 1
    assert stats.samples[0] == pytest.approx(1e-3 / 2.0005, rel=1e-3)  # |a-b| / mean(a, b) for 2 vs 2.001


def test_quick_stats_and_comparison():
    stats = QuickStats(max_size=3)
    for value in (0.0, 0.5, 0.0, 0.25, 0.75, 1.0):
        stats.record(value)
    assert stats.zero_cnt == 2 and stats.max == 1.0 and sorted(stats.samples) == [0.25, 0.75, 1.0]
    assert stats.print_stats().startswith("5/2 total/identical samples")  # 3 kept + 2 zeros
    other = QuickStats()
    other.record(2.0)
    empty = QuickStats()
    empty.combine([other])
    assert empty.samples == [2.0] and empty.max == 2.0
    empty.reset()
    assert empty.print_stats() == "0 samples, all identical"
    assert rsm._compare_floats(torch.tensor(1.0), torch.tensor(1.0)) == rsm.COMPARISON_MATCH
    assert rsm._compare_floats(torch.tensor(math.nan), torch.tensor(math.nan)) == rsm.COMPARISON_MATCH
    assert rsm._compare_floats(torch.tensor(math.nan), torch.tensor(1.0)) == rsm.COMPARISON_MISMATCH
    assert rsm._compare_floats(torch.tensor(1.0), torch.tensor(3.0)) == pytest.approx(1.0)


def test_spike_detection_and_checkpoint_state():
    machine = _machine(RerunMode.DISABLED)
    for value in (1.0, 2.0, 3.0):
        assert not machine.is_unexpectedly_large(torch.tensor(value), 10, "loss", num_samples=3)
    assert not machine.is_unexpectedly_large(torch.tensor(29.0), 10, "loss", num_samples=3)
    assert machine.is_unexpectedly_large(torch.tensor(30.0), 10, "loss", num_samples=3)
    assert not machine.is_unexpectedly_large(torch.tensor(math.inf), 10, "loss", num_samples=3)
    state = machine.state_dict(None, "torch")
    assert state["sharded"]["max_values"] == {"loss": 3.0} and state["sharded"]["data_iterator_checkpoints"] is None

    validating = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    validating.load_state_dict(state)  # a checkpoint of a disabled run leaves the CLI's rerun state alone
    assert validating.max_values == {} and validating.mode == RerunMode.VALIDATE_RESULTS
    state["mode"] = RerunMode.VALIDATE_RESULTS
    validating.load_state_dict(state)
    assert validating.max_values == {"loss": 3.0}
    with pytest.raises(TypeError, match="RerunDataIterator"):
        validating.should_run_forward_backward(iter([1]))
