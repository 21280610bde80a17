"""Speculative decoding for the slot loop (rollout.speculate = K draft tokens; 0: off): drafts from n-grams, no
second model, and a verification that leaves the sampled distribution exactly the model's.

Drafts (`Drafter`). Row r's last n tokens (n = 3, then 2) are looked up, most recent occurrence first, among
the tokens of its group: the prompt, the G siblings' answers so far and its own (prompt lookup across a
group: the siblings of one question repeat its numbers and each other's phrases). Failing that, among the
n-grams of recent calls' answers (`RecentNgrams`, kept by the engine across calls). The up to K tokens that
followed the occurrence are the draft. Suffix-tree drafting from recent rollouts: DAS (arXiv:2511.13841);
drafts from a prompt's siblings: Seer (arXiv:2511.14617).

Verification (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318). The row's
pending token d_0 and its draft d_1..d_m go through one forward; the logits at position i give p_i, the
warped distribution of the token after d_i. A draft is a point mass q_i = 1{x = d_i+1}, so the rejection rule
accepts d_i+1 with probability min(1, p_i(d_i+1) / q_i(d_i+1)) = p_i(d_i+1), compared with one uniform of the
row. At the first rejection the next token is drawn from the residual norm(max(0, p_i - q_i)): p_i with d_i+1
removed and renormalised (`ban`); after a whole accepted draft, from p_m. The token that comes out is then x
with probability

    p(d) * 1{x = d} + (1 - p(d)) * p(x) / (1 - p(d)) * 1{x != d} = p(x),

the model's own distribution (tests/rollout/test_speculate.py checks it with a chi-square test). Greedy rows
accept d_i+1 exactly when it is the argmax of p_i, so their tokens are those of plain greedy decoding. An
accepted token's sampler log-prob is the target model's, log_softmax(logits_i / temperature)(d_i+1), as for
any sampled token.

A speculative step feeds m + 1 columns per slot; rejected drafts' columns are masked out at once and packed
away with the other holes. It pays where a step is bound by reading the weights, not by its tokens: few rows
(the tail of a call). The slot loop speculates only while its busy slots times (K + 1) stay within
`SPECULATE_TOKENS`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

NGRAMS = (3, 2)
"""The n-gram lengths looked up, longest first."""
SPECULATE_TOKENS = 20
"""A step speculates while its busy slots x (K + 1) are at most this many tokens: on 2 CPU cores a SmolLM2-135M
forward of 4 rows x 5 tokens costs 1.7x a step of 4 rows x 1, of 8 x 5 2.1x (dev/LOG.md)."""
PLACES = 4
"""Occurrences kept per n-gram in a call, most recent: the newest are often rows' own last tokens, with nothing
after them yet."""
PAYING_SHARE, PAYING_AFTER = 0.5, 32
"""A call stops drafting once PAYING_AFTER draft tokens have been verified and fewer than PAYING_SHARE of them were
accepted: below that share a verification costs more than the tokens it saves (the measurements of
SPECULATE_TOKENS and bench.rollout: 29% accepted ran 0.86x the plain slots on word problems sampled at temperature 1,
dev/LOG.md)."""
RECENT_LIMIT = 200_000
"""N-grams `RecentNgrams` keeps; the oldest are forgotten first."""


def accepted_counts(probs: Tensor, drafts: Tensor, lengths: Tensor, uniforms: Tensor, greedy: bool) -> Tensor:
    """How many leading draft tokens each row accepts.

    probs (n, m+1, V): the warped distribution after each fed position; drafts (n, m): d_1..d_m, padded past
    `lengths` (n,); uniforms (n, m): one per draft token. d_i+1 is accepted when u_i < p_i(d_i+1) (greedy:
    when it is the argmax of p_i); the count stops at the first rejection or the draft's end."""
    m = drafts.shape[1]
    if m == 0:
        return torch.zeros(len(drafts), dtype=torch.long)
    head = probs[:, :m]
    if greedy:
        ok = head.argmax(-1) == drafts
    else:
        ok = uniforms.to(head.dtype) < head.gather(2, drafts[..., None]).squeeze(2)
    ok &= torch.arange(m)[None, :] < lengths[:, None]
    return ok.long().cumprod(1).sum(1)


def residual_probs(probs: Tensor, ban: list[int | None]) -> Tensor:
    """probs (n, V) with each row's rejected draft token removed (the renormalisation is the sampler's:
    inverse-CDF sampling divides by the row's total)."""
    rows = [j for j, b in enumerate(ban) if b is not None]
    if not rows:
        return probs
    out = probs.clone()
    out[rows, [ban[j] for j in rows]] = 0.0
    return out


class RecentNgrams:
    """N-grams of recent calls' answers -> the tokens that followed them (up to `k`), kept across calls."""

    def __init__(self, k: int, limit: int = RECENT_LIMIT):
        self.k, self.limit = k, limit
        self.table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def add(self, tokens: list[int]) -> None:
        for n in NGRAMS:
            for end in range(n, len(tokens)):
                key = tuple(tokens[end - n:end])
                self.table[key] = tuple(tokens[end:end + self.k])
                self.table.move_to_end(key)
        while len(self.table) > self.limit:
            self.table.popitem(last=False)

    def get(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return self.table.get(key, ())


class Drafter:
    """Drafts for the rows of one call: the n-grams of each group's prompt and answers, then `recent`'s."""

    def __init__(self, k: int, recent: RecentNgrams, prompts: list[list[int]], groups: list[int]):
        """`prompts[g]`: group g's prompt ids; `groups[r]`: row r's group."""
        self.k, self.recent, self.groups = k, recent, groups
        self.seqs: dict[object, list[int]] = {}
        self.where: list[dict[tuple[int, ...], list[tuple[object, int]]]] = [{} for _ in prompts]
        for g, ids in enumerate(prompts):
            self.extend(("prompt", g), g, ids)
        self.drafted = self.accepted = 0

    def extend(self, source, group: int, tokens: list[int]) -> None:
        """Append `tokens` to `source`'s sequence and index the n-grams they end."""
        seq = self.seqs.setdefault(source, [])
        index = self.where[group]
        for token in tokens:
            seq.append(token)
            for n in NGRAMS:
                if len(seq) >= n:
                    places = index.setdefault(tuple(seq[-n:]), [])
                    places.append((source, len(seq)))
                    del places[:-PLACES]

    def add_row(self, row: int, tokens: list[int]) -> None:
        self.extend(row, self.groups[row], tokens)

    def draft(self, row: int, limit: int) -> list[int]:
        """Up to min(k, limit) tokens after the most recent earlier occurrence of the row's last n tokens."""
        seq, limit = self.seqs.get(row, []), min(self.k, limit)
        if limit <= 0:
            return []
        context = self.seqs[("prompt", self.groups[row])] + seq if len(seq) < max(NGRAMS) else seq
        for n in NGRAMS:
            if len(context) < n:
                continue
            key = tuple(context[-n:])
            for source, end in reversed(self.where[self.groups[row]].get(key, [])):
                follow = self.seqs[source][end:end + limit]
                if follow:
                    return follow
            follow = self.recent.get(key)[:limit]
            if follow:
                return list(follow)
        return []

    def paying(self) -> bool:
        """Whether drafting still pays in this call: too few verified to tell, or enough accepted."""
        return self.drafted < PAYING_AFTER or self.accepted >= PAYING_SHARE * self.drafted

    def close(self, answers: list[list[int]]) -> None:
        """The call's answers join the recent n-grams."""
        for tokens in answers:
            self.recent.add(tokens)
