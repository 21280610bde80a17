"""Metric logging: one JSON line per step, sample completions, progress bar, memory; files
written whole or not at all. The experiment trackers of train.logger (covey/runtime/loggers.py)
get the same lines.

Metric names are fixed and documented in docs/metrics.md. `make_run_dir` makes the run folder they go in.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

from covey.runtime.loggers import SAMPLES_TABLE, numbers

# Fields that legitimately differ between two runs of the same seed.
NONDETERMINISTIC_PREFIXES = ("time/", "memory/", "throughput/")


class LogMismatchError(RuntimeError):
    """The run's log files no longer match the checkpoint being resumed."""


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return float("nan")


def _clean(value):
    """JSON-safe floats: NaN/inf become null so the file stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends to runs/<name>/metrics.jsonl and samples.jsonl; `trackers` (covey.runtime.loggers.open_trackers)
    get the same metrics and samples."""

    def __init__(self, run_dir: Path, trackers: list | tuple = ()):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.trackers = list(trackers)

    def positions(self) -> dict:
        """Byte length of each log file, flushed to disk (a checkpoint stores it)."""
        out = {}
        for path in (self.metrics_path, self.samples_path):
            if path.exists():
                with path.open("rb") as f:
                    os.fsync(f.fileno())
            out[path.name] = path.stat().st_size if path.exists() else 0
        return out

    def truncate_to(self, positions: dict) -> None:
        """On resume, cut each log back to the length it had when the checkpoint was written.

        This drops every line (even a half-written one) of the steps redone after the checkpoint.
        """
        for path in (self.metrics_path, self.samples_path):
            keep = int(positions.get(path.name, 0))
            size = path.stat().st_size if path.exists() else 0
            if size < keep:
                raise LogMismatchError(f"{path} is shorter ({size} bytes) than when the checkpoint was "
                                   f"written ({keep} bytes): the log was edited or lost")
            if size > keep:
                os.truncate(path, keep)

    def reset(self) -> None:
        """A fresh run owns its log files: start them empty."""
        for path in (self.metrics_path, self.samples_path):
            path.unlink(missing_ok=True)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(step, numbers(metrics))

    def log_samples(self, step: int, rows: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        for tracker in self.trackers:
            tracker.log_table(step, SAMPLES_TABLE, rows)

    def close(self) -> None:
        """The trackers' runs finished (the run's end); the files need no closing."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_whole(path: str | Path, text: str) -> None:
    """`text` into `path` through a temporary sibling renamed over it: a reader sees the old file or
    the new one, never half of it, and a failed write leaves no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def make_run_dir(run_dir: Path, unique: bool) -> Path:
    """Make the run folder. `unique` (a name from the start time, one process): a folder another run made in
    the same second is not shared; this run takes <name>-2, -3, ... (mkdir claims it atomically)."""
    if not unique:
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{run_dir}: 999 runs of this name already; set train.run_name")
