"""`covey advantages`: print the per-token advantages of a small hand-made batch.

Use it to check a worked example by hand, e.g. GRPO with discounted token credit and
global-token normalisation::

    covey advantages --estimator grpo --rewards 0.8,0.6 --lengths 3,4 \\
        --token-credit discounted --gamma 0.99 --normalize global_token

Token positions t are 1-based in the table, in --values and in --step-ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

if typing.TYPE_CHECKING:  # torch and covey.algos load when the command runs (see AlgosNames)
    import torch

    from covey import algos

PROG = "covey advantages"
HELP = "print per-token advantages and returns for given rewards and lengths"
EPILOG = """examples:
  GRPO, discounted token credit, global-token normalisation (about 1.143 ... -0.879):
    covey advantages --rewards 0.8,0.6 --lengths 3,4 --token-credit discounted --gamma 0.99 --normalize global_token
  GRPO, two prompts of two samples:    covey advantages --rewards 1,0,1,1 --lengths 2,3,2,2 --groups 0,0,1,1
  GAE with critic values:              covey advantages --estimator gae --rewards 1 --lengths 3 --values 0.1,0.2,0.3
  process supervision:                 covey advantages --estimator grpo_process --rewards 0,0 --lengths 4,3 \\
                                         --step-rewards "1,0;0.5" --step-ends "2,4;3"
