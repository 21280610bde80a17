"""`covey train [PRESET] [FILE.yaml] [key=value ...]`: train a policy.

PRESET is a packaged preset's name (grpo, ppo, rloo, ...; none = the defaults, which are grpo's);
a FILE.yaml has the same shape and is applied on top of the preset, then the key=value overrides.
`--print-config` prints the resolved config as YAML and exits without loading a model; `--help-config`
lists every key with its default and meaning.
"""

from __future__ import annotations

HELP = "train a policy: covey train [PRESET] [FILE.yaml] [key=value ...]"


def add_parser(sub) -> None:
    from covey.config import preset_names
    p = sub.add_parser("train", help=HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("args", nargs="*", help=f"a preset ({', '.join(preset_names())}) or a YAML file, "
                   "then key=value overrides")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit (nothing is loaded or trained)")
    p.set_defaults(func=run)


def run(args) -> int:
    from covey.config import config_yaml, describe_keys, load_config, split_config
    if args.help_config:
        print(describe_keys())
        return 0
    cfg = load_config(*split_config(args.args))
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    from covey import train
    from covey.cli.common import quiet_progress_bars
    quiet_progress_bars()
    train(cfg)
    return 0
