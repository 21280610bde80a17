"""A GPU-only option says "not yet run on a GPU" in its help line exactly until docs/results.md records a
run of it on a named card and date (the table "Options that only a GPU runs")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from covey.config import Config, field_docs
from covey.config.describe import GPU_ONLY
from covey.config.load import owner

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.md"
NOT_YET = "not yet run on a gpu"


def recorded_runs() -> dict[str, tuple[str, str]]:
    """{option: (card, date)} of the results table's rows."""
    text = RESULTS.read_text()
    table = text.split("## Options that only a GPU runs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+?) \| (\d{4}-\d{2}-\d{2}) \|", table, re.M)
    return {option: (card, date) for option, card, date in rows}


def help_of(option: str) -> str:
    """The help line's part about `option`: a key's whole line, or for key=value the value's own choice."""
    key, _, value = option.partition("=")
    obj, name = owner(Config(), key)
    line = field_docs(type(obj))[name]
    if not value:
        return line
    choices = line.split(" | ")
    choices[0] = choices[0].split(": ", 1)[-1]  # "Optimizer: adamw (...)" -> "adamw (...)"
    return next(choice for choice in choices if re.match(rf"{re.escape(value)}\b", choice))


@pytest.mark.parametrize("option", GPU_ONLY)
def test_the_help_line_says_whether_a_gpu_has_run_it(option):
    runs = recorded_runs()
    said = NOT_YET in help_of(option).lower()
    if option in runs:
        card, date = runs[option]
        assert card.startswith("NVIDIA") and not said, (option, card, date)
    else:
        assert said, f"{option}: no GPU run in docs/results.md, and its help line does not say so"


def test_every_recorded_run_is_of_a_gpu_only_option():
    assert set(recorded_runs()) <= set(GPU_ONLY)
