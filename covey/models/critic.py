"""Critic and reward model: `ValueModel` = a causal LM's backbone + Linear(H, 1), one value per position.

`response_values` aligns a critic's values with the response tokens (PPO);
`last_token_scores` reads a reward model's score at each sequence's last token.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from covey.models.errors import ModelError
from covey.models.load import as_dtype, load_pretrained, resolve_model_path

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """Causal-LM backbone + scalar head: one value per position, `(N, T)`.

    Critic for PPO (values aligned with `response_values`) and reward model
    (score read with `last_token_scores`). The head starts at zero so initial
    values are exactly 0 and the first update cannot be dominated by a random head.
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.head = head if head is not None else nn.Linear(hidden, 1)
        if head is None:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        self.head.float()  # values in fp32 even with a bf16 backbone

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_policy_path(cls, spec: str, dtype=torch.float32, device="cpu") -> "ValueModel":
        """Backbone loaded from a policy spec (lm_head dropped), fresh zero head."""
        from transformers import AutoModel

        path = resolve_model_path(spec)
        return cls(load_pretrained(AutoModel, path, dtype=as_dtype(dtype))).to(device)

    @classmethod
    def from_causal_lm(cls, policy: nn.Module) -> "ValueModel":
        """Copy of an in-memory policy's backbone (no disk round trip), fresh zero head."""
        return cls(copy.deepcopy(policy.base_model))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """Values (N, T): `values[:, j]` is V of the prefix `input_ids[:, :j+1]`.

        Position ids default to the mask's cumulative sum, so left padding sees the
        same positions as generation.
        """
        if position_ids is None and attention_mask is not None:
            position_ids = self._positions(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)

    def frozen_prefix(self) -> int:
        """Leading decoder layers that cannot change (they and the embeddings have no trainable
        parameter): their output can be computed once and reused (`hidden_below`)."""
        layers = getattr(self.backbone, "layers", None)
        embed = getattr(self.backbone, "embed_tokens", None)
        if layers is None or embed is None or not hasattr(self.backbone, "norm"):
            return 0  # not a Llama-like backbone: no split forward
        if any(p.requires_grad for p in embed.parameters()):
            return 0
        count = 0
        for layer in layers:
            if any(p.requires_grad for p in layer.parameters()):
                break
            count += 1
        return min(count, len(layers) - 1)  # the top layer always runs, so the final norm stays in place

    @contextlib.contextmanager
    def _only_layers(self, start: int, stop: int, final_norm: bool):
        """Run the backbone with decoder layers [start, stop) only (and the final norm or not)."""
        layers, norm = self.backbone.layers, self.backbone.norm
        self.backbone.layers = nn.ModuleList(list(layers)[start:stop])
        self.backbone.norm = norm if final_norm else nn.Identity()
        try:
            yield
        finally:
            self.backbone.layers, self.backbone.norm = layers, norm

    @staticmethod
    def _positions(attention_mask: Tensor) -> Tensor:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    @torch.no_grad()
    def hidden_below(self, input_ids: Tensor, attention_mask: Tensor, n_layers: int) -> Tensor:
        """Hidden states (N, T, H) entering decoder layer `n_layers` (the output of the layers below)."""
        with self._only_layers(0, n_layers, final_norm=False):
            return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=self._positions(attention_mask), use_cache=False).last_hidden_state

    def values_from_hidden(self, hidden: Tensor, attention_mask: Tensor, n_layers: int) -> Tensor:
        """Values (N, T) from `hidden_below(..., n_layers)`: runs layers n_layers.. and the head;
        equal to `forward` on the same inputs."""
        with self._only_layers(n_layers, len(self.backbone.layers), final_norm=True):
            out = self.backbone(inputs_embeds=hidden, attention_mask=attention_mask,
                                position_ids=self._positions(attention_mask), use_cache=False).last_hidden_state
        return self.head(out.float()).squeeze(-1)

    def save_pretrained(self, out_dir: str | Path, tokenizer=None) -> None:
        """Backbone as an HF folder plus `value_head.safetensors` (and tokenizer if given)."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(out_dir)
        head = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        save_file(head, str(Path(out_dir) / VALUE_HEAD_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=torch.float32, device="cpu") -> "ValueModel":
        """Load what `save_pretrained` wrote."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        head_file = Path(path) / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise ModelError(f"not a saved value model (no {VALUE_HEAD_FILE}): {path}")
        model = cls(load_pretrained(AutoModel, str(path), dtype=as_dtype(dtype)))
        model.head.load_state_dict(load_file(str(head_file)))
        return model.to(device)


def response_values(values_full: Tensor, prompt_len: int, response_len: int | None = None) -> Tensor:
    """Values aligned with response tokens, `(N, L)`, from values over prompt+response `(N, P+L)`.

    The value of response token t is V(s_t), the state *before* emitting it: the
    prefix prompt + response[:t], whose last token sits at position P + t - 1.
    So the slice is `values_full[:, P-1 : P-1+L]` (the last position, after the
    final token, is unused). Prompts must be left-padded to the common width P.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1: the first response value is read at P-1")
    if response_len is None:
        response_len = values_full.shape[1] - prompt_len
    return values_full[:, prompt_len - 1: prompt_len - 1 + response_len]


def last_token_scores(values: Tensor, attention_mask: Tensor) -> Tensor:
    """Score per sequence `(N,)`: the value at the last non-pad token (left or right padding)."""
    mask = attention_mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("last_token_scores: a sequence has no non-pad token")
    width = mask.shape[1]
    last = width - 1 - mask.flip(1).int().argmax(dim=1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)
