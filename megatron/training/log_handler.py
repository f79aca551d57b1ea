"""Logging setup for a run: the level from --logging-level or MEGATRON_LOGGING_LEVEL, one stream handler.

`CustomHandler` keeps third-party library chatter out of the training output: it passes records from
`megatron` loggers (and warnings or worse from anyone else).
"""
import logging
import os
import sys

_FORMAT = "[%(asctime)s] %(levelname)s:%(name)s: %(message)s"


class CustomHandler(logging.StreamHandler):
    """A stdout handler that drops records below WARNING from loggers outside `megatron`."""

    def __init__(self):
        super().__init__(stream=sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        # Follow sys.stdout as it is now (tests and notebooks replace it after logging was set up).
        self.stream = sys.stdout
        super().emit(record)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("megatron") or record.levelno >= logging.WARNING:
            return super().filter(record)
        return False


def setup_logging(logging_level=None) -> None:
    """Configure the root logger once; `logging_level` (an int, from --logging-level) wins over the env."""
    level = logging_level
    if level is None:
        env_level = os.getenv("MEGATRON_LOGGING_LEVEL")
        level = int(env_level) if env_level else logging.INFO
    root = logging.getLogger()
    root.setLevel(level)
    if not any(isinstance(h, CustomHandler) for h in root.handlers):
        handler = CustomHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
