"""train.logger's experiment trackers (covey/runtime/loggers.py) and docs/tracking.md.

First what needs no tracker package: the key's values, the one-line error of a tracker that is not
installed, W&B's mode and its start-up line, the rows a tracker is handed. Then the page's commands run
as written on the tiny model (each `covey train` in a fresh interpreter, 2 steps, trackio's store and
W&B's files in a temporary folder): each tracker holds metrics.jsonl's names and values and the table of
samples, read back through the tracker's own reader, and trackio's dashboard, opened in headless
Chromium, draws the run's curves. trackio is in the `test` extra; the runs of W&B and TensorBoard skip,
saying so, where wandb or tensorboard is not installed, and the dashboard's test where no Chromium is.
"""

import importlib.util
import json
import math
import os
import re
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest

from covey.cli.main import main
from covey.config import ConfigError, load_config, parse_loggers
from covey.runtime.loggers import (
    PACKAGES,
    TrackerOptions,
    numbers,
    server_answers,
    table_of,
    wandb_api_key_found,
    wandb_host,
    wandb_line,
    wandb_mode,
)
from covey.runtime.metrics import MetricsLogger
from tests.helpers import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "tracking.md").read_text()
COMMANDS = [line for block in re.findall(r"```bash\n(.*?)```", DOC, re.S)
            for line in block.splitlines() if line.strip()]
TRAIN = [c for c in COMMANDS if c.startswith("covey train ")]
OTHERS = [c for c in COMMANDS if not c.startswith("covey train ")]
BIN = Path(sys.executable).parent  # the trackers' own commands (trackio, wandb, tensorboard) beside this Python
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


# --------------------------------------------------------------------------- the key


@pytest.mark.parametrize("spec, names", [
    ("none", ()), ("jsonl", ()), ("trackio", ("trackio",)), ("wandb", ("wandb",)),
    ("trackio,tensorboard", ("trackio", "tensorboard")), (" WandB , trackio ", ("wandb", "trackio")),
])
def test_train_logger_names_none_one_or_several_trackers(spec, names):
    from covey.training.plan import make_plan
    cfg = load_config(None, [f"train.logger={spec}", "train.logger_project=p"])
    assert parse_loggers(cfg.train.logger) == names
    assert (make_plan(cfg).run.logger, make_plan(cfg).run.logger_project) == (names, "p")


def test_no_tracker_by_default():
    cfg = load_config(None)
    assert (cfg.train.logger, parse_loggers(cfg.train.logger), cfg.train.logger_project) == ("none", (), "covey")


@pytest.mark.parametrize("spec, why", [
    ("mlflow", "mlflow: choose none or one or more of trackio, wandb, tensorboard, comma-separated "
               "(e.g. trackio,tensorboard)"),
    ("trackio,mlflow,x", "mlflow, x: choose none or one or more of trackio, wandb, tensorboard, comma-separated "
                         "(e.g. trackio,tensorboard)"),
    ("", "empty: choose none or one or more of trackio, wandb, tensorboard, comma-separated "
         "(e.g. trackio,tensorboard)"),
    ("trackio,trackio", "a tracker is named twice"),
    ("none,trackio", "none names no tracker: it stands alone"),
])
def test_a_bad_train_logger_is_one_line_naming_the_key(spec, why):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.logger={spec}"])
    assert str(err.value) == f"train.logger={spec!r}: {why}"


