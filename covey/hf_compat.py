"""Names that changed between transformers releases covey supports (>= 5.0).

transformers 5.2x renamed the KV-cache argument of `forward` and the output field
`past_key_values` to `cache`; the old name still works there but warns on every call
and is announced to go in 5.40. covey passes and reads whichever name the installed
release declares, so it neither warns nor breaks on either side of the rename.
"""

from __future__ import annotations

from dataclasses import fields

from transformers.modeling_outputs import BaseModelOutputWithPast

CACHE_KEY = "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPast)} else "past_key_values"


def with_cache(cache) -> dict:
    """The keyword argument that hands `cache` to a transformers model's forward."""
    return {CACHE_KEY: cache}


def cache_of(output):
    """The KV cache a transformers model's forward returned."""
    return getattr(output, CACHE_KEY)
