"""covey.hf_compat: the KV-cache name the installed transformers declares, used without a warning."""

import warnings

import torch

from covey.hf_compat import CACHE_KEY, cache_of, with_cache
from covey.models import tiny_llama


def test_cache_round_trip_matches_a_full_pass_without_deprecation_warnings():
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=64).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the old name warns on releases that renamed it
        full = model(input_ids=ids).logits
        head = model(input_ids=ids[:, :4], use_cache=True)
        tail = model(input_ids=ids[:, 4:], **with_cache(cache_of(head)), use_cache=True).logits
    assert CACHE_KEY in ("cache", "past_key_values")
    # the last 3 positions computed on the cache equal the same positions of one pass over all 7
    torch.testing.assert_close(tail, full[:, 4:], atol=1e-5, rtol=1e-5)