@pytest.mark.parametrize("setting, missing", [
    ("trackio", "trackio"), ("wandb", "wandb"), ("tensorboard", "tensorboard"), ("trackio,wandb", "wandb"),
])
def test_a_tracker_not_installed_is_one_line_before_the_model_loads(setting, missing, monkeypatch, tmp_path, capsys):
    """model.path names no model: the line comes before any model is looked for, and no run folder is made."""
    real = importlib.util.find_spec
    named = {PACKAGES[n] for n in setting.split(",")}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (None if name == missing else object())
                        if name in named else real(name, *a))
    code = main(["train", *tiny_overrides("no-such-model", tmp_path), f"train.logger={setting}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"covey train: error: train.logger={setting} needs the optional "
                                               f"package {missing}: pip install 'covey[{missing}]'")
    assert not (tmp_path / "t").exists()


# --------------------------------------------------------------------------- W&B's mode


def never_asked():
    raise AssertionError("the W&B server was asked without an API key, or with WANDB_MODE set")


@pytest.mark.parametrize("env, key_found, reachable, expected", [
    ({"WANDB_MODE": "online"}, False, never_asked, (None, "mode online (WANDB_MODE)")),
    ({"WANDB_MODE": "disabled"}, True, never_asked, (None, "mode disabled (WANDB_MODE)")),
    ({}, False, never_asked, ("offline", "offline (no API key: WANDB_API_KEY or `wandb login`)")),
    ({}, True, lambda: False, ("offline", "offline (no network to api.wandb.ai)")),
    ({"WANDB_BASE_URL": "http://wandb.lab:8080"}, True, lambda: False,
     ("offline", "offline (no network to wandb.lab)")),
    ({}, True, lambda: True, ("online", "online (API key found and the server answers)")),
])
def test_wandb_is_offline_unless_told_or_the_server_is_at_hand(env, key_found, reachable, expected):
    assert wandb_mode(env, key_found, reachable) == expected


def test_wandb_server_address():
    assert wandb_host({}) == ("api.wandb.ai", 443)
    assert wandb_host({"WANDB_BASE_URL": "http://wandb.lab"}) == ("wandb.lab", 80)
    assert wandb_host({"WANDB_BASE_URL": "https://wandb.lab:8443/"}) == ("wandb.lab", 8443)


def test_wandb_api_key_from_the_environment_or_netrc(tmp_path):
    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai login user password 0123abcd\n")
    rc.chmod(0o600)
    assert wandb_api_key_found({"WANDB_API_KEY": "k", "NETRC": str(tmp_path / "none")})
    assert wandb_api_key_found({"NETRC": str(rc)})
    assert not wandb_api_key_found({"NETRC": str(rc), "WANDB_BASE_URL": "https://wandb.lab"})  # another host's key
    assert not wandb_api_key_found({"NETRC": str(tmp_path / "none")})  # no file


def test_server_answers_a_listening_port_only():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert server_answers(("127.0.0.1", port), timeout_s=2)
    assert not server_answers(("127.0.0.1", port), timeout_s=2)  # closed now: refused at once


def test_the_offline_line_names_the_folder_and_how_to_upload(tmp_path):
    options = TrackerOptions(("wandb",), "covey", tmp_path / "r1")
    why = "offline (no API key: WANDB_API_KEY or `wandb login`)"
    assert wandb_line(why, "offline", options) == (
        f"covey: W&B {why}: the run is saved in {tmp_path}/r1/wandb; upload it with "
        f"`wandb sync {tmp_path}/r1/wandb/offline-run-*`, or set WANDB_MODE=online to log live")
    assert wandb_line("mode online (WANDB_MODE)", None, options) == (
        f"covey: W&B mode online (WANDB_MODE): project covey, run r1, local files in {tmp_path}/r1/wandb")


# --------------------------------------------------------------------------- what a tracker is handed


def test_a_tracker_gets_the_numbers_of_a_line():
    got = numbers({"a": 1, "b": 2.5, "c": float("nan"), "d": None, "e": "text", "f": True, "g": [1]})
    assert set(got) == {"a", "b", "c", "f"} and (got["a"], got["b"], got["f"]) == (1, 2.5, 1)
    assert math.isnan(got["c"])  # metrics.jsonl writes it as null


def test_samples_become_a_table():
    rows = [{"prompt": "1+1", "answer": "2", "completion": "2", "reward": 1.0},
            {"prompt": "2+2", "answer": None, "completion": "x", "reward": 0.0,
             "messages": [{"role": "user", "content": "hi"}]}]
    assert table_of(rows) == (["prompt", "answer", "completion", "reward", "messages"],
                              [["1+1", "2", "2", 1.0, None],
                               ["2+2", None, "x", 0.0, '[{"role": "user", "content": "hi"}]']])


class Recorder:
    """A tracker that writes down what it is handed."""

    def __init__(self):
        self.calls = []

    def log(self, step, values):
        self.calls.append(("log", step, values))

    def log_table(self, step, name, rows):
        self.calls.append(("table", step, name, rows))

    def close(self):
        self.calls.append(("close",))


def test_the_metrics_logger_hands_each_line_and_the_samples_to_its_trackers(tmp_path):
    recorder = Recorder()
    logger = MetricsLogger(tmp_path, [recorder])
    logger.log(1, {"reward/mean": 0.5, "kl/ref": float("nan"), "note": "text"})
    rows = [{"prompt": "1+1", "completion": "2", "reward": 1.0}]
    logger.log_samples(1, rows)
    logger.close()
    logger.close()  # a second close finishes nothing twice
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "kl/ref": None, "note": "text",
                                                                    "reward/mean": 0.5}
    (kind, step, values), table, close = recorder.calls
    assert (kind, step, values["reward/mean"], set(values)) == ("log", 1, 0.5, {"reward/mean", "kl/ref"})
    assert math.isnan(values["kl/ref"])
    assert table == ("table", 1, "samples", rows) and close == ("close",)


