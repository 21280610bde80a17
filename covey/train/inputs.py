"""What a run brings besides its config, resolved and checked before the model loads: the episodes' tools and
environments (TRL 1.16's conventions, covey/rollout/environments.py), and the model's family and tokenizer
against the prompts (every prompt rendered as the model will read it, within the model's context)."""

from __future__ import annotations

from dataclasses import dataclass

from covey.config import Config
from covey.models.families import Family, check_model_family
from covey.models.load import load_tokenizer, resolve_model_path
from covey.rewards.build import load_callable
from covey.rollout.agents import Agent, load_demo
from covey.rollout.environments import Environments, check_agent, environments_of, load_tools
from covey.tasks.data import check_prompt_lengths, format_prompts


@dataclass
class AgentInputs:
    """The episodes' tools and environments, resolved and checked before the model loads (`prepare_agent`)."""
    tools: list
    environments: Environments | None


def prepare_agent(cfg: Config, agent: dict | None, rows) -> AgentInputs:
    """rollout.tools plus the Python API's `tools` (a list or one function), and its `environment_factory` (one
    callable or a dict by name) or else rollout.environment; each checked on the training `rows`
    (covey/rollout/environments.py: schemas, one instance, reset on a row, each row's environment name)."""
    agent = agent or {}
    factory = agent.get("environment_factory") or (
        load_callable(cfg.rollout.environment, kind="environment") if cfg.rollout.environment else None)
    inputs = AgentInputs(load_tools(cfg.rollout.tools, agent.get("tools")), environments_of(factory))
    check_agent(inputs.tools, inputs.environments, rows)
    return inputs


def check_model_inputs(cfg: Config, data, agent: AgentInputs | None) -> Family:
    """Before the model loads: its family (covey/models/families.py: a layer kind covey cannot serve is refused),
    and every prompt as its tokenizer renders it (chat messages need a chat template; each prompt leaves room for
    its answer in the model's context; an error names the row's file and line)."""
    path = resolve_model_path(cfg.model.path)
    family = check_model_family(path)
    tokenizer = load_tokenizer(path)
    context = family.context or 2048
    render = (make_agent(cfg, tokenizer, agent).prompts if agent is not None
              else lambda examples, system: format_prompts(tokenizer, examples, system))
    for where, examples, budget in (("train", data.train, cfg.rollout.max_new_tokens),
                                    ("held-out", data.eval, cfg.rollout.eval_max_new_tokens)):
        check_prompt_lengths(tokenizer, render(examples, cfg.task.system_prompt), context - budget, where, examples)
    return family


def make_agent(cfg: Config, tokenizer, inputs: AgentInputs | None = None) -> Agent:
    """The episodes' tools side (covey/rollout/agents.py) from `inputs` (else rollout.tools / rollout.environment)."""
    inputs = inputs or prepare_agent(cfg, None, [])
    names = [item.strip() for item in cfg.rollout.tools.split(",") if item.strip()]
    return Agent(tokenizer, inputs.tools, cfg.rollout.tool_timeout_s, inputs.environments,
                 demo=load_demo(cfg.rollout.tool_demo, names))
