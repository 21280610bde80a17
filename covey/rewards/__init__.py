"""Reward sources: rule scorers (this package's `rules`), model scorers, remote clients."""

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
