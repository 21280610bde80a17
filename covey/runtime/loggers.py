"""Experiment trackers beside metrics.jsonl (train.logger): trackio, Weights & Biases, TensorBoard.

Each tracker gets every line of metrics.jsonl at the line's step under the same names (docs/metrics.md):
its numbers, NaN and inf as they are where metrics.jsonl writes null. The step's sample completions
(samples.jsonl's rows) go to a table named `samples` where the tracker has tables (trackio.Table,
wandb.Table); TensorBoard has none. The packages are optional extras imported when a tracker opens; a
missing one is refused in one line naming its extra before any model loads (`missing_tracker`, which the
run's set-up calls). W&B runs offline unless the user set WANDB_MODE or an API key and the W&B server are
at hand, and says which in one line (`wandb_mode`). docs/tracking.md shows each in use.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import urlparse

from covey.runtime.http import connect_error

PACKAGES = {"trackio": "trackio", "wandb": "wandb", "tensorboard": "tensorboard"}
"""The package each tracker needs; its pip extra has the tracker's name (covey[trackio], ...)."""

SAMPLES_TABLE = "samples"
"""The name the step's sample completions are logged under, as a table."""

WANDB_SERVER = "https://api.wandb.ai"
"""W&B's server when WANDB_BASE_URL does not name another."""


@dataclass(frozen=True)
class TrackerOptions:
    """What the trackers of one run need (the run's set-up builds it from the plan)."""
    names: tuple[str, ...]
    """train.logger read: ('trackio', 'tensorboard'), ...; () = none."""
    project: str
    """train.logger_project: the trackio or W&B project."""
    run_dir: Path
    """The run folder: the tracker runs are named after it; W&B's offline files and TensorBoard's go in it."""
    resume: bool = False
    """A checkpoint of this run folder is resumed: trackio continues its run of the same name."""
    config: dict = field(default_factory=dict)
    """The run's config as config.yaml holds it (trackio's and W&B's run config)."""


def missing_tracker(names: tuple[str, ...]) -> str | None:
    """The first tracker of `names` whose package is not installed, else None."""
    return next((name for name in names if importlib.util.find_spec(PACKAGES[name]) is None), None)


def open_trackers(options: TrackerOptions) -> list:
    """One open tracker per name of `options.names`, in order."""
    kinds = {"trackio": TrackioTracker, "wandb": WandbTracker, "tensorboard": TensorBoardTracker}
    return [kinds[name](options) for name in options.names]


def numbers(metrics: dict) -> dict:
    """The numbers of one metrics line (a bool as 0 or 1); anything else is left out."""
    return {k: int(v) if isinstance(v, bool) else v for k, v in metrics.items() if isinstance(v, (int, float))}


def table_of(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, data) of samples.jsonl's rows: every key in the order first seen; a value that is not text, a
    number or None (a tool episode's messages) as its JSON text; a key a row lacks as None."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    plain = (str, int, float, type(None))
    data = [[v if isinstance(v := row.get(c), plain) else json.dumps(v) for c in columns] for row in rows]
    return columns, data


# --------------------------------------------------------------------------- W&B's mode


def wandb_api_key_found(env: Mapping[str, str]) -> bool:
    """An API key in WANDB_API_KEY, or in the netrc file `wandb login` writes, for the W&B server's host."""
    if env.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(wandb_host(env)[0]) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_host(env: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) of the W&B server: WANDB_BASE_URL's, else api.wandb.ai:443."""
    url = urlparse(env.get("WANDB_BASE_URL") or WANDB_SERVER)
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def server_answers(host: tuple[str, int], timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to `host` opens within `timeout_s`."""
    return connect_error(*host, timeout_s) is None


def wandb_mode(env: Mapping[str, str], key_found: bool, reachable: Callable[[], bool]) -> tuple[str | None, str]:
    """(the mode to give wandb.init, None where the user's WANDB_MODE stands; why, for the start-up line).

    The user's WANDB_MODE wins; else online when an API key is found and the server answers (`reachable` is
    asked only then), else offline."""
    if env.get("WANDB_MODE"):
        return None, f"mode {env['WANDB_MODE']} (WANDB_MODE)"
    if not key_found:
        return "offline", "offline (no API key: WANDB_API_KEY or `wandb login`)"
    if not reachable():
        return "offline", f"offline (no network to {wandb_host(env)[0]})"
    return "online", "online (API key found and the server answers)"


def wandb_line(why: str, mode: str | None, options: TrackerOptions) -> str:
    """The one start-up line of a W&B run."""
    where = options.run_dir / "wandb"
    if mode == "offline":
        return (f"covey: W&B {why}: the run is saved in {where}; upload it with `wandb sync {where}/offline-run-*`, "
                "or set WANDB_MODE=online to log live")
    return f"covey: W&B {why}: project {options.project}, run {options.run_dir.name}, local files in {where}"


# --------------------------------------------------------------------------- the trackers


class TrackioTracker:
    """A trackio run in trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio); the dashboard
    is `trackio show --project PROJECT`."""

    def __init__(self, options: TrackerOptions):
        import trackio
        self.trackio = trackio
        self.run = trackio.init(project=options.project, name=options.run_dir.name, config=options.config,
                                resume="allow" if options.resume else "never", embed=False, auto_log_cpu=False,
                                auto_log_gpu=False)

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        columns, data = table_of(rows)
        self.run.log({name: self.trackio.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.trackio.finish()  # the run trackio.init made current: its queued logs written to the store


class WandbTracker:
    """A Weights & Biases run; its local files (and, offline, the whole run) in <run folder>/wandb."""

    def __init__(self, options: TrackerOptions):
        import wandb
        self.wandb = wandb
        mode, why = wandb_mode(os.environ, wandb_api_key_found(os.environ),
                               lambda: server_answers(wandb_host(os.environ)))
        print(wandb_line(why, mode, options), flush=True)
        # console="off": covey's output stays as it is (no stdout wrapper; W&B prints its own lines); create_new:
        # this run whatever other W&B run the process has open (a caller's own, or a run that crashed before)
        self.run = wandb.init(project=options.project, name=options.run_dir.name, dir=str(options.run_dir),
                              config=options.config, settings=wandb.Settings(console="off"), reinit="create_new",
                              **({"mode": mode} if mode else {}))

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        columns, data = table_of(rows)
        self.run.log({name: self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """Scalars as TensorBoard events in <run folder>/tb (`tensorboard --logdir runs`); no table of samples."""

    def __init__(self, options: TrackerOptions):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(options.run_dir / "tb"))

    def log(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        """TensorBoard has no table: the samples stay in samples.jsonl."""

    def close(self) -> None:
        self.writer.close()
