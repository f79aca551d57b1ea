"""Run a function on N gloo ranks on CPU, the way every multi-rank test in this project does.

`run_on_ranks(fn, world_size, *args, **kwargs)` starts `world_size` processes, joins them into one
gloo process group through a `file://` rendezvous in a fresh temp dir (no ports), calls
`fn(*args, **kwargs)` on each rank and returns the per-rank results (index = rank). If any rank
raises, every rank's traceback is put into one AssertionError. If the ranks do not finish within
`timeout` seconds, they are killed and the stacks of the stuck ranks (dumped by faulthandler just
before the deadline) are reported.

The ranks never see a GPU (`CUDA_VISIBLE_DEVICES` is empty for them unless `env` sets it): they are the
CPU runs that CI makes, also on a machine with GPUs, where the device RNG tracker would otherwise track the
CUDA generator while the tensors of the test live on the CPU.

`fn` must be a module-level function (it is pickled for the child processes). Process start costs a
few seconds on a 2-core machine, so put many checks into one launch.
"""
import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT = float(os.environ.get("MEGATRON_TEST_TIMEOUT", "600"))


def _child(fn, rank, world_size, init_file, result_queue, stack_file, timeout, args, kwargs):
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    with open(stack_file, "w") as stack_out:
        faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False, file=stack_out)
        try:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group(
                backend="gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
            result = fn(*args, **kwargs)
            # Plain pickle bytes, not the queue's pickler: torch's multiprocessing reductions would send tensors as
            # shared-memory handles that vanish when this rank exits before the parent has read them.
            try:
                payload = pickle.dumps(result)
            except Exception:
                payload = pickle.dumps(repr(result))
            result_queue.put(("ok", rank, payload))
        except BaseException:
            result_queue.put(("error", rank, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
            _teardown()


def _teardown():
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_on_ranks(fn, world_size, *args, timeout=None, env=None, start_method=None, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the list of per-rank results."""
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    _refuse_inherited_process_group()
    # On a machine with a GPU, forked ranks fail as soon as they touch CUDA (the RNG tracker does) or run
    # autograd once this process has used CUDA, which earlier tests in the same process may have done.
    default_method = "spawn" if _cuda_present() else "fork"
    start_method = start_method or os.environ.get("MEGATRON_TEST_START_METHOD", default_method)
    ctx = mp.get_context(start_method)
    env = {"CUDA_VISIBLE_DEVICES": "", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="megatron_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        result_queue = ctx.Queue()
        procs, stack_files = [], []
        with _environment(env), inherited_objects_frozen(start_method):  # the ranks start with it, before any import
            for rank in range(world_size):
                stack_file = os.path.join(tmp, f"stack_{rank}.txt")
                stack_files.append(stack_file)
                proc = ctx.Process(
                    target=_child,
                    args=(fn, rank, world_size, init_file, result_queue, stack_file, timeout, args, kwargs),
                    daemon=False,
                )
                proc.start()
                procs.append(proc)
        results, errors = _collect(procs, result_queue, world_size, timeout)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        if errors:
            details = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{len(errors)} of {world_size} ranks failed in {fn.__name__}:\n{details}")
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            stacks = "\n".join(f"----- rank {r} stack -----\n{_read(stack_files[r])}" for r in missing)
            raise AssertionError(
                f"ranks {missing} of {fn.__name__} did not finish within {timeout:.0f}s (or died):\n{stacks}"
            )
        return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def inherited_objects_frozen(start_method):
    """Inside the block, processes forked from this one never run the garbage collector over what they inherit.

    Garbage left by earlier tests of this process (a process group or store in a reference cycle) would otherwise
    be collected in the child, where its C++ destructor waits for worker threads that were not forked: the child
    then hangs in an innocent allocation, holding the GIL. The garbage is collected here first (where those
    threads exist), and what is left is frozen (`gc.freeze`) while the children are forked."""
    if start_method != "fork":
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _environment(env):
    """`os.environ` updated with `env` inside the block, restored after it."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _refuse_inherited_process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "run_on_ranks: this test process already has a torch.distributed process group; forked ranks "
            "would inherit it. Destroy it (torch.distributed.destroy_process_group()) before launching ranks."
        )


def _collect(procs, result_queue, world_size, timeout):
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        try:
            status, rank, payload = result_queue.get(timeout=0.2)
        except queue_mod.Empty:
            if errors:
                # One rank failed; give the others a moment to report, then stop waiting on them.
                time.sleep(2.0)
                _drain(result_queue, results, errors)
                break
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results and i not in errors]
            if dead and result_queue.empty():
                time.sleep(0.5)
                _drain(result_queue, results, errors)
                for i in dead:
                    if i not in results and i not in errors:
                        errors[i] = f"process exited with code {procs[i].exitcode} without reporting"
            continue
        (results if status == "ok" else errors)[rank] = pickle.loads(payload) if status == "ok" else payload
    for proc in procs:
        if proc.is_alive() and (errors or time.monotonic() >= deadline):
            proc.terminate()
    return results, errors


def _drain(result_queue, results, errors):
    while True:
        try:
            status, rank, payload = result_queue.get_nowait()
        except queue_mod.Empty:
            return
        (results if status == "ok" else errors)[rank] = pickle.loads(payload) if status == "ok" else payload


def _read(path):
    try:
        with open(path) as f:
            return f.read() or "(no stack dumped)"
    except OSError:
        return "(no stack file)"


def load_interpreted(path, name):
    """A fresh copy of the module at `path` whose Triton kernels run in Triton's interpreter (numpy, on CPU
    tensors): the module is executed with TRITON_INTERPRET=1 set, which Triton reads when `@triton.jit` runs."""
    import importlib.util

    with _environment({"TRITON_INTERPRET": "1"}):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def repo_root():
    """Absolute path of the repository root (the folder holding pretrain_gpt.py)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_executable():
    return sys.executable


def tp_slice(param, full):
    """This rank's tensor-parallel shard of `full` (the single-process tensor) for `param`, or `full` itself
    when `param` is not split over tensor parallelism."""
    import torch

    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return torch.chunk(full, tp, dim=param.partition_dim)[rank]


def assert_case_reports(cases, results):
    """Check per-rank case reports of a parity launch: `results[rank][index]` is a dict with `problems` (list of
    strings), `names` (the parameter names this rank compared), `ref_names` (all names of the single-process
    model) and `has_losses`. Every rank must report no problem, the ranks together must cover every parameter,
    and some rank must have computed the losses."""
    for index, case in enumerate(cases):
        per_rank = [r[index] for r in results]
        assert all(not r["problems"] for r in per_rank), [p for r in per_rank for p in r["problems"]]
        covered = set().union(*(r["names"] for r in per_rank))
        assert covered == per_rank[0]["ref_names"], (case["name"], per_rank[0]["ref_names"] ^ covered)
        assert any(r["has_losses"] for r in per_rank), case["name"]
