"""covey.models.hf_compat: the KV-cache name the installed transformers declares, used without a warning; logits_to_keep
as indices."""

import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from covey.models.hf_compat import CACHE_KEY, cache_of, last_positions, with_cache
from covey.models.tiny import tiny_llama


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


def test_last_positions_keep_the_same_logits_without_a_batched_weight_copy():
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=64).eval().requires_grad_(False)  # frozen, as the reference and the bf16 copy

    def forward(keep):
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            logits = model(input_ids=ids, logits_to_keep=keep).logits
        return logits, "aten::bmm" in {e.key for e in prof.key_averages()}

    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    assert last_positions(2, 9, "cpu").tolist() == [7, 8]
    by_int, int_copies = forward(2)
    by_index, index_copies = forward(last_positions(2, 9, "cpu"))
    torch.testing.assert_close(by_index, by_int)
    assert by_index.shape == (3, 2, 64)
    # with a frozen weight, the int form projects a strided view as a batched product over per-row copies
    # of the (V, d) weight (aten::bmm); the gathered indices give a plain matrix product
    assert int_copies and not index_copies
