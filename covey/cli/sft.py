"""`covey sft [DATA] [PRESET | FILE.yaml] [key=value ...]`: supervised fine-tuning on demonstrations.

DATA (or sft.data=...) is a .jsonl / .json file or a folder saved with datasets' save_to_disk, of chat
messages (tool calls and tool results included) or prompt/completion pairs; the loss is on the assistant's
tokens only (docs/distillation.md). The run is covey's: the same run folder, checkpoints and exact resume,
metrics, held-out evaluation by the task's verifier before and after, LoRA; `covey sft DATA k=v` is
`covey train algo.learner=sft sft.data=DATA k=v`. For a supervised warm-up before RL in one run, use
`covey train ... sft.data=DATA sft.num_steps=N`.
"""

from __future__ import annotations

HELP = "supervised fine-tuning on demonstrations: covey sft [DATA] [PRESET | FILE.yaml] [key=value ...]"
DATA_SUFFIXES = (".jsonl", ".json")


def add_parser(sub) -> None:
    p = sub.add_parser("sft", help=HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("args", nargs="*", help="the demonstrations (a .jsonl or .json file, or a saved dataset folder), "
                   "then a preset or YAML file, then key=value overrides")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit (nothing is loaded or trained)")
    p.set_defaults(func=run)


def split_data(items: list[str]) -> tuple[list[str], list[str]]:
    """(the sft.data override of a leading DATA item, if any; the rest of the items)."""
    from pathlib import Path
    if items and "=" not in items[0] and (items[0].lower().endswith(DATA_SUFFIXES) or Path(items[0]).is_dir()):
        return [f"sft.data={items[0]}"], items[1:]
    return [], items


def run(args) -> int:
    from covey.config import config_yaml, load_config, split_config
    data, rest = split_data(list(args.args))
    named, overrides = split_config(rest)
    cfg = load_config(named, ["algo.learner=sft", *data, *overrides])
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    from covey import train
    from covey.cli.common import quiet_progress_bars
    quiet_progress_bars()
    train(cfg)
    return 0
