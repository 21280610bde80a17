"""covey command line: train | sft | eval | train-rm | eval-rm | serve-reward | serve-policy | export | plot | compare
| advantages.

This module builds the parser from one module per command (covey/cli/<command>.py), and holds
the entry point and the error policy: a user error is one line and exit 2, a stopped run exits 130/143, a reader that
closes stdout early ends the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys

from covey.runtime.errors import first_line
from covey.runtime.signals import TrainingStopped

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError)
STDOUT_CLOSED_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


def build_parser() -> argparse.ArgumentParser:
    # Here, not at the top: entry() may restart the interpreter before any command module is needed.
    import covey.cli.eval  # by its full name: `eval` alone would hide the builtin
    from covey.cli import advantages, compare, export, plot, rm, serve, serve_policy, sft, train
    parser = argparse.ArgumentParser(prog="covey", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, sft, covey.cli.eval, rm, serve, serve_policy, export, plot, compare, advantages):
        command.add_parser(sub)
    for sub_parser in sub.choices.values():  # argument errors are reported by the command's own parser
        sub_parser.set_defaults(command_parser=sub_parser)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops collecting key=value positionals at the first option ("FOLDER --data F k=v"):
    # overrides after an option belong to the same list.
    positional = next((n for n in ("args", "overrides") if isinstance(getattr(args, n, None), list)), None)
    if extra and positional and all("=" in e and not e.startswith("-") for e in extra):
        getattr(args, positional).extend(extra)
    elif extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def fail(command: str, err: BaseException) -> int:
    print(f"covey {command}: error: {first_line(err)}", file=sys.stderr)
    return 2


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command under the error policy; its exit code."""
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except TrainingStopped as stop:  # SIGINT/SIGTERM: checkpoint written, exit 130/143
        print(f"covey {args.command}: {stop}", file=sys.stderr)
        return stop.exit_code
    except USER_ERRORS as err:
        return fail(args.command, err)
    except RuntimeError as err:
        if type(err).__module__.startswith("covey"):
            return fail(args.command, err)
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        code = run_command(args)
        sys.stdout.flush()  # a reader that has gone shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return stdout_closed()


def stdout_closed() -> int:
    """The reader of stdout went away (`covey advantages --json | head -3`): end quietly with
    128 + SIGPIPE, as a program killed by SIGPIPE does, with stdout pointed at /dev/null so that
    the interpreter's last flush of what is still buffered does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to redirect
        pass
    return STDOUT_CLOSED_EXIT


def entry() -> int:
    """The `covey` console script and `python -m covey.cli`: restart once with glibc's malloc
    set to reuse freed memory (covey/runtime/cpu.py; COVEY_MALLOC_KEEP=0 turns it off), then run main()."""
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
    without an active exception", SIGABRT: seen twice in the two-process test, dev/LOG.md), which
    turned a finished run into a failed one. The likely cause is gloo work objects freed during
    teardown (pytorch/pytorch#179291). covey's own files are closed after every write.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(entry())
