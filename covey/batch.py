"""The Rollout: the typed batch that travels between the stages of a step.

Shapes follow docs/design.md: N = B*G sequences, P prompt tokens (left-padded),
L response tokens (right-padded). Two response masks, both (N, L):

- `response_mask`: the trained tokens, those the model sampled (up to and including
  EOS). They alone carry loss, KL, entropy, advantages and every token count.
- `response_attention`: the attended tokens, every real token of the response. In a
  multi-turn episode the response is the model's turns with the environment's messages
  (tool results, rendered by the chat template) between them: the environment's tokens
  are attended by every forward pass (they condition the model) but carry 0 in
  `response_mask`. It is 1 on a prefix of each row (the padding comes after the last
  real token). None means equal to `response_mask` (a single-turn response).

In a single-turn response both are 1 up to and including EOS; tokens after EOS are
padding and carry 0. docs/algorithms.md ("Episodes: model tokens only") says how each
estimator treats the environment's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


@dataclass
class Rollout:
    prompt_ids: Tensor        # (N, P) left-padded
    prompt_mask: Tensor       # (N, P) 1 on real prompt tokens
    response_ids: Tensor      # (N, L) right-padded with pad_token_id
    response_mask: Tensor     # (N, L) float, 1 up to and including EOS
    group_ids: Tensor         # (N,) long, index of the prompt in the step
    truncated: Tensor         # (N,) bool, no EOS within max_new_tokens
    completions: list[str]    # decoded responses (special tokens removed)
    example_index: list[int]  # (N,) index into the step's example list
    scores: Tensor | None = None       # (N,) total reward
    reward_parts: dict = field(default_factory=dict)  # name -> (N,) tensor
    old_logp: Tensor | None = None     # (N, L)
    ref_logp: Tensor | None = None     # (N, L)
    values: Tensor | None = None       # (N, L) critic values at sampling time
    advantages: Tensor | None = None   # (N, L)
    returns: Tensor | None = None      # (N, L)
    baseline_scores: Tensor | None = None  # (N,) ReMax greedy rewards
    valid: Tensor | None = None        # (N,) bool, False where a reward fault asks for a drop
    messages: list | None = None       # (N,) an episode's chat messages (assistant and tool); None: one turn
    environment_rewards: Tensor | None = None  # (N,) an episode's environment get_reward() (NaN: none)
    environments: list | None = None   # (N,) an episode's environment instance (a reward function's `environments`)
    sample_logp: Tensor | None = None  # (N, L) the sampler's log-prob of each token it drew, 0 on padding
    response_attention: Tensor | None = None  # (N, L) 1 on every real response token; None: response_mask
    old_entropy: Tensor | None = None  # (N, L) pi_old's entropy at each token (token selection, adaptive entropy)
    cov_tokens: Tensor | None = None   # (N, L) bool: the tokens a covariance control acts on (Clip-Cov, KL-Cov)
    is_weights: Tensor | None = None   # (N, L) the sampler correction's bounded pi_old/mu (algo.tis.*), no gradient
    kept_tokens: Tensor | None = None  # (N, L) bool: the tokens whose policy term the high-entropy selection keeps
    turn_steps: list | None = None     # (N,) an episode's model turns: (index of its last token, score) each
    cut: Tensor | None = None          # (N,) bool: rows a call's quorum stopped before their end (rollout.partial)

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def response_attended(self) -> Tensor:
        """(N, L) the attended response tokens: `response_attention`, or `response_mask` where it is None."""
        return self.response_mask if self.response_attention is None else self.response_attention

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_attended.to(self.prompt_mask.dtype)], dim=1)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def select(self, index: Tensor) -> "Rollout":
        """Rows `index` of every per-sequence field (lists included)."""
        out = {}
        idx_list = index.tolist()
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                out[f.name] = value[index]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in idx_list]
            elif isinstance(value, dict):
                out[f.name] = {k: v[index] for k, v in value.items()}
            else:
                out[f.name] = value
        return Rollout(**out)


def pad(t: Tensor, width: int, left: bool, value) -> Tensor:
    """(N, w) -> (N, width) filled with `value` on the left or the right."""
    extra = width - t.shape[1]
    if extra == 0:
        return t
    filler = torch.full((t.shape[0], extra), value, dtype=t.dtype)
    return torch.cat([filler, t] if left else [t, filler], dim=1)


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack scored rollouts of different widths (prompts left-padded, responses right-padded).

    Group ids are offset so groups of different parts stay distinct; `example_index`
    values are kept (they index the task's example list, shared by all parts).
    Per-row scores and the sampler's log-probs are carried; per-token fields of the train-time passes
    (log-probs, values) are not. `response_attention`
    is carried where a part has it (a part without it contributes its `response_mask`).
    """
    p_len = max(r.prompt_ids.shape[1] for r in parts)
    l_len = max(r.response_ids.shape[1] for r in parts)

    offset = 0
    groups = []
    for r in parts:
        groups.append(r.group_ids + offset)
        offset += int(r.group_ids.max()) + 1 if len(r) else 0

    def per_row(name: str):
        values = [getattr(r, name) for r in parts]
        return torch.cat(values) if all(v is not None for v in values) else None

    attention = None
    if any(r.response_attention is not None for r in parts):
        dtype = next(r.response_attention.dtype for r in parts if r.response_attention is not None)
        attention = torch.cat([pad(r.response_attended.to(dtype), l_len, False, 0) for r in parts])
    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, p_len, True, pad_token_id) for r in parts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, p_len, True, 0) for r in parts]),
        response_ids=torch.cat([pad(r.response_ids, l_len, False, pad_token_id) for r in parts]),
        response_mask=torch.cat([pad(r.response_mask, l_len, False, 0.0) for r in parts]),
        group_ids=torch.cat(groups),
        truncated=torch.cat([r.truncated for r in parts]),
        completions=[c for r in parts for c in r.completions],
        example_index=[i for r in parts for i in r.example_index],
        scores=per_row("scores"),
        baseline_scores=per_row("baseline_scores"),
        valid=per_row("valid"),
        environment_rewards=per_row("environment_rewards"),
        sample_logp=(torch.cat([pad(r.sample_logp, l_len, False, 0.0) for r in parts])  # the sampler's, per token
                     if all(r.sample_logp is not None for r in parts) else None),
        messages=[m for r in parts for m in r.messages] if all(r.messages is not None for r in parts) else None,
        environments=([e for r in parts for e in r.environments] if all(r.environments is not None for r in parts)
                      else None),
        turn_steps=([t for r in parts for t in r.turn_steps] if all(r.turn_steps is not None for r in parts)
                    else None),
        reward_parts={k: torch.cat([r.reward_parts[k] for r in parts]) for k in parts[0].reward_parts},
        response_attention=attention,
    )