"""


class AlgosNames:
    """`%(names)s` in a help line: the names of a covey.algos registry (ESTIMATORS) or option list
    (covey.algos.options), joined when the help is printed. covey.algos loads torch, which building
    the parser for `covey --help` or for another command must not."""

    def __init__(self, attribute: str, separator: str):
        self.attribute, self.separator = attribute, separator

    def __str__(self) -> str:
        from covey import algos
        from covey.algos import options
        return self.separator.join(getattr(algos, self.attribute, None) or getattr(options, self.attribute))


def _fail(message: str):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    estimator_arg = p.add_argument("--estimator", default="grpo", help="one of: %(names)s (default grpo)")
    p.add_argument("--rewards", required=True, help="comma-separated outcome reward per sequence, e.g. 0.8,0.6")
    p.add_argument("--lengths", required=True, help="comma-separated response length per sequence, e.g. 3,4")
    p.add_argument("--groups", help="comma-separated group id per sequence (default: one group)")
    token_credit_arg = p.add_argument("--token-credit", default="shared", help="%(names)s (default shared)")
    p.add_argument("--gamma", type=float, default=1.0, help="discount in [0, 1] (default 1)")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda in [0, 1] (default 0.95)")
    normalize_arg = p.add_argument("--normalize", default="auto", help="%(names)s (default auto)")
    p.add_argument("--no-std", action="store_true", help="do not divide by the std (Dr. GRPO)")
    p.add_argument("--ddof", type=int, default=0, help="std degrees of freedom: 0 population, 1 unbiased (default 0)")
    p.add_argument("--eps", type=float, default=1e-6, help="added to the std (default 1e-6)")
    p.add_argument("--values", help="gae: critic values per token, ';' between sequences (default 0)")
    p.add_argument("--baselines", help="remax: comma-separated greedy-sample reward per sequence")
    p.add_argument("--step-rewards", help="grpo_process: step rewards, ',' within and ';' between sequences")
    p.add_argument("--step-ends", help="grpo_process: 1-based token where each step ends, same layout")
    p.add_argument("--digits", type=int, default=4, help="decimals in the table (default 4)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per sequence) instead of a table")
    estimator_arg.names = AlgosNames("ESTIMATORS", ", ")
    token_credit_arg.names = AlgosNames("TOKEN_CREDITS", " | ")
    normalize_arg.names = AlgosNames("NORMALIZE_MODES", " | ")
    p.error = _fail  # one-line errors, exit code 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `advantages` sub-command to an argparse subparsers object."""
    p = subparsers.add_parser("advantages", help=HELP, description=__doc__.split("\n\n")[0], epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _numbers(text: str, what: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        _fail(f"--{what}: expected comma-separated {'integers' if kind is int else 'numbers'}, got {text!r}")


def _per_sequence(text: str, what: str, n: int, kind=float) -> list[list]:
    rows = [_numbers(part, what, kind) for part in text.split(";")]
    if len(rows) != n:
        _fail(f"--{what}: {len(rows)} ';'-separated lists for {n} sequences")
    return rows


def _padded(rows: list[list], n: int, width: int, dtype) -> torch.Tensor:
    import torch
    out = torch.zeros(n, width, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _step_inputs(args, n: int, lengths: list[int]) -> dict:
    import torch
    if (args.step_rewards is None) != (args.step_ends is None):
        _fail("--step-rewards and --step-ends go together")
    if args.step_rewards is None:
        if estimator(args).step_scores:
            _fail(f"estimator {args.estimator} needs --step-rewards and --step-ends")
        return {}
    scores = _per_sequence(args.step_rewards, "step-rewards", n)
    ends = _per_sequence(args.step_ends, "step-ends", n, int)
    for i, (s, e) in enumerate(zip(scores, ends)):
        if len(s) != len(e):
            _fail(f"sequence {i + 1}: {len(s)} step rewards but {len(e)} step ends")
        if any(not 1 <= t <= lengths[i] for t in e):
            _fail(f"sequence {i + 1}: step ends must lie in 1..{lengths[i]} (its length)")
    width = max([len(s) for s in scores] + [1])
    mask = _padded([[1] * len(s) for s in scores], n, width, torch.bool)
    return {"step_scores": _padded(scores, n, width, torch.float64),
            "step_ends": _padded([[t - 1 for t in e] for e in ends], n, width, torch.long), "step_mask": mask}


def build_input(args) -> algos.AdvantageInput:
    """AdvantageInput (float64) from the parsed arguments; one-line error and exit 2 on bad ones."""
    import torch

    from covey import algos
    rewards = _numbers(args.rewards, "rewards")
    lengths = _numbers(args.lengths, "lengths", int)
    n = len(rewards)
    if n == 0:
        _fail("--rewards is empty")
    if len(lengths) != n:
        _fail(f"{n} rewards but {len(lengths)} lengths")
    if any(t < 0 for t in lengths):
        _fail("--lengths must be >= 0")
    groups = _numbers(args.groups, "groups", int) if args.groups else [0] * n
    if len(groups) != n:
        _fail(f"{n} rewards but {len(groups)} group ids")
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    extra = _step_inputs(args, n, lengths)
    if args.values is not None:
        values = _per_sequence(args.values, "values", n)
        if any(len(v) != t for v, t in zip(values, lengths)):
            _fail("--values: each sequence needs exactly one value per token (its length)")
        extra["values"] = _padded(values, n, width, torch.float64)
    elif estimator(args).needs_values:  # no --values: a critic that predicts 0 everywhere
        extra["values"] = torch.zeros(n, width, dtype=torch.float64)
    if args.baselines is not None:
        baselines = _numbers(args.baselines, "baselines")
        if len(baselines) != n:
            _fail(f"{n} rewards but {len(baselines)} baselines")
        extra["baseline_scores"] = torch.tensor(baselines, dtype=torch.float64)
    return algos.AdvantageInput(scores=torch.tensor(rewards, dtype=torch.float64), response_mask=mask,
                                group_ids=torch.tensor(groups), **extra)


def estimator(args) -> algos.Estimator:
    """The registry entry of --estimator (its traits say which inputs it needs)."""
    from covey import algos
    if args.estimator not in algos.ESTIMATORS:
        _fail(f"unknown estimator {args.estimator!r}; valid: {', '.join(algos.ESTIMATORS)}")
    return algos.ESTIMATORS[args.estimator]


def build_options(args) -> algos.AdvantageOptions:
    from covey import algos
    estimator(args)
    if not 0.0 <= args.gamma <= 1.0:
        _fail(f"--gamma must be in [0, 1], got {args.gamma}")
    if args.digits < 0 or args.digits > 12:
        _fail("--digits must be in 0..12")
    opts = algos.AdvantageOptions(gamma=args.gamma, lam=args.lam, eps=args.eps, std_normalize=not args.no_std,
                                  ddof=args.ddof, token_credit=args.token_credit, normalize=args.normalize)
    try:
        opts.validate()
    except ValueError as e:
        _fail(str(e))
    return opts


def _table(result: dict, digits: int) -> str:
    seqs = result["sequences"]
    width = max([s["length"] for s in seqs] + [1])
    cell = digits + 5
    tokens = " ".join(f"{'t=' + str(t):>{cell}}" for t in range(1, width + 1))
    head = f"{'seq':>4} {'group':>6} {'reward':>{cell}} {tokens}"
    lines = [" ".join(f"{k}={v}" for k, v in result["options"].items()), ""]
    for key in ("advantages", "returns"):
        lines += [f"{key}:", head]
        for s in seqs:
            cells = " ".join(f"{v:>{cell}.{digits}f}" for v in s[key])
            lines.append(f"{s['seq']:>4} {s['group']:>6} {s['reward']:>{cell}.{digits}f} {cells}".rstrip())
        lines.append("")
    lines.append("metrics: " + "  ".join(f"{k}={v:.{digits}g}" for k, v in result["metrics"].items()))
    return "\n".join(lines)


def compute(args) -> dict:
    """Run the estimator; a dict with options, one entry per sequence (lists of per-token values) and metrics."""
    from covey import algos
    opts = build_options(args)
    inp = build_input(args)
    try:
        adv, ret, metrics = algos.compute_advantages(args.estimator, inp, opts)
    except ValueError as e:
        _fail(str(e))
    lengths = inp.response_mask.sum(-1).tolist()
    options = {"estimator": args.estimator, **{k: getattr(opts, k) for k in
               ("normalize", "token_credit", "gamma", "lam", "std_normalize", "ddof", "eps")}}
    seqs = [{"seq": i + 1, "group": int(inp.group_ids[i]), "reward": float(inp.scores[i]), "length": int(t),
             "advantages": [float(v) for v in adv[i, inp.response_mask[i]]],
             "returns": [float(v) for v in ret[i, inp.response_mask[i]]]}
            for i, t in enumerate(lengths)]
    return {"options": options, "sequences": seqs, "metrics": metrics}


def run(args) -> int:
    """Entry point of the sub-command: prints the table (or JSON) and returns the exit code."""
    result = compute(args)
    print(json.dumps(result, indent=2) if args.json else _table(result, args.digits))
    return 0
