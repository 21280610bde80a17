"""What a run brings besides its config, resolved and checked before the model loads: the caller's reward
functions, the episodes' tools and environments (TRL 1.16's conventions, covey/rollout/environments.py), and
the model's family and tokenizer against the prompts (every prompt rendered as the model will read it,
within the model's context)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from covey.envs.openenv import openenv_factory
from covey.models.families import Family, check_model_family
from covey.models.load import load_tokenizer, resolve_model_path
from covey.rewards.build import check_reward_sources, check_user_rewards, load_callable
from covey.rewards.combine import RewardTerm
from covey.rollout.agents import Agent, load_demo
from covey.rollout.environments import Environments, check_agent, environments_of, load_tools
from covey.tasks.data import check_prompt_lengths, format_prompts
from covey.training.plan import Plan
from covey.training.plan_setup import ToolOptions


@dataclass
class CallerInputs:
    """What the caller of open_run passes besides the config, as TRL's trainer takes them."""
    reward_funcs: list[RewardTerm]
    """Reward terms of `reward_funcs` (with `reward_weights`), scored on top of reward.functions."""
    tools: list[Callable] | Callable | None = None
    """Functions the model may call, added to rollout.tools."""
    environment_factory: Callable | dict | None = None
    """One environment class (or a dict of them by name), instead of rollout.environment."""


@dataclass
class AgentInputs:
    """The episodes' tools and environments, resolved and checked before the model loads (`prepare_agent`)."""
    tools: list
    environments: Environments | None


@dataclass
class CheckedInputs:
    """Everything `check_inputs` loaded and checked: the agent side of episodes (None without tools), the user's
    reward terms, the model's family."""
    agent: AgentInputs | None
    user_rewards: list[RewardTerm]
    family: Family


def check_inputs(plan: Plan, data, run_dir: Path, given: CallerInputs) -> CheckedInputs:
    """Before the model loads: tools and environments (schemas, one instance, reset on a row), each reward
    function called once with a completion shaped as training will pass it (a traceback goes to `run_dir`),
    a run without a reward source, and a model that is not there, of a family covey cannot serve, or whose
    tokenizer cannot take the prompts."""
    agent = (prepare_agent(plan.tools, given.tools, given.environment_factory, data.train)
             if plan.episodes is not None else None)
    environments = agent.environments if agent is not None else None
    harness = plan.tools.outside is not None  # task.source=harness: / verifiers:: messages; a reward source
    user_rewards = check_user_rewards(plan.rewards, given.reward_funcs, data, run_dir,
                                      episodes=plan.episodes is not None or harness,
                                      environments=list(environments.probes.values()) if environments else None)
    check_reward_sources(plan.rewards, user_rewards,
                         environment_reward=bool(environments and environments.owns_reward()) or harness)
    return CheckedInputs(agent, user_rewards, check_model_inputs(plan, data, agent))


def prepare_agent(options: ToolOptions, tools=None, environment_factory=None, rows=()) -> AgentInputs:
    """rollout.tools plus the caller's `tools` (a list or one function), and its `environment_factory` (one
    callable or a dict by name) or else task.source=openenv:... (covey/envs/openenv.py) or rollout.environment;
    each checked on the training `rows` (covey/rollout/environments.py: schemas, one instance, reset on a row,
    each row's environment name)."""
    factory = environment_factory or (
        openenv_factory(options.openenv) if options.openenv
        else load_callable(options.environment, kind="environment") if options.environment else None)
    inputs = AgentInputs(load_tools(options.tools, tools), environments_of(factory))
    check_agent(inputs.tools, inputs.environments, rows)
    return inputs


def check_model_inputs(plan: Plan, data, agent: AgentInputs | None) -> Family:
    """Before the model loads: its family (covey/models/families.py: a layer kind covey cannot serve is refused),
    and every prompt as its tokenizer renders it (chat messages need a chat template; each prompt leaves room for
    its answer in the model's context; an error names the row's file and line)."""
    path = resolve_model_path(plan.model.path)
    family = check_model_family(path)
    tokenizer = load_tokenizer(path)
    context = family.context or 2048
    render = (make_agent(plan.tools, tokenizer, agent).prompts if agent is not None
              else lambda examples, system: format_prompts(tokenizer, examples, system))
    for where, examples, budget in (("train", data.train, plan.sampling.max_new_tokens),
                                    ("held-out", data.eval, plan.sampling.eval_max_new_tokens)):
        check_prompt_lengths(tokenizer, render(examples, plan.run.system_prompt), context - budget, where, examples)
    return family


def make_agent(options: ToolOptions, tokenizer, inputs: AgentInputs | None = None) -> Agent:
    """The episodes' tools side (covey/rollout/agents.py) from `inputs` (else rollout.tools / rollout.environment)."""
    inputs = inputs or prepare_agent(options)
    return Agent(tokenizer, inputs.tools, options.timeout_s, inputs.environments,
                 demo=load_demo(options.demo, options.names))
