"""Learning-rate and weight-decay schedule applied to an optimizer's param groups.

`OptimizerParamScheduler` counts steps in whatever unit the caller uses (Megatron's training loop
uses samples: every successful step advances it by the global batch size). After each `step` it
writes `lr = get_lr(group) * group['lr_mult']` and `weight_decay = get_wd() * group['wd_mult']`
into every param group; groups may carry their own `max_lr` / `min_lr` (decoupled embedding LR).

Note warm-up boundary: warm-up covers `num_steps <= lr_warmup_steps` (inclusive), so the LR at
exactly `lr_warmup_steps` is `max_lr` from the warm-up formula.
Note construction: the constructor calls `step(0)`, so the LR before the first optimizer step is
`init_lr` when there is a warm-up and `max_lr` otherwise.
"""
import logging
import math
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_WD_INCR_STYLES = ("constant", "linear", "cosine")


def _validate_settings(s: "OptimizerParamScheduler") -> None:
    """Collect every inconsistent setting and raise one ValueError naming the flags."""
    errors = []
    if s.min_lr < 0.0:
        errors.append(f"--min-lr ({s.min_lr}) must be >= 0")
    if s.max_lr < s.min_lr:
        errors.append(f"--lr ({s.max_lr}) must be >= --min-lr ({s.min_lr})")
    if s.init_lr > s.max_lr:
        errors.append(f"--lr-warmup-init ({s.init_lr}) must be <= --lr ({s.max_lr})")
    if s.lr_decay_steps <= 0:
        errors.append(f"the LR decay steps ({s.lr_decay_steps}) must be > 0: set --lr-decay-iters/--lr-decay-samples")
    if s.lr_warmup_steps >= s.lr_decay_steps:
        errors.append(
            f"the LR warm-up steps ({s.lr_warmup_steps}) must be < the LR decay steps ({s.lr_decay_steps}): "
            "shorten --lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction"
        )
    if s.lr_decay_style not in _LR_DECAY_STYLES:
        errors.append(f"--lr-decay-style ({s.lr_decay_style!r}) must be one of {list(_LR_DECAY_STYLES)}")
    if s.lr_decay_style == "WSD":
        if s.wsd_decay_steps is None:
            errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        if s.lr_wsd_decay_style not in _WSD_DECAY_STYLES:
            errors.append(f"--lr-wsd-decay-style ({s.lr_wsd_decay_style!r}) must be one of {list(_WSD_DECAY_STYLES)}")
    if s.start_wd < 0.0:
        errors.append(f"--start-weight-decay ({s.start_wd}) must be >= 0")
    if s.end_wd < s.start_wd:
        errors.append(f"--end-weight-decay ({s.end_wd}) must be >= --start-weight-decay ({s.start_wd})")
    if s.wd_incr_style not in _WD_INCR_STYLES:
        errors.append(f"--weight-decay-incr-style ({s.wd_incr_style!r}) must be one of {list(_WD_INCR_STYLES)}")
    elif s.wd_incr_style == "constant" and s.start_wd != s.end_wd:
        errors.append(
            f"--weight-decay-incr-style constant needs --start-weight-decay ({s.start_wd}) == "
            f"--end-weight-decay ({s.end_wd})"
        )
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        errors.append(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive: "
            "pass only one"
        )
    if errors:
        raise ValueError("invalid learning-rate schedule: " + "; ".join(errors))


class OptimizerParamScheduler:
    """Anneals the learning rate and increments the weight decay of `optimizer`'s param groups."""

    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        _validate_settings(self)
        self.step(0)
        logger.info("> learning rate decay style: %s", self.lr_decay_style)

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        else:
            raise ValueError(f"{self.wd_incr_style} weight decay increment style is not supported")
        return self.start_wd + coeff * delta_wd

    def get_lr(self, param_group: Dict[str, Any]) -> float:
        """Learning rate of `param_group` at the current step (before `lr_mult`)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / num_steps**0.5)
        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == "WSD":
            coeff = self._wsd_coeff()
        else:
            raise ValueError(f"{self.lr_decay_style} decay style is not supported")
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self) -> float:
        """Warmup-stable-decay: 1 in the stable phase, then the annealing curve over `wsd_decay_steps`."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        if self.lr_wsd_decay_style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        raise ValueError(f"{self.lr_wsd_decay_style} WSD decay style is not supported")

    def step(self, increment: int) -> None:
        """Advance by `increment` steps and write lr / weight_decay into every param group."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for param_group in self.optimizer.param_groups:
            new_lr = self.get_lr(param_group)
            param_group["lr"] = new_lr * param_group.get("lr_mult", 1.0)
            param_group["weight_decay"] = new_wd * param_group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's keys; plain numbers and strings only (weights_only-loadable)."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value, sd_value, name: str):
        """Pick the command-line or the checkpoint value of one setting.

        Override wins with the command-line value; use-checkpoint takes the checkpoint value; with
        neither, the two must be equal.
        """
        if self.override_opt_param_scheduler:
            logger.info(" > overriding %s value to %s", name, cls_value)
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: class input value {cls_value} and checkpoint value {sd_value} for "
                f"{name} do not match: pass the checkpoint's value on the command line, or "
                "--override-opt_param-scheduler to use the command-line value, or "
                "--use-checkpoint-opt_param-scheduler to use the checkpoint's value"
            )
        logger.info(" > using checkpoint value %s for %s", sd_value, name)
        return sd_value

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the schedule; also reads the key names of older Megatron checkpoints."""
        max_lr = state_dict["start_lr"] if "start_lr" in state_dict else state_dict["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr, "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "minimum learning rate")
        warmup = _first_present(state_dict, ("warmup_iter", "warmup_steps", "lr_warmup_steps"))
        self.lr_warmup_steps = self._check_and_set(self.lr_warmup_steps, warmup, "warmup iterations")
        decay_steps = _first_present(state_dict, ("end_iter", "decay_steps", "lr_decay_steps"))
        self.lr_decay_steps = self._check_and_set(self.lr_decay_steps, decay_steps, "total number of iterations")
        decay_style = _first_present(state_dict, ("decay_style", "lr_decay_style"))
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, decay_style, "learning rate decay style")
        num_steps = _first_present(state_dict, ("num_iters", "num_steps"))
        self.step(increment=num_steps)
        if "start_wd" in state_dict:
            self.start_wd = self._check_and_set(self.start_wd, state_dict["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, state_dict["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps, state_dict["wd_incr_steps"], "total number of weight decay iterations"
            )
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, state_dict["wd_incr_style"], "weight decay incr style"
            )


def _first_present(state_dict: Dict[str, Any], keys) -> Any:
    for key in keys:
        if key in state_dict:
            return state_dict[key]
    raise KeyError(f"optimizer param scheduler state has none of the keys {list(keys)}")
