"""`covey eval [--model PATH] [PRESET | FILE.yaml] [key=value ...]`: held-out accuracy of any
model on the configured task."""

from __future__ import annotations

HELP = "held-out accuracy of a model: covey eval [--model PATH] [key=value ...]"


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help=HELP, description=HELP)
    p.add_argument("--model", default="", help="model folder, .gguf or 'default'")
    p.add_argument("--pass-k", type=int, default=0, help="also report pass@k")
    p.add_argument("args", nargs="*", help="an optional preset or YAML file, then key=value overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    from covey.cli.common import config_with_cpu_settings
    cfg = config_with_cpu_settings(args.args)
    if args.model:
        cfg.model.path = args.model
    run_eval_command(cfg, args.pass_k)
    return 0


def run_eval_command(cfg, pass_k: int = 0) -> dict:
    """Evaluate cfg.model.path on the held-out split of cfg.task; prints and returns the result."""
    import json

    from covey.cli.common import command_device
    from covey.models.load import load_policy
    from covey.rollout.hf import HFEngine
    from covey.tasks.data import format_prompts, load_task_data
    from covey.train.evaluate import evaluate
    data = load_task_data(cfg.task, cfg.train.seed)
    policy, tokenizer = load_policy(cfg.model.path, device=command_device(cfg))
    policy.eval()
    engine = HFEngine(policy, tokenizer, max_new_tokens=cfg.rollout.eval_max_new_tokens,
                      temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    prompts = format_prompts(tokenizer, data.eval, cfg.task.system_prompt)
    result = evaluate(engine, prompts, data.eval, batch_size=cfg.rollout.eval_batch_size,
                      max_new_tokens=cfg.rollout.eval_max_new_tokens, pass_k=pass_k or cfg.train.eval_pass_k)
    print(json.dumps({"model": cfg.model.path, **result}))
    return result
