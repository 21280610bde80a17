"""Reward sources: rule scorers (this package's `rules`), model scorers, remote clients.

- rules: rule rewards with TRL's signature (correctness, format, length, language);
- combine: the weighted sum of reward functions, with an explicit failure policy;
- build: the reward config into a Rewarder, the user's functions loaded and checked first;
- scoring: a sampled batch's reward inputs as TRL passes them, and its scores on the Rollout;
- steps: the step rewards of process supervision, mapped to the tokens where steps end;
- learned: learned reward sources, a Bradley-Terry outcome RM and a process RM;
- remote: a reward served over HTTP, as a TRL-shaped reward function; server: `covey serve-reward`;
- sandbox: a model's Python program run in a separate, limited process, and the code reward;
- judge: LLM-as-judge over a group, a local model or an OpenAI-compatible endpoint scoring a group's answers.
"""

from covey.rewards.rules import (
    RULE_REWARDS,
    completion_text,
    correctness_reward,
    extract_answer,
    find_marked_answer,
    format_reward,
    get_rule_reward,
    language_consistency,
    language_share,
    last_number,
    math_equal,
    normalize_number,
    overlong_penalty,
)

__all__ = [
    "RULE_REWARDS", "completion_text", "correctness_reward", "extract_answer", "find_marked_answer",
    "format_reward", "get_rule_reward", "language_consistency", "language_share", "last_number",
    "math_equal", "normalize_number", "overlong_penalty",
]
