"""Every model family's training log-probs equal a plain forward's: the packed pass, the padded pass, the
packed pass on the step's prompt cache, and under bf16 autocast.

The reference is one unpadded forward per sequence (prompt then response), the model's own masks:
nothing covey builds. Responses of 20 tokens and a prompt of 11 run past the tiny models' sliding
window of 8 (covey/models/tiny.py), so a sliding layer that attended its whole sequence, or a prompt
cache that kept only a sliding layer's last window - 1 keys, would give other numbers: with one mask
for every layer the packed pass was off by 0.18 to 0.32 nats on qwen2_window, mistral_window, gemma3
and gpt_oss.
"""

import pytest
import torch

from covey.batch import Rollout
from covey.models.attention import attention_implementation
from covey.models.families import family_of
from covey.models.tiny import FAMILY_NAMES, TINY_WINDOW, tiny_family_model, tiny_tokenizer
from covey.passes import logprobs
from covey.passes.logprobs import batched_logprobs, encode_prompts, packs, policy_logprobs

PROMPT_LENGTHS = [11, 4]        # left-padded to 11; the first is longer than the window
RESPONSE_LENGTHS = [20, 13, 20, 9]  # rows 0, 1 continue prompt 0; rows 2, 3 prompt 1


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family_model(request, tok):
    return request.param, tiny_family_model(request.param, len(tok)).eval()


def family_rollout(vocab: int, seed: int = 1) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    width, length = max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompts = torch.randint(3, vocab, (2, width), generator=g)
    prompt_mask = torch.zeros(2, width, dtype=torch.long)
    for row, n in enumerate(PROMPT_LENGTHS):
        prompt_mask[row, width - n:] = 1
    prompts = torch.where(prompt_mask.bool(), prompts, 2)
    index = torch.tensor([0, 0, 1, 1])
    lengths = torch.tensor(RESPONSE_LENGTHS)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    responses = torch.where(mask.bool(), torch.randint(3, vocab, (4, length), generator=g), 2)
    return Rollout(prompt_ids=prompts[index], prompt_mask=prompt_mask[index], response_ids=responses,
                   response_mask=mask, group_ids=index, truncated=torch.zeros(4, dtype=torch.bool),
                   completions=[""] * 4, example_index=index.tolist())


@torch.no_grad()
def plain_logprobs(model, rollout: Rollout) -> torch.Tensor:
    """(N, L) log-probs of each response token from one forward over its own unpadded sequence."""
    out = torch.zeros(rollout.response_ids.shape)
    for row in range(len(rollout)):
        prompt = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()]
        n = int(rollout.response_mask[row].sum())
        response = rollout.response_ids[row, :n]
        logits = model(torch.cat([prompt, response])[None]).logits[0, -n - 1:-1].float()
        out[row, :n] = torch.log_softmax(logits, -1).gather(1, response[:, None])[:, 0]
    return out


def test_the_rollout_runs_past_the_window():
    # 11 prompt + 20 response positions: a sliding layer at the last token sees 8 of 30 earlier ones
    assert max(PROMPT_LENGTHS) > TINY_WINDOW and max(RESPONSE_LENGTHS) > 2 * TINY_WINDOW


def test_packed_pass_equals_a_plain_forward(family_model, tok):
    name, model = family_model
    rollout = family_rollout(len(tok))
    with torch.no_grad():
        logp, _, _ = policy_logprobs(model, rollout, 1.0)
    expected = plain_logprobs(model, rollout)
    assert packs(model) == family_of(model.config).packs  # qwen3_5 (a recurrent state) takes the padded pass
    torch.testing.assert_close(logp * rollout.response_mask, expected, atol=1e-5, rtol=0)


def test_padded_pass_equals_a_plain_forward(family_model, tok, monkeypatch):
    name, model = family_model
    rollout = family_rollout(len(tok))
    monkeypatch.setattr(logprobs, "packs", lambda model: False)
    with torch.no_grad():
        logp, _, _ = policy_logprobs(model, rollout, 1.0)
    torch.testing.assert_close(logp.float() * rollout.response_mask, plain_logprobs(model, rollout), atol=1e-5, rtol=0)


def test_packed_pass_on_the_step_prompt_cache_equals_a_plain_forward(family_model, tok):
    # batched_logprobs encodes the step's prompts once, then each micro-batch of 1 or 3 rows reads its slice
    name, model = family_model
    rollout = family_rollout(len(tok))
    expected = plain_logprobs(model, rollout)
    for micro in (1, 3):
        logp = batched_logprobs(model, rollout, 1.0, micro)
        torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
    encoded = encode_prompts(model, rollout, torch.arange(len(rollout)))
    assert (encoded is not None) == family_of(model.config).packs


def test_eager_attention_packed_pass_equals_a_plain_forward(family_model, tok):
    # eager takes the masks as additive -inf/0 tensors, one per layer kind
    name, model = family_model
    rollout = family_rollout(len(tok))
    expected = plain_logprobs(model, rollout)
    with torch.no_grad(), attention_implementation(model, "eager"):
        logp, _, _ = policy_logprobs(model, rollout, 1.0)
    torch.testing.assert_close(logp * rollout.response_mask, expected, atol=1e-5, rtol=0)


def test_bf16_autocast_packed_pass_is_the_padded_pass_in_bf16(family_model, tok, monkeypatch):
    # under autocast both passes round the same products to bf16: they agree to bf16's rounding
    # (a wrong window gave 0.2-0.3 nats, far above it), and both stay near the float32 plain forward
    name, model = family_model
    rollout = family_rollout(len(tok))
    with torch.no_grad():
        packed, _, _ = policy_logprobs(model, rollout, 1.0, precision="bfloat16")
        monkeypatch.setattr(logprobs, "packs", lambda model: False)
        padded, _, _ = policy_logprobs(model, rollout, 1.0, precision="bfloat16")
    mask = rollout.response_mask
    assert float(((packed - padded).abs() * mask).max()) < 0.05
    assert float(((packed * mask - plain_logprobs(model, rollout)).abs()).max()) < 0.1


def test_gradients_of_the_packed_pass_equal_the_padded_pass(tok, monkeypatch):
    # the sliding family with both layer kinds: the gradient flows through both masks and the prompt cache
    model = tiny_family_model("gemma3", len(tok)).double()
    rollout = family_rollout(len(tok))
    weights = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def grads(packed: bool):
        model.zero_grad()
        with monkeypatch.context() as patch:
            if not packed:
                patch.setattr(logprobs, "packs", lambda model: False)
            logp, _, _ = policy_logprobs(model, rollout, 1.0)
        (logp * weights * rollout.response_mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed, padded = grads(True), grads(False)
    assert packed.keys() == padded.keys()
    # the log-softmax runs in float32 whatever the model's precision (covey/algos/logits.py): both passes
    # agree to float32 rounding (1e-7 here), where one mask for every layer gave differences of order 0.1
    for name in packed:
        torch.testing.assert_close(packed[name], padded[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_recurrent_model_reads_each_row_from_its_first_token(tok):
    # transformers' chunked Gated DeltaNet is not exact under left padding: with weights of scale 0.3 a row
    # padded on the left differs from the same row alone by about 3e-4 even in float64 (dev/LOG.md); aligned
    # left, the padded pass is the plain forward up to the float32 log-softmax
    model = tiny_family_model("qwen3_5", len(tok)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    rollout = family_rollout(len(tok))
    with torch.no_grad():
        logp, _, _ = policy_logprobs(model, rollout, 1.0)
    torch.testing.assert_close(logp.float() * rollout.response_mask, plain_logprobs(model, rollout), atol=1e-5, rtol=0)
