"""`ArgumentsError`: every problem of a command line, reported once.

Validation collects all problems (unknown flags, rejected flags, rule violations) and raises one
`ArgumentsError`; `exit_on_arguments_error` prints them argparse-style and exits with status 2, without a
traceback, the way argparse reports a bad command line.
"""
import sys
from typing import Iterable, NoReturn, Optional, TextIO


class ArgumentsError(ValueError):
    """An invalid command line; `problems` holds one message per problem."""

    def __init__(self, problems: Iterable[str]):
        self.problems = [str(problem) for problem in problems]
        super().__init__(self.problems)

    def __str__(self) -> str:
        count = len(self.problems)
        header = f"invalid command line ({count} problem{'s' if count != 1 else ''}):"
        return "\n".join([header] + [f"  - {problem}" for problem in self.problems])


def exit_on_arguments_error(err: ArgumentsError, prog: Optional[str] = None, file: Optional[TextIO] = None) -> NoReturn:
    """Print `<prog>: error: ...` with every problem on its own line to stderr and exit with status 2."""
    prog = prog or _default_prog()
    out = file if file is not None else sys.stderr
    print(f"{prog}: error: {err}", file=out, flush=True)
    sys.exit(2)


def _default_prog() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "megatron"
    return argv0.replace("\\", "/").rsplit("/", 1)[-1]
