"""Whole token sequences through one model at train time: the packed (or padded) forward pass of supervised
fine-tuning and of a teacher's full next-token distributions.

`Sequences` are right-padded rows with the tokens a loss trains marked. `layout` lays them out for one forward:
packed (covey/passes/packing.py: a micro-batch's rows end to end in rows of the packed width, each attending
causally to itself only, at its own positions; the same numbers as a padded pass, row by row, without the
padding) or, for a model whose layers cannot be packed (a recurrent state), padded. `layout_logits` runs the
model on a layout; `token_scores` gives each token's log-prob at temperature 1 and whether it was the most
likely one (covey/training/sft.py; the teacher's pass of GKD's loss is covey/training/distill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from covey import algos
from covey.models.attention import attention_implementation
from covey.models.families import family_of
from covey.passes.logprobs import BF16_WIDTH_MULTIPLE, additive, logit_chunk, packs, pass_settings
from covey.passes.packing import Packing, layer_masks, pack, row_capacity, unpack
from covey.runtime import dist
from covey.runtime.precision import autocast_context, model_device

NO_PROMPT = torch.ones(1, 0, dtype=torch.long)
"""The packed layout's prompt mask: a conversation is packed whole, with no prompt cache under it."""


@dataclass
class Sequences:
    """Whole token sequences, right-padded: ids (n, W), their lengths (n,), and 1 on each token the loss
    trains (n, W); column j of a (n, W - 1) score is token j + 1's."""
    ids: Tensor
    lengths: Tensor
    trained: Tensor

    def select(self, index: Tensor, device=None) -> "Sequences":
        return Sequences(*(t[index].to(device) if device is not None else t[index]
                           for t in (self.ids, self.lengths, self.trained)))

    @property
    def target_mask(self) -> Tensor:
        """(n, W - 1) 1 on the trained tokens among 1..W-1 (token 0 is never predicted)."""
        return self.trained[:, 1:]


def stack(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Sequences:
    """(ids, trained marks) of each row -> right-padded Sequences."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    trained = torch.zeros(len(rows), width)
    for i, (row, marks) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        trained[i, :len(marks)] = torch.tensor(marks, dtype=torch.float)
    return Sequences(ids, torch.tensor([len(r) for r, _ in rows]), trained)


@dataclass
class Layout:
    """Where a forward pass reads tokens 1..W-1 of each row: packed rows (`packing`) or the padded rows."""
    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    packing: Packing | None
    pad_mask: Tensor | None
    """(n, W - 1) the padded pass's attention mask (None when packed)."""
    shape: tuple[int, int]
    """(n, W - 1): the rows' scores once laid back."""

    def rows(self, scores: Tensor) -> Tensor:
        """Scores of the layout's positions -> (n, W - 1), 0 where no token is predicted."""
        return unpack(scores, self.packing, *self.shape) if self.packing is not None else scores

    def laid(self, per_row: Tensor) -> Tensor:
        """(n, W - 1) per row -> the layout's positions, 0 on padding: the inverse of `rows`."""
        if self.packing is None:
            return per_row
        return per_row.new_zeros(self.targets.shape).index_put(self.packing.source, per_row[self.packing.dest])


def layout(model, seqs: Sequences, precision: str, packed: bool) -> Layout:
    """`seqs` packed (every row's tokens but the last fed, causally within the row) or padded."""
    ids, lengths, device = seqs.ids, seqs.lengths, seqs.ids.device
    shape = (ids.shape[0], ids.shape[1] - 1)
    if not packed:
        mask = (torch.arange(shape[1], device=device)[None, :] < lengths[:, None]).long()
        return Layout(ids[:, :-1], torch.arange(shape[1], device=device).expand(shape), ids[:, 1:], None, mask,
                      shape)
    _, low, implementation = pass_settings(model, precision, device)
    zeros = torch.zeros_like(lengths)
    packing = pack(ids, lengths, zeros, zeros, NO_PROMPT.to(device), width_multiple=BF16_WIDTH_MULTIPLE if low else 1,
                   min_capacity=row_capacity(implementation))
    return Layout(packing.input_ids, packing.position_ids, packing.targets, packing, None, shape)


def layout_logits(model, lay: Layout, precision: str) -> Tensor:
    """The model's logits at the layout's positions ((K, T, V) packed, (n, W - 1, V) padded)."""
    device = model_device(model)
    precision, _, implementation = pass_settings(model, precision, device)
    if lay.packing is not None:
        attention = layer_masks(lay.packing, NO_PROMPT.to(device), family_of(model.config))
        if implementation == "eager":  # eager adds the mask to the scores
            attention = ({kind: additive(m) for kind, m in attention.items()} if isinstance(attention, dict)
                         else additive(attention))
    else:
        attention = lay.pad_mask
    with autocast_context(precision, device), attention_implementation(model, implementation):
        return model(input_ids=lay.input_ids, attention_mask=attention, position_ids=lay.position_ids,
                     use_cache=False).logits


def packs_all(*models) -> bool:
    """Every model takes the packed pass, on every rank (under FSDP each rank runs the same passes)."""
    return dist.on_all_ranks(all(packs(m) for m in models))


def token_scores(model, seqs: Sequences, precision: str) -> tuple[Tensor, Tensor]:
    """(log-prob (n, W - 1) of each row's tokens 1..W-1 at temperature 1, whether each is the most likely one)."""
    lay = layout(model, seqs, precision, packs_all(model))
    logits = layout_logits(model, lay, precision)
    logp, _ = algos.logprobs_and_entropy(logits, lay.targets, 1.0, logit_chunk(logits))
    right = logits.detach().argmax(-1) == lay.targets
    return lay.rows(logp), lay.rows(right)
