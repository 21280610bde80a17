"""The calculator with scripted first turns, for runs in their own processes (torchrun, `python -m covey.cli`).

Importing this module (`rollout.tools=tests.training.scripted_calls:calculator`) makes the fast engine's episode
loop write a calculator call as the first turn of some episodes: a random tiny model never writes one. Which
ones depends only on the episode's prompt and on the model's own first sampled token (its per-prompt seed
in training, greedy in evaluation), never on the rank or on the row's place in the batch, so one process and
torchrun script the same episodes. The call's tokens replace the sampled ones (their log-probs are the
model's own, as in tests/training/test_agents.py); the tool runs, its reply is appended and the model samples
the second turn. Never imported by pytest's own process: the patch is global.
"""

from __future__ import annotations

import torch

from covey.rollout.fast_episodes import EpisodeRows
from covey.tasks.tools import calculator  # noqa: F401 - the tool rollout.tools names

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
GUESS = '<tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call>'  # an environment's tool
REAL_SAMPLE = EpisodeRows.sample


def scripted(row, first_token: int) -> bool:
    """Whether the episode's first turn is the call: half the episodes, by the prompt and the first token."""
    return (sum(row.episode.prompt) + first_token) % 2 == 0


def sample(self, ids, logits):
    picked, _ = REAL_SAMPLE(self, ids, logits)
    tok = self.engine.tokenizer
    for j, r in enumerate(ids):
        row = self.rows[r]
        if row.episode.turns == 0 and not row.turn:
            row.scripted = scripted(row, picked[j])
        if row.episode.turns == 0 and row.scripted:
            call = GUESS if row.episode.host.toolbox.environment is not None else CALL
            picked[j] = (tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[len(row.turn)]
    logp = torch.log_softmax(logits / self.engine.temperature, -1)[torch.arange(len(ids)), picked]
    return picked, logp.tolist()


def digit_share(completions, **kwargs):
    """Share of digit characters in the episode's messages (the tool's reply included): uneven rewards."""
    texts = ["".join(m["content"] for m in c) if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


EpisodeRows.sample = sample
