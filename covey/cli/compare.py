"""`covey compare [key=value ...] --algos grpo,ppo --seeds 0,1 --budget steps=N`: several presets x
seeds on one budget, then the report (the runner is covey/report/compare.py)."""

from __future__ import annotations

HELP = ("run several algorithms x seeds on one budget and write runs/compare-<name>/report.md: "
        "covey compare [key=value ...] --algos grpo,ppo --seeds 0,1 --budget steps=N|samples=N|minutes=N")


def add_parser(sub) -> None:
    from covey.report.spec import DEFAULT_ALGOS, DEFAULT_BUDGET, DEFAULT_SEEDS
    p = sub.add_parser("compare", help=HELP, description=HELP)
    p.add_argument("overrides", nargs="*", help="key=value overrides shared by every run (model.path, task.*, ...)")
    p.add_argument("--algos", default=",".join(DEFAULT_ALGOS),
                   help="preset names, as `covey train` takes them (default: %(default)s)")
    p.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="default: %(default)s")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help="per run: steps=N | samples=N (sampled completions) | minutes=N (of training steps); "
                        "default: %(default)s")
    p.add_argument("--name", default="default", help="folder runs/compare-NAME (default: %(default)s)")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from the run folders")
    p.set_defaults(func=run)


def spec_from_args(args):
    """The CompareSpec of the parsed arguments; train.output_dir=... says where the comparison lives."""
    from covey.config import ConfigError
    from covey.report.spec import CompareSpec, parse_budget, parse_list
    overrides = list(args.overrides)
    output_dir = "runs"
    for item in list(overrides):  # where the comparison lives, not a per-run setting
        if item.split("=", 1)[0].strip() in ("train.output_dir", "output_dir"):
            output_dir = item.split("=", 1)[1]
            overrides.remove(item)
    try:
        seeds = [int(s) for s in parse_list(args.seeds, "seeds")]
    except ValueError:
        raise ConfigError(f"--seeds '{args.seeds}' must be comma-separated integers") from None
    return CompareSpec(name=args.name, algos=parse_list(args.algos, "algos"), seeds=seeds,
                       budget=parse_budget(args.budget), overrides=overrides, output_dir=output_dir)


def run(args) -> int:
    from covey.report.compare import run_compare
    from covey.report.report import build_report
    spec = spec_from_args(args)
    if args.report_only:
        print(build_report(spec.root))
        return 0
    out = run_compare(spec)
    return 1 if out["failed"] else 0
