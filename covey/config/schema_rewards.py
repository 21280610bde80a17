"""The config sections of rewards: the reward terms of a run (`reward.*`) and the training of
reward models (`rm.*`, `covey train-rm`). Part of the config's shape (covey/config/schema.py), in a
module of its own for size; every field has a one-line docstring, as there.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JudgeConfig:
    """A judge model scores each group's answers relative to each other in one prompt (RULER, OpenPipe 2025; docs/rewards.md, "Judge reward")."""
    model: str = ""
    """The judge: a model spec run locally, frozen (default, tiny, a folder, a hub id), or an OpenAI-compatible endpoint http(s)://host:port/v1 (`covey serve-policy`, vLLM, a provider); empty = no judge."""
    weight: float = 1.0
    """Weight of the judge's score (in [0, 1]) in the total reward."""
    template: str = ""
    """A rubric template file holding {prompt}, {answers} and optionally {count}; empty = the built-in rubric."""
    max_new_tokens: int = 256
    """Longest judgment in tokens (greedy)."""
    endpoint_model: str = ""
    """With an endpoint: the model name sent with each request; empty = the first of its /v1/models."""
    token_env: str = "OPENAI_API_KEY"
    """With an endpoint: the environment variable holding its bearer token (unset or empty: none is sent)."""
    timeout_s: float = 60.0
    """With an endpoint: seconds per request; a request that times out or fails is retried 3 times with backoff."""


@dataclass
class RewardConfig:
    correctness: float = 1.0
    """Weight of the 1/0 correctness reward."""
    format: float = 0.0
    """Weight of the format reward (final answer clearly marked)."""
    tool_use: float = 0.0
    """With tools: weight of the tool-use reward, 1 for an episode with at least one tool call answered without an error (a shaping term for a model that does not call tools yet; ToolRL, Qian et al. 2025, arXiv:2504.13958)."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty buffer in tokens (0 = off)."""
    overlong_weight: float = 1.0
    """Weight of the overlong penalty when enabled."""
    functions: str = ""
    """Extra user rewards 'module:function:weight,...' with TRL's signature."""
    on_error: str = "raise"
    """Reward failure policy: raise | zero (score 0, counted) | drop (remove the sample from its group, counted)."""
    timeout_s: float = 30.0
    """Per-call timeout of a reward function in seconds (0 = none); a timeout is a reward fault."""
    max_failed_steps: int = 5
    """Stop the run (exit 2) after this many steps in a row on which a reward function failed on every sample, every sample was dropped, or no function scored any sample (0 = never)."""
    model_path: str = ""
    """Learned outcome reward model folder (`covey train-rm` output); empty = none."""
    model_weight: float = 1.0
    """Weight of the learned outcome RM score."""
    prm_path: str = ""
    """Process reward model folder (`covey train-rm rm.objective=prm` output); empty = none."""
    prm_weight: float = 0.0
    """Weight of the PRM's outcome score (min over step probabilities) in the total reward."""
    step_source: str = "prm"
    """Step rewards of algo.estimator=grpo_process: prm (reward.prm_path) | exact (multistep verifier labels) | turns (with tools, and only there: one step per model turn, scored by the environment's turn_reward() or 1 for a turn whose tool calls were all answered without an error; docs/agents.md)."""
    step_separator: str = "\n"
    """Separator between reasoning steps (escapes like \\n are decoded)."""
    process_outcome_weight: float = 0.0
    """grpo_process: weight of the outcome reward added to each response's last step (0 = step rewards only). With reward.step_source=turns it is what carries correctness (added to the episode's last turn) and must be > 0."""
    remote_url: str = ""
    """Remote reward service (`covey serve-reward`), e.g. http://127.0.0.1:8765; empty = none."""
    remote_weight: float = 1.0
    """Weight of the remote reward."""
    remote_token_env: str = "COVEY_REWARD_TOKEN"
    """Environment variable holding the remote service's bearer token."""
    remote_timeout_s: float = 10.0
    """Per-request timeout of the remote reward client."""
    remote_retries: int = 3
    """Retries (with exponential backoff) after a failed remote request."""
    remote_batch_size: int = 64
    """Items per remote request."""
    iterative_every: int = 0
    """Iterative GRPO: retrain the learned RM / PRM on fresh samples every K policy steps (0 = fixed)."""
    replay_fraction: float = 0.1
    """Share of historical (replayed) samples in each RM refresh's training mix."""
    language: float = 0.0
    """Weight of the language-consistency reward (DeepSeek-AI 2025, arXiv:2501.12948: share of words in the target language)."""
    language_target: str = "en"
    """Target language of the language reward: en | fr | de | es | it | pt | latin | zh | ja | ko | cjk."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class RMConfig:
    objective: str = "bt"
    """`covey train-rm` model: bt (Bradley-Terry outcome RM) | prm (process RM, per-step BCE)."""
    base_model: str = "default"
    """Backbone the reward model starts from (model spec or a saved RM folder)."""
    data: str = ""
    """Training JSONL (bt: prompt/chosen/rejected; prm: prompt/completion/labels); empty = generate from the task."""
    save_data: str = ""
    """Also write generated data to this JSONL file before training (reuse it with rm.data)."""
    output: str = "runs/rm"
    """Folder the trained reward model is written to."""
    num_examples: int = 256
    """Pairs (bt) or labelled completions (prm) to generate when rm.data is empty."""
    samples_per_prompt: int = 8
    """Policy samples per prompt when generating training data (prm: 0 = reference and corrupted solutions only)."""
    counterfactuals: int = 0
    """Training-side only (held-out data unchanged): bt: extra pairs per training pair that differ
    only in the final number; prm: extra reference solutions per training prompt with one wrong
    result (the error only arithmetic spots). Teaches the RM to check numbers, not style."""
    corruptions_per_prompt: int = 1
    """prm data: copies of the reference solution with one injected error, per prompt."""
    corruption_kinds: str = "result,operand,operator,carry,unrelated,stopped"
    """prm data: errors to inject (comma list): result (wrong result), operand (misread number),
    operator (wrong operation), carry (previous result copied wrong), unrelated (a right equation
    on small numbers that has nothing to do with the problem), stopped (right steps that end before
    the answer)."""
    eval_fraction: float = 0.2
    """Held-out share of the data (split by prompt) for pair / step accuracy."""
    train_epochs: int = 2
    """Passes over the training data."""
    learning_rate: float = 2e-5
    """Reward model learning rate (AdamW), also used by iterative refreshes."""
    batch_size: int = 8
    """Pairs (bt) or completions (prm) per optimizer step."""
    margin: float = 0.0
    """Bradley-Terry margin m in -log sigmoid(r_chosen - r_rejected - m)."""
    max_length: int = 384
    """Longest reward-model input in tokens (longer inputs keep their end)."""
    train_layers: int = 0
    """Train only the top K transformer layers and the head (0 = all; speeds up CPU training)."""
    replay_capacity: int = 2048
    """Historical examples kept for replay by iterative refreshes."""
