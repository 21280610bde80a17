"""`covey eval`: held-out accuracy of any model on the configured task."""

from __future__ import annotations

import json

from covey.config import Config
from covey.tasks.data import format_prompts, load_task_data
from covey.train.evaluate import evaluate
from covey.models.load import load_policy
from covey.rollout.hf import HFEngine


def run_eval_command(cfg: Config, pass_k: int = 0) -> dict:
    data = load_task_data(cfg.task, cfg.train.seed)
    policy, tokenizer = load_policy(cfg.model.path)
    policy.eval()
    engine = HFEngine(policy, tokenizer, max_new_tokens=cfg.rollout.eval_max_new_tokens,
                      temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    prompts = format_prompts(tokenizer, data.eval, cfg.task.system_prompt)
    result = evaluate(engine, prompts, data.eval, batch_size=cfg.rollout.eval_batch_size,
                      max_new_tokens=cfg.rollout.eval_max_new_tokens, pass_k=pass_k or cfg.train.eval_pass_k)
    print(json.dumps({"model": cfg.model.path, **result}))
    return result
