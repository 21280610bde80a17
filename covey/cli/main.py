"""covey command line: train | eval | train-rm | eval-rm | serve-reward | plot | compare | advantages."""

from __future__ import annotations

import argparse
import os
import sys

from covey.config import split_config
from covey.runtime.errors import first_line
from covey.runtime.signals import TrainingStopped

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError)


def _fail(command: str, err: BaseException) -> int:
    message = first_line(err)
    print(f"covey {command}: error: {message}", file=sys.stderr)
    return 2


def cmd_train(args) -> int:
    from covey.config import describe_keys, load_config
    from covey.train.api import train
    if args.help_config:
        print(describe_keys())
        return 0
    config_path, overrides = split_config(args.args)
    cfg = load_config(config_path, overrides)
    train(cfg)
    return 0


def _config_with_cpu_settings(items: list[str]):
    """The config of a command that runs a model outside `train` (which applies them itself),
    with model.threads applied."""
    from covey.config import load_config
    from covey.runtime.cpu import apply_cpu_settings
    cfg = load_config(*split_config(items))
    apply_cpu_settings(cfg)
    return cfg


def cmd_eval(args) -> int:
    from covey.cli.eval import run_eval_command
    cfg = _config_with_cpu_settings(args.args)
    if args.model:
        cfg.model.path = args.model
    run_eval_command(cfg, args.pass_k)
    return 0


def cmd_train_rm(args) -> int:
    from covey.rm.trainer import train_reward_model
    train_reward_model(_config_with_cpu_settings(args.args))
    return 0


def cmd_eval_rm(args) -> int:
    import json

    from covey.rm.trainer import evaluate_reward_model
    cfg = _config_with_cpu_settings(args.args)
    print(json.dumps(evaluate_reward_model(cfg, args.folder, args.data or None)))
    return 0


def cmd_plot(args) -> int:
    from covey.report.plots import plot_runs
    print(plot_runs(args.run_dirs, args.out or None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="covey", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a policy: covey train [CONFIG.yaml] [key=value ...]")
    p.add_argument("args", nargs="*", help="optional YAML preset, then key=value overrides")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="held-out accuracy of a model: covey eval [--model PATH] [key=value ...]")
    p.add_argument("--model", default="", help="model folder, .gguf or 'default'")
    p.add_argument("--pass-k", type=int, default=0, help="also report pass@k")
    p.add_argument("args", nargs="*")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("train-rm", help="train a Bradley-Terry RM or a process RM: covey train-rm "
                       "[CONFIG.yaml] [rm.objective=bt|prm] [key=value ...]")
    p.add_argument("args", nargs="*", help="optional YAML preset, then key=value overrides (rm.*, task.*, model.path)")
    p.set_defaults(func=cmd_train_rm)
    p = sub.add_parser("eval-rm", help="accuracy of a saved reward model: covey eval-rm FOLDER [--data FILE] "
                       "[key=value ...] (task.* to break PRM steps down by kind)")
    p.add_argument("folder", help="a folder written by covey train-rm")
    p.add_argument("--data", default="", help="JSONL data (default: the folder's eval_data.jsonl)")
    p.add_argument("args", nargs="*")
    p.set_defaults(func=cmd_eval_rm)
    from covey.rewards import server
    server.add_parser(sub)
    p = sub.add_parser("plot", help="PNG curves of a run's metrics, or of several runs overlaid")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="", help="PNG path (default: RUN_DIR/curves.png; several runs: "
                   "curves_A_vs_B.png beside the first)")
    p.set_defaults(func=cmd_plot)
    from covey.report import compare
    compare.add_parser(sub)
    try:
        from covey.cli import advantages as advantages_cmd
        advantages_cmd.add_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops collecting key=value positionals at the first option ("FOLDER --data F k=v"):
    # overrides after an option belong to the same list.
    positional = next((n for n in ("args", "overrides") if isinstance(getattr(args, n, None), list)), None)
    if extra and positional and all("=" in e and not e.startswith("-") for e in extra):
        getattr(args, positional).extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except TrainingStopped as stop:  # SIGINT/SIGTERM: checkpoint written, exit 130/143
        print(f"covey {args.command}: {stop}", file=sys.stderr)
        return stop.exit_code
    except USER_ERRORS as err:
        return _fail(args.command, err)
    except RuntimeError as err:
        if type(err).__module__.startswith("covey"):
            return _fail(args.command, err)
        raise


def entry() -> int:
    """The `covey` console script and `python -m covey.cli`: restart once with glibc's malloc
    set to reuse freed memory (covey/cpu.py; COVEY_MALLOC_KEEP=0 turns it off), then run main()."""
    from covey.runtime.cpu import malloc_env
    env = malloc_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "covey.cli", *sys.argv[1:]], env)
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_without_teardown(code)
    return code


def exit_without_teardown(code: int) -> None:
    """End a torchrun rank that has finished (process group destroyed, files closed) without
    interpreter finalization.

    Now and then a rank aborted there, after the run had saved its model ("terminate called
    without an active exception", SIGABRT: seen twice in the two-process test, LOG.md), which
    turned a finished run into a failed one. The likely cause is gloo work objects freed during
    teardown (pytorch/pytorch#179291). covey's own files are closed after every write.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(entry())
