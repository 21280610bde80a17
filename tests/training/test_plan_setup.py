"""The Plan's set-up sections (covey/training/plan_setup.py): each is made once from the config by make_plan, holds
every key of its config section (or says where the key went instead), never shares the Config's objects, and is
made from the config as the data settled it."""

import dataclasses
import json

import pytest

from covey.config import EvalConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig, TrainConfig, load_config
from covey.models.load import ModelOptions
from covey.rewards.build import RewardOptions
from covey.rollout.factory import EngineOptions
from covey.training import loop
from covey.training.plan import make_plan
from covey.training.plan_setup import OptimizerOptions, RunOptions, ToolOptions, optimizer_options
from tests.helpers import tiny_overrides

KEYS = ["model.dtype=bfloat16", "model.lora_rank=4", "model.critic_path=", "rollout.engine=hf",
        "rollout.temperature=0.9", "rollout.top_k=5", "rollout.vllm_sync_bucket_mb=64", "optim.lr=3e-6",
        "optim.critic_lr=2e-5", "optim.betas=0.9,0.95", "optim.warmup_steps=3", "reward.format=0.5",
        "reward.functions=tests.helpers:varied_reward:2, tests.helpers:varied_reward", "reward.timeout_s=7",
        "rm.batch_size=4", "task.answer_key=solution", "task.system_prompt=Be brief.", "train.seed=11",
        "train.run_name=r", "train.logger=tensorboard", "eval.reward_threshold=0.5", "rollout.tools=calculator",
        "rollout.tool_timeout_s=3"]


def names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_each_section_holds_the_keys_of_its_config_section():
    """A key added to a config section lands in the plan's section of the same name or is named here with where it
    went: the set-up never reads a key the plan left out."""
    assert names(ModelConfig) - names(ModelOptions) == {"router_aux_coef"}  # the update's (plan.update)
    engine_keys = {"engine", "precision", "decode", "max_new_tokens", "temperature", "top_p", "top_k", "slots",
                   "speculate"}
    assert names(EngineOptions) - {"seed"} == engine_keys | {k for k in names(RolloutConfig) if k.startswith("vllm_")}
    assert names(OptimConfig) - names(OptimizerOptions) == {"max_grad_norm", "max_skipped_steps"}  # plan.update
    assert names(RewardConfig) - names(RewardOptions) == {"step_source", "process_outcome_weight"}  # step_scoring
    assert names(RewardOptions) - names(RewardConfig) == {"rm", "answer_key", "max_new_tokens", "environment",
                                                          "max_steps"}
    run_keys = {"device", "dist_timeout_s", "balance_ranks", "output_dir", "run_name", "resume", "logger",
                "logger_project", "eval_before_cache"}
    assert run_keys <= names(TrainConfig) and names(RunOptions) - run_keys == {
        "task_name", "system_prompt", "eval_metric", "reward_threshold"}
    assert {"metric", "reward_threshold"} == names(EvalConfig)


def test_make_plan_fills_the_sections_from_the_config():
    cfg = load_config(None, KEYS)
    plan = make_plan(cfg)
    m, e, o, r, run, tools = plan.model, plan.engine, plan.optimizer, plan.rewards, plan.run, plan.tools
    assert (m.path, m.dtype, m.lora_rank, m.critic_path) == ("default", "bfloat16", 4, "default")  # critic: the policy
    assert (e.engine, e.temperature, e.top_k, e.vllm_sync_bucket_mb, e.seed) == ("hf", 0.9, 5, 64, 11)
    assert o == OptimizerOptions(name="adamw", lr=3e-6, critic_lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0,
                                 warmup_steps=3, offload=False)
    assert r.functions == ("tests.helpers:varied_reward:2", "tests.helpers:varied_reward")
    assert (r.format, r.timeout_s, r.answer_key, r.max_new_tokens, r.max_steps, r.environment) == (
        0.5, 7.0, "solution", cfg.rollout.max_new_tokens, cfg.train.steps, False)
    assert r.rm.batch_size == 4 and r.rm is not cfg.rm and r.rm == cfg.rm  # a copy of the config's
    assert (run.run_name, run.logger, run.system_prompt, run.reward_threshold) == (
        "r", ("tensorboard",), "Be brief.", 0.5)
    assert tools == ToolOptions(tools="calculator", environment="", timeout_s=3.0, demo="") and tools.names == [
        "calculator"]


def test_the_sections_are_frozen_and_do_not_follow_the_config():
    cfg = load_config(None, [])
    plan = make_plan(cfg)
    cfg.optim.lr, cfg.model.path, cfg.rm.batch_size = 1.0, "elsewhere", 99
    assert (plan.optimizer.lr, plan.model.path, plan.rewards.rm.batch_size) == (1e-5, "default", 8)
    for section in (plan.model, plan.engine, plan.optimizer, plan.rewards, plan.run, plan.tools):
        with pytest.raises(dataclasses.FrozenInstanceError):
            section.seed = 0


def test_optimizer_betas_are_read_as_numbers():
    assert optimizer_options(OptimConfig(betas="0.8, 0.9")).betas == (0.8, 0.9)


def test_open_run_plans_from_the_data_it_settled(tiny_model_dir, tmp_path, monkeypatch):
    """Prompt-only data: what the data decides (eval.metric=reward, the correctness reward off) is in the plan
    open_run makes and in the config it records; nothing rewrites the plan afterwards. Stopped at the model load."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(8)))
    seen = {}

    def stop(plan, run_dir, train_size, world=None, record=None):
        seen.update(plan=plan, record=record)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "build_run", stop)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"task.name": "file", "task.path": path,
                                                                        "task.eval_size": 2}))
    with pytest.raises(KeyboardInterrupt):
        loop.open_run(cfg, reward_funcs=[lambda completions, **_: [1.0] * len(completions)], evaluate_before=False)
    plan, record = seen["plan"], seen["record"]
    assert (plan.run.eval_metric, plan.rewards.correctness) == ("reward", 0.0)
    assert (record["eval"]["metric"], record["reward"]["correctness"]) == ("reward", 0.0)
    assert (cfg.eval.metric, cfg.reward.correctness) == ("auto", 1.0)  # the caller's config is left as it was
