"""`covey plot RUN_DIR [RUN_DIR ...]`: PNG curves of a run's metrics, or of several runs overlaid."""

from __future__ import annotations

HELP = "PNG curves of a run's metrics, or of several runs overlaid"


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help=HELP, description=HELP)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="", help="PNG path (default: RUN_DIR/curves.png; several runs: "
                   "curves_A_vs_B.png beside the first)")
    p.set_defaults(func=run)


def run(args) -> int:
    from covey.report.plots import plot_runs
    print(plot_runs(args.run_dirs, args.out or None))
    return 0
