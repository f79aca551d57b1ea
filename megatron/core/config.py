"""The process-wide switch for Megatron Core's experimental features (`megatron.core.config`).

Code marked with `megatron.core.utils.experimental_fn` / `experimental_cls` runs only while the switch is
on. Megatron-LM turns it on from `--enable-experimental`; library users call `set_experimental_flag(True)`.
It is a module attribute, as in Megatron, so `megatron.core.config.ENABLE_EXPERIMENTAL` reads the current
value.
"""

ENABLE_EXPERIMENTAL = False
"""True while experimental features may run."""


def set_experimental_flag(flag: bool) -> None:
    """Turn experimental features on (True) or off (False) for this process."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = flag


def is_experimental_enabled() -> bool:
    """The current value of the experimental switch."""
    return ENABLE_EXPERIMENTAL


__all__ = ["ENABLE_EXPERIMENTAL", "set_experimental_flag", "is_experimental_enabled"]
