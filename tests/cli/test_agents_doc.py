"""docs/agents.md: the commands of "Training with tools" run as written, on the tiny model (whose random
replies call no tool: the episode machinery, the prompts with the tools shown, the calculator and the
environment's reset and reward all run; tests/training/test_agents.py scripts the calls themselves)."""

import json
import re
import shlex
from pathlib import Path

from covey.cli.main import main
from tests.helpers import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
SECTION = (ROOT / "docs" / "agents.md").read_text().split("## Training with tools", 1)[1]
COMMANDS = [line for line in re.search(r"```bash\n(.*?)```", SECTION, re.S).group(1).splitlines() if line.strip()]


def test_the_commands_of_the_page_run(tiny_model_dir, tmp_path, capsys):
    assert len(COMMANDS) == 2 and all(c.startswith("covey train ") for c in COMMANDS)
    for n, command in enumerate(COMMANDS):
        args = shlex.split(command)[1:]
        tiny = tiny_overrides(tiny_model_dir, tmp_path / str(n), **{"train.steps": 1, "rollout.max_turns": 2})
        own = {a.split("=", 1)[0] for a in args[1:]}
        assert main([*args, *(o for o in tiny if o.split("=", 1)[0] not in own)]) == 0, command
        assert "covey: episodes of up to " in capsys.readouterr().out
        step = json.loads((tmp_path / str(n) / "t" / "metrics.jsonl").read_text().splitlines()[1])
        assert step["episode/turns_mean"] >= 1 and "tools/calls" in step