# --------------------------------------------------------------------------- the page's runs


@pytest.fixture(scope="module")
def page(tiny_model_dir, tmp_path_factory):
    """Every `covey train` line of docs/tracking.md whose trackers are installed, run in a fresh interpreter with
    the tiny model's settings added; W&B without a key (so offline), every tracker's files in a temporary folder."""
    home = tmp_path_factory.mktemp("tracking")
    (home / "netrc").write_text("")
    env = {**os.environ, "TRACKIO_DIR": str(home / "trackio"), "NETRC": str(home / "netrc"), "PYTHONUNBUFFERED": "1",
           **{key: str(home / "wandb-home") for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}}
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "TRACKIO_SERVER_URL", "TRACKIO_SPACE_ID"):
        env.pop(key, None)
    runs = {}
    for command in TRAIN:
        args = shlex.split(command)[1:]
        own = dict(a.split("=", 1) for a in args[1:])
        name, trackers = own["train.run_name"], parse_loggers(own["train.logger"])
        lacking = [t for t in trackers if not installed(PACKAGES[t])]
        if lacking:
            runs[name] = f"`{command}` not run: pip install 'covey[{lacking[0]}]' to run it"
            continue
        tiny = [o for o in tiny_overrides(tiny_model_dir, home / "runs") if o.split("=", 1)[0] not in own]
        done = subprocess.run([sys.executable, "-m", "covey.cli", *args, *tiny], cwd=home, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        run_dir = home / "runs" / name
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        runs[name] = SimpleNamespace(dir=run_dir, out=done.stdout, trackers=trackers, lines=lines, samples=samples)
    return SimpleNamespace(home=home, env=env, runs=runs)


def ran(page, name: str):
    run = page.runs[name]
    if isinstance(run, str):
        pytest.skip(run)
    return run


def by_step(lines: list[dict]) -> dict:
    """{(step, name): value} of metrics.jsonl's lines (a name is on one line of a step)."""
    out = {}
    for line in lines:
        for key, value in line.items():
            if key != "step":
                assert (line["step"], key) not in out
                out[(line["step"], key)] = value
    return out


def same(expected, got) -> bool:
    """A value of metrics.jsonl (null for NaN) and the tracker's (float32 in TensorBoard's events)."""
    if expected is None:
        return got is None or math.isnan(got)
    return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)


def tracker(command: list[str]) -> list[str]:
    """A tracker's own command (trackio, wandb, tensorboard) run by the binary installed beside this Python."""
    return [str(BIN / command[0]), *command[1:]]


