"""Per-run monitors of the training loop that Megatron-LM runs around its iterations:

- `--log-straggler` (with `--disable-straggler-on-startup`, `--straggler-ctrlr-port`, `--straggler-minmax-count`):
  the `StragglerDetector` singleton is configured at the start of training and reports the slowest and fastest
  ranks every `--log-interval` iterations, from the FLOPs of those iterations;
- `--check-weight-hash-across-dp-replicas-interval N`: every N iterations the data-parallel replicas must hold
  identical weights (`check_param_hashes_across_dp_replicas`, cross-checked), else training stops with an error;
- `--log-energy`: the `EnergyMonitor` runs during training (paused for evaluation); the training log line reports
  energy and power per GPU, and the total is printed at the end.
"""
import torch

from megatron.core.utils import StragglerDetector, check_param_hashes_across_dp_replicas
from megatron.training.global_vars import get_energy_monitor
from megatron.training.utils import print_rank_0


class TrainingMonitors:
    """The monitors of one `train()` call; every method is called on every rank."""

    def __init__(self, args, model):
        self.args = args
        self.model = model
        self.flops_since_report = 0.0
        self.straggler = StragglerDetector() if args.log_straggler else None
        if self.straggler is not None:
            self.straggler.configure(torch.distributed.get_world_size(), torch.distributed.get_rank(),
                                     mmcnt=args.straggler_minmax_count, port=args.straggler_ctrlr_port,
                                     enabled=not args.disable_straggler_on_startup)
        self.energy = get_energy_monitor() if args.log_energy else None
        if self.energy is not None:
            self.energy.setup()
            self.energy.resume()

    def after_iteration(self, iteration: int, flops: float) -> None:
        """After iteration `iteration` (counted from 1) of `flops` FLOPs: straggler report, weight-hash check."""
        self.flops_since_report += flops
        if self.straggler is not None and iteration % self.args.log_interval == 0:
            self.straggler.report(self.flops_since_report, self.args.log_interval)
            self.flops_since_report = 0.0
        interval = self.args.check_weight_hash_across_dp_replicas_interval
        if interval is not None and iteration % interval == 0:
            self.check_weight_hashes(iteration)

    def check_weight_hashes(self, iteration: int) -> None:
        """Raise RuntimeError unless every DP replica holds the same weights (parameter gathers with
        --overlap-param-gather are finished first, as Megatron does by switching the pre-hooks off)."""
        args = self.args
        gathers_params = args.use_distributed_optimizer and args.overlap_param_gather
        if gathers_params:
            for chunk in self.model:
                chunk.disable_forward_pre_hook()
        matching = check_param_hashes_across_dp_replicas(self.model, cross_check=True)
        if gathers_params:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
        if not matching:
            raise RuntimeError(f"Parameter hashes not matching across DP replicas after {iteration} iterations "
                               f"(--check-weight-hash-across-dp-replicas-interval): the replicas diverged.")
        torch.distributed.barrier()
        print_rank_0(f">>> Weight hashes match after {iteration} iterations...")

    def pause(self) -> None:
        """Before evaluation: stop counting energy."""
        if self.energy is not None:
            self.energy.pause()

    def resume(self) -> None:
        """After evaluation."""
        if self.energy is not None:
            self.energy.resume()

    def finish(self) -> None:
        """End of training: print the total energy."""
        if self.energy is not None:
            self.energy.lap()
            print_rank_0(f"Total training energy (GPU): {self.energy.get_total() / 1e6} MJ")
            self.energy.shutdown()
