"""`covey eval [--model PATH] [RUN_DIR | PRESET | FILE.yaml] [key=value ...]`: held-out evaluation of
any model on the configured task.

Given a run folder, its config.yaml supplies the task, the reward functions and eval.metric, and
its trained model (final/) is evaluated unless --model names another. The run recorded its data
paths absolute and its eval.metric resolved, so this works from any folder and judges as the run did.
"""

from __future__ import annotations

HELP = "held-out accuracy of a model: covey eval [--model PATH] [RUN_DIR | PRESET | FILE.yaml] [key=value ...]"


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help=HELP, description=HELP)
    p.add_argument("--model", default="", help="model folder, .gguf or 'default' (default: the run's final/ "
                                               "when given a run folder, else model.path)")
    p.add_argument("--pass-k", type=int, default=0, help="also report pass@k")
    p.add_argument("--replies", default="", help="write every held-out reply, its reference answer and how "
                                                 "it was read to this .jsonl file, and print where answers fail")
    p.add_argument("args", nargs="*", help="an optional run folder, preset or YAML file, then key=value overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from covey.cli.common import config_with_cpu_settings
    items, run_dir = list(args.args), None
    first = items[0] if items else ""
    if first and "=" not in first and not Path(first).exists() and ("/" in first or first.startswith(".")):
        raise ValueError(f"{first}: no such run folder or YAML file (give a run folder, a preset name or a YAML file)")
    if items and "=" not in items[0] and Path(items[0]).is_dir():
        run_dir = Path(items[0])
        if not (run_dir / "config.yaml").is_file():
            raise ValueError(f"{run_dir}: not a run folder (no config.yaml)")
        items[0] = str(run_dir / "config.yaml")
    cfg = config_with_cpu_settings(items)
    if args.model:
        cfg.model.path = args.model
    elif run_dir is not None:
        if not (run_dir / "final").is_dir():
            raise ValueError(f"{run_dir}: no trained model in final/ (the run did not finish): "
                             "name a checkpoint with --model")
        cfg.model.path = str(run_dir / "final")
    run_eval_command(cfg, args.pass_k, args.replies)
    return 0


def run_eval_command(cfg, pass_k: int = 0, replies_path: str = "") -> dict:
    """Evaluate cfg.model.path on the held-out split of cfg.task, judged by eval.metric (the run's
    verifier, or its reward functions); prints and returns the result. `replies_path`: every reply
    written there (one JSON line each) and a breakdown of the answers printed."""
    import json
    from pathlib import Path

    from covey.cli.common import command_device
    from covey.models.load import load_policy
    from covey.rewards.build import build_rewarder
    from covey.rewards.learned import load_learned_rewards
    from covey.rollout.hf import HFEngine
    from covey.tasks.data import format_prompts, load_run_data
    from covey.tasks.verifiers import resolve_verifier
    from covey.training.evaluate import HeldOutOptions, Judge, evaluate, reply_breakdown
    from covey.training.plan import make_plan
    if replies_path:
        Path(replies_path).parent.mkdir(parents=True, exist_ok=True)
        Path(replies_path).write_text("")  # an unwritable path fails here, before the model loads
    cfg, data = load_run_data(cfg)  # eval.metric=auto resolved as a run resolves it (reward for prompt-only data)
    if not data.eval:
        raise ValueError("no held-out examples to evaluate (task.eval_size=0): set task.eval_path=FILE, or "
                         "task.eval_size=N to hold out N rows of task.path")
    metric = cfg.eval.metric
    verifier = resolve_verifier(metric, [ex.answer for ex in data.eval if ex.answer is not None])
    device = command_device(cfg.train.device)
    judge = Judge(verifier)
    if metric == "reward":
        rewards = make_plan(cfg).rewards
        learned = load_learned_rewards(rewards.model_path, rewards.prm_path, rewards.step_separator, device)
        judge = Judge("reward", build_rewarder(rewards, learned, verifier=verifier), cfg.eval.reward_threshold)
    policy, tokenizer = load_policy(cfg.model.path, device=device)
    policy.eval()
    engine = HFEngine(policy, tokenizer, max_new_tokens=cfg.rollout.eval_max_new_tokens,
                      temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    prompts = format_prompts(tokenizer, data.eval, cfg.task.system_prompt)
    if cfg.rollout.tools or cfg.rollout.environment:  # whole episodes with the run's tools, as the run evaluated
        engine, prompts = with_tools(make_plan(cfg), engine, tokenizer, data.eval, cfg.task.system_prompt)
    replies = [] if replies_path else None
    settings = HeldOutOptions(judge, cfg.rollout.eval_batch_size, cfg.rollout.eval_max_new_tokens,
                            pass_k or cfg.train.eval_pass_k)
    result = evaluate(engine, prompts, data.eval, settings, replies=replies)
    if replies is not None:
        with open(replies_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in replies)
        print(f"replies: {replies_path}; " + ", ".join(f"{k} {v}" for k, v in reply_breakdown(replies).items()))
    print(json.dumps({"model": cfg.model.path, "metric": judge.describe(), **result}))
    return result


def with_tools(plan, engine, tokenizer, examples, system_prompt: str) -> tuple:
    """The engine of whole episodes with rollout.tools / rollout.environment (the run's `plan`), and the prompts
    that show the tools."""
    from covey.rollout.agents import EpisodeEngine
    from covey.training.inputs import make_agent
    agent = make_agent(plan.tools, tokenizer)
    prompts = agent.prompts(examples, system_prompt)
    return EpisodeEngine(engine, agent.episodes, plan.episodes, agent.metrics), prompts
