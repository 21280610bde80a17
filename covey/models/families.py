"""What each model architecture needs from covey's passes and engines, read from its config alone.

A family is served only where the engine's tokens, the sampler's log-probs and the training
log-probs agree with a plain forward (tests/rollout/test_families_engine.py and
tests/passes/test_family_logprobs.py build a tiny random model of every family below and check
all three). What a pass needs to know is each decoder layer's kind:

- ``full_attention``: causal attention over the whole sequence;
- ``sliding_attention``: causal attention over the last `window` positions only, the query's own
  included (transformers' `sliding_window_overlay`: key position > query position - window);
  Gemma 3, gpt-oss, Mistral and Qwen2 with a window;
- ``linear_attention``: a recurrent layer with a convolution and a recurrent state instead of keys
  and values (Qwen3.5's Gated DeltaNet); its state runs through every earlier token of the row.

A config with no `layer_types` is uniform: sliding in every layer when it sets `sliding_window`
(Mistral, Mixtral, Phi-3), full attention otherwise. Any other layer kind (chunked attention,
Mamba blocks, ...) is refused by `check_family` before the model loads, in one line that names the
family and the kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from covey.models.errors import ModelError

ATTENTION_KINDS = ("full_attention", "sliding_attention")
RECURRENT_KINDS = ("linear_attention",)
SERVED_KINDS = ATTENTION_KINDS + RECURRENT_KINDS


@dataclass(frozen=True)
class Family:
    """The layer pattern of one model: `layer_types` (one kind per decoder layer), the sliding `window`
    (None without sliding layers), and whether it routes tokens to experts (`moe`)."""
    model_type: str
    layer_types: tuple[str, ...]
    window: int | None
    moe: bool
    context: int | None = None
    """The positions the model was trained for (max_position_embeddings), where the config says."""

    @property
    def sliding(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a state that runs through the whole row (no keys/values to mask)."""
        return any(kind in RECURRENT_KINDS for kind in self.layer_types)

    @property
    def mixed(self) -> bool:
        """Layers of more than one kind: the model takes one mask per kind."""
        return len(set(self.layer_types)) > 1

    @property
    def packs(self) -> bool:
        """Whether the packed pass is exact: responses laid end to end in one row may not leak into each
        other, which a 4-D mask ensures for attention layers and nothing ensures for a recurrent state."""
        return not self.recurrent

    def describe(self) -> str:
        """One start-up phrase: the family and its layer pattern."""
        counts = {kind: self.layer_types.count(kind) for kind in dict.fromkeys(self.layer_types)}
        parts = [f"{n} {kind.replace('_attention', '')}" + (f" (window {self.window})"
                                                           if kind == "sliding_attention" else "")
                 for kind, n in counts.items()]
        return f"{self.model_type}: " + ", ".join(parts) + (" layers" if parts else "") + (", experts" if self.moe
                                                                                          else "")


def text_config(config):
    """The decoder's config of a multimodal config (Gemma 3's, Qwen3.5's), else the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def family_of(config) -> Family:
    """The Family of a transformers config (a model's `.config`, or `AutoConfig.from_pretrained`)."""
    text = text_config(config)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window else "full_attention"] * layers
    layer_types = tuple(layer_types)[:layers] if layers else tuple(layer_types)
    if "sliding_attention" not in layer_types:
        window = None
    moe = any(getattr(text, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    context = getattr(text, "max_position_embeddings", None)
    return Family(str(getattr(text, "model_type", type(text).__name__)), layer_types,
                  int(window) if window else None, bool(moe), int(context) if context else None)


def check_family(config) -> Family:
    """The Family, or a one-line ModelError naming the family and what covey lacks for it."""
    family = family_of(config)
    text = text_config(config)
    unknown = sorted(set(family.layer_types) - set(SERVED_KINDS))
    if unknown:
        raise ModelError(f"model family {family.model_type} is not served: its layers of kind "
                         f"{', '.join(unknown)} have no exact packed pass or engine cache in covey "
                         f"(served kinds: {', '.join(SERVED_KINDS)})")
    if getattr(text, "use_bidirectional_attention", False):
        raise ModelError(f"model family {family.model_type} is not served: use_bidirectional_attention "
                         "makes it an encoder, not a causal LM")
    if family.sliding and not family.window:
        raise ModelError(f"model family {family.model_type} has sliding-attention layers but no sliding_window "
                         "in its config")
    return family


def check_model_family(path: str) -> Family:
    """`check_family` of a model folder or cached hub id, from its config alone (before any weight loads)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"could not read the config of model {path!r}: {str(err).splitlines()[0]}") from err
    return check_family(config)
