"""`covey train-rm` (train a Bradley-Terry outcome RM or a process RM) and `covey eval-rm`
(accuracy of a saved one)."""

from __future__ import annotations

TRAIN_HELP = ("train a Bradley-Terry RM or a process RM: covey train-rm [PRESET | FILE.yaml] "
              "[rm.objective=bt|prm] [key=value ...]")
EVAL_HELP = ("accuracy of a saved reward model: covey eval-rm FOLDER [--data FILE] [key=value ...] "
             "(task.* to break PRM steps down by kind)")


def add_parser(sub) -> None:
    p = sub.add_parser("train-rm", help=TRAIN_HELP, description=TRAIN_HELP)
    p.add_argument("args", nargs="*", help="an optional preset or YAML file, then key=value overrides "
                   "(rm.*, task.*, model.path)")
    p.set_defaults(func=run_train)
    p = sub.add_parser("eval-rm", help=EVAL_HELP, description=EVAL_HELP)
    p.add_argument("folder", help="a folder written by covey train-rm")
    p.add_argument("--data", default="", help="JSONL data (default: the folder's eval_data.jsonl)")
    p.add_argument("args", nargs="*")
    p.set_defaults(func=run_eval)


def run_train(args) -> int:
    from covey.cli.common import command_device, config_with_cpu_settings
    from covey.rm.trainer import RMRun, train_reward_model
    cfg = config_with_cpu_settings(args.args)
    train_reward_model(cfg.rm, cfg.task, cfg.rollout, cfg.model,
                       RMRun(cfg.reward.step_separator, cfg.train.seed, command_device(cfg.train.device)))
    return 0


def run_eval(args) -> int:
    import json

    from covey.cli.common import command_device, config_with_cpu_settings
    from covey.rm.trainer import evaluate_reward_model
    cfg = config_with_cpu_settings(args.args)
    print(json.dumps(evaluate_reward_model(args.folder, args.data or None, task=cfg.task, seed=cfg.train.seed,
                                           batch_size=cfg.rm.batch_size, autocast=cfg.model.autocast,
                                           device=command_device(cfg.train.device))))
    return 0