def trackio_store(page, run) -> tuple[dict, list[dict]]:
    """({(step, name): value}, the samples table's rows by step) as trackio's CLI reads its store back."""
    done = subprocess.run(tracker(["trackio", "get", "snapshot", "--project", "covey", "--run", run.dir.name,
                                   "--around", "1", "--window", "1000", "--json"]),
                          env=page.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    stored, tables = {}, []
    for name, points in json.loads(done.stdout)["metrics"].items():
        for point in points:
            if name == "samples":
                tables += [{"step": point["step"], **row} for row in point["value"]["_value"]]
            else:
                stored[(point["step"], name)] = point["value"]
    return stored, tables


def wandb_store(run) -> tuple[dict, list[dict]]:
    """The same from the offline W&B run's files. Its .wandb file is LevelDB's log format, after a 7-byte header
    (':W&B', 0xBEE1, version 0): 32 KiB blocks of chunks (crc 4 bytes, length 2 little-endian, type 1 full, 2
    first, 3 middle, 4 last), each record a wandb_internal_pb2.Record; a history record is one logged row."""
    from wandb.proto import wandb_internal_pb2
    folder = next((run.dir / "wandb").glob("offline-run-*"))
    data, pos, chunk, stored, tables = next(folder.glob("run-*.wandb")).read_bytes(), 7, b"", {}, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                stored.update({(row["_step"], k): v for k, v in row.items()
                               if not k.startswith(("_", "samples/"))})
                if "samples/path" in row:  # the table, in a file of its own
                    table = json.loads((folder / "files" / row["samples/path"]).read_text())
                    tables += [{"step": row["_step"], **dict(zip(table["columns"], r))} for r in table["data"]]
    return stored, tables


def tensorboard_store(run) -> tuple[dict, list[dict]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run.dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}, []


READERS = {"trackio": lambda page, run: trackio_store(page, run), "wandb": lambda page, run: wandb_store(run),
           "tensorboard": lambda page, run: tensorboard_store(run)}


@pytest.mark.parametrize("name, kind", [(t.split("train.run_name=")[1].split()[0], kind) for t in TRAIN
                                        for kind in parse_loggers(t.split("train.logger=")[1].split()[0])])
def test_each_tracker_holds_the_lines_of_metrics_jsonl_and_the_samples(page, name, kind):
    """Names, steps and values equal to metrics.jsonl's (steps 0, 1, 2 and the final line); the samples of
    samples.jsonl as the tracker's table (none in TensorBoard's)."""
    run = ran(page, name)
    stored, tables = READERS[kind](page, run)
    expected = by_step(run.lines)
    assert {k for _, k in stored} == {k for _, k in expected} and len({k for _, k in expected}) > 40
    assert set(stored) == set(expected)
    wrong = {key: (value, stored[key]) for key, value in expected.items() if not same(value, stored[key])}
    assert not wrong
    if kind == "tensorboard":
        assert tables == []
    else:
        assert len(run.samples) == 8 and tables == run.samples


def test_wandb_runs_offline_and_says_so_in_one_line(page):
    run = ran(page, "tracked-wandb")
    lines = [line for line in run.out.splitlines() if line.startswith("covey: W&B")]
    why = "offline (no API key: WANDB_API_KEY or `wandb login`)"
    assert lines == [wandb_line(why, "offline", TrackerOptions(("wandb",), "covey", run.dir))]
    assert len(list((run.dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


@pytest.mark.parametrize("command", [c for c in OTHERS if not c.startswith("trackio show")])
def test_the_other_commands_of_the_page_run(page, command):
    """The page's reading commands, as written, on the runs above (`trackio show` is the browser's test)."""
    argv = shlex.split(command)
    named = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    if argv[:3] == ["trackio", "get", "metric"]:
        run = ran(page, named["--run"])
        done = subprocess.run(tracker(argv), cwd=page.home, env=page.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        values = {p["step"]: p["value"] for p in json.loads(done.stdout)["values"]}
        assert values == {line["step"]: line[named["--metric"]] for line in run.lines if named["--metric"] in line}
    elif argv[:2] == ["wandb", "sync"]:  # uploading needs a network and an account: the pattern names the run
        run = ran(page, Path(argv[2]).parts[1])
        matched = list(page.home.glob(argv[2]))
        assert len(matched) == 1 and matched[0].parent == run.dir / "wandb" and list(matched[0].glob("*.wandb"))
    elif argv[:2] == ["tensorboard", "--inspect"]:
        run = ran(page, Path(named["--logdir"]).parts[1])
        done = subprocess.run(tracker(argv), cwd=page.home, env=page.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        steps = [line["step"] for line in run.lines if named["--tag"] in line]
        assert re.search(rf"num_steps\s+{len(steps)}\b", done.stdout) and steps == [1, 2]
    else:
        raise AssertionError(f"docs/tracking.md runs a command this test does not know: {command}")


# --------------------------------------------------------------------------- trackio's dashboard in a browser


def wait_for_address(process: subprocess.Popen, timeout_s: float = 120) -> str:
    """The dashboard's address, from the line `trackio show` prints once it serves."""
    found, deadline, seen = None, time.monotonic() + timeout_s, []
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        while found is None and time.monotonic() < deadline and process.poll() is None:
            if sel.select(timeout=1):
                seen.append(process.stdout.readline())
                found = re.search(r"launched at: (http://\S+?\?project=\w+)", seen[-1])
    assert found, f"trackio show printed no address:\n{''.join(seen)[-2000:]}"
    return found.group(1)


def browse(browser: str, url: str, profile: Path, *output: str) -> str:
    """Chromium, headless, on `url` with `output` (--dump-dom or --screenshot=PATH); 15 s of page time to draw."""
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--window-size=1280,1000", "--virtual-time-budget=15000",
                           f"--user-data-dir={profile}", *output, url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def strokes(png: Path, color: tuple[int, int, int]) -> list[tuple[int, float, float]]:
    """The lines drawn in `color` at least 100 pixels wide, the highest first: (width, y at the left end, y at the
    right end), y counted down from the top. A legend's dot (10 pixels) and text are not one."""
    import numpy as np
    from PIL import Image
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    todo = set(zip(*np.nonzero(np.abs(pixels - np.array(color)).sum(axis=2) <= 30)))
    out = []
    while todo:
        stack, part = [todo.pop()], []
        while stack:  # the pixels joined to this one, diagonals included
            y, x = stack.pop()
            part.append((x, y))
            near = [(y + dy, x + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (y + dy, x + dx) in todo]
            todo.difference_update(near)
            stack += near
        left, right = min(x for x, _ in part), max(x for x, _ in part)
        if right - left >= 100:
            out.append((right - left + 1, float(np.mean([y for x, y in part if x <= left + 2])),
                        float(np.mean([y for x, y in part if x >= right - 2]))))
    return sorted(out, key=lambda stroke: min(stroke[1:]))


def test_trackio_dashboard_draws_the_run_curves(page, tmp_path):
    """`trackio show` as the page runs it; the dashboard, filtered to the run and to reward/mean (0 at both
    steps of the tiny run) and time/elapsed (seconds, growing), opened in headless Chromium: exactly these two
    plots, each a canvas, the legend naming the run; in the picture two lines of the run's colour, the first
    flat and the second rising from step 1 to step 2."""
    run = ran(page, "tracked-trackio")
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(f"no Chromium on this machine ({', '.join(BROWSERS)}): apt-get install chromium "
                    "(scripts/install.sh does as root)")
    assert [line["reward/mean"] for line in run.lines[1:3]] == [0.0, 0.0]  # the tiny model answers nothing right
    assert run.lines[1]["time/elapsed"] < run.lines[2]["time/elapsed"]
    show = next(c for c in OTHERS if c.startswith("trackio show"))
    process = subprocess.Popen(tracker(shlex.split(show)), cwd=page.home, env=page.env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        url = (f"{wait_for_address(process)}&runs={run.dir.name}&smoothing=0"
               f"&metric_filter={quote('^(reward/mean|time/elapsed)$')}")
        dom = browse(browser, url, tmp_path / "profile", "--dump-dom")
        browse(browser, url, tmp_path / "profile", f"--screenshot={tmp_path / 'page.png'}")
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert re.findall(r'data-metric="([^"]+)"', dom) == ["reward/mean", "time/elapsed"]
    assert dom.count("<canvas") == 2
    legend = re.findall(r'legend-dot[^"]*" style="background: rgb\((\d+), (\d+), (\d+)\);"></span>\s*'
                        r'<span class="legend-label[^"]*">([^<]+)</span>', dom)
    assert legend and {name for *_, name in legend} == {run.dir.name}
    color = tuple(int(c) for c in legend[0][:3])
    (_, flat_left, flat_right), (_, left, right) = strokes(tmp_path / "page.png", color)
    assert abs(flat_left - flat_right) <= 2  # reward/mean: 0 and 0
    assert left - right >= 50  # time/elapsed: the line climbs (y shrinks) from step 1 to step 2
