"""Bookkeeping of the rerun state machine that needs no state machine: `QuickStats` (the determinism
statistics of `--rerun-mode report_stats`) and the reading of the result-rejected tracker file
(`--result-rejected-tracker-filename`), whose lines `RerunStateMachine` writes as
`ts=... node=... device=... jobID=... rank=... iteration=... status=... result=... message='...'`.
"""
import logging
import re
from collections import defaultdict
from typing import Dict, List

logger = logging.getLogger(__name__)


class QuickStats:
    """Distribution of a non-negative statistic: zeros counted, other samples kept (up to `max_size`, then
    overwritten round-robin), and the maximum."""

    def __init__(self, max_size: int = 100000) -> None:
        self.samples: List[float] = []
        self.pos: int = 0
        self.zero_cnt: int = 0
        self.max: float = 0.0
        self.max_size: int = max_size

    def record(self, data: float) -> None:
        """Add one sample."""
        if data == 0.0:
            self.zero_cnt += 1
            return
        if self.pos < self.max_size:
            self.samples.append(data)
        else:
            self.samples[self.pos % self.max_size] = data
        self.pos += 1
        self.max = max(self.max, data)

    def combine(self, others: List["QuickStats"]) -> None:
        """Merge other instances in (their samples only while the total fits in `max_size`)."""
        if not others:
            return
        total = len(self.samples) + sum(len(o.samples) for o in others)
        if total <= self.max_size:
            for other in others:
                self.samples.extend(other.samples)
            self.pos = total
        self.zero_cnt += sum(o.zero_cnt for o in others)
        self.max = max(self.max, max(o.max for o in others))

    def reset(self) -> None:
        """Forget every sample."""
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0

    def print_stats(self) -> str:
        """One line: total/identical counts, mean relative variability, p50/p90/p99/p99.9 and max."""
        self.samples.sort()
        zeros, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{zeros:,} samples, all identical"
        total = zeros + n
        mean = sum(self.samples) / total
        quantiles = {}
        for p in (0.5, 0.9, 0.99, 0.999):
            index = int(total * p) - zeros
            quantiles[p] = f"{self.samples[index]:.3E}" if index >= 0 else "0.0"
        return (f"{total:,}/{zeros:,} total/identical samples, rel. variability: avg= {mean:.3E}, "
                f"p50= {quantiles[0.5]}, p90= {quantiles[0.9]}, p99= {quantiles[0.99]}, "
                f"p99.9= {quantiles[0.999]}, max: {self.max:.3E}")


_LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result=.+ message=.+")
_SKIPPABLE = ("RERUN_DISABLED", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")


def skipped_iterations(tracker_file_name: str) -> List[int]:
    """Iterations to skip according to a tracker file: those rejected twice on one rank with re-runs disabled,
    or found reproducible by a re-run, except iterations rejected on several ranks of one job (the data of an
    iteration sits on one rank). An unreadable file yields none (with an error logged)."""
    candidates, ignored, seen = set(), set(), set()
    ranks_by_job: Dict[str, Dict[int, set]] = defaultdict(lambda: defaultdict(set))
    try:
        with open(tracker_file_name, "r") as f:
            for line in f:
                match = _LINE.search(line)
                if not match or match[4].split(".")[-1].upper() not in _SKIPPABLE:
                    continue
                job, rank, iteration = match[1], int(match[2]), int(match[3])
                if (rank, iteration) in seen:
                    candidates.add(iteration)
                seen.add((rank, iteration))
                ranks_by_job[job][iteration].add(rank)
                if len(ranks_by_job[job][iteration]) > 1:
                    ignored.add(iteration)
    except (OSError, ValueError) as error:
        logger.error("Could not parse iterations to skip in tracker file! (%s)", error)
    skipped = sorted(candidates - ignored)
    logger.warning("Will skip these iterations from tracker file: %s", skipped)
    if ignored:
        logger.warning("Will not skip these iterations due to multiple rank errors: %s", sorted(ignored))
    return skipped
