"""Rollout masks and the HF engine on the tiny model."""

import torch

from covey.batch import concat_rollouts
from covey.rollout.hf import HFEngine, response_mask_from_ids

EOS, PAD = 2, 2


def test_mask_eos_inside_end_and_absent():
    ids = torch.tensor([
        [5, 6, EOS, PAD, PAD],   # EOS inside: tokens 0..2 trained (EOS included)
        [5, 6, 7, 8, EOS],       # EOS at the last position: all 5 trained
        [5, 6, 7, 8, 9],         # no EOS: all 5 trained, flagged truncated
    ])
    mask, truncated = response_mask_from_ids(ids, [EOS])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_mask_first_of_several_eos_ids():
    ids = torch.tensor([[5, 0, 6, 2]])  # id 0 is also an end token: stop at index 1
    mask, truncated = response_mask_from_ids(ids, [0, 2])
    assert mask.tolist() == [[1, 1, 0, 0]] and truncated.tolist() == [False]


def test_engine_groups_and_padding(tiny_model_dir):
    from covey.models.load import load_policy
    model, tok = load_policy(tiny_model_dir)
    engine = HFEngine(model, tok, max_new_tokens=6)
    torch.manual_seed(0)
    out = engine.generate(["1 + 1 =", "a much longer prompt 3 * 4 ="], group_size=3)
    assert out.response_ids.shape[0] == 6
    assert out.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    # left padding: the shorter prompt's padding is on the left
    assert out.prompt_mask[0, 0] == 0 and out.prompt_mask[0, -1] == 1
    # tokens outside the mask are pad tokens
    assert bool((out.response_ids[out.response_mask == 0] == tok.pad_token_id).all())
    assert len(out.completions) == 6


def test_concat_keeps_groups_distinct(tiny_model_dir):
    from covey.models.load import load_policy
    model, tok = load_policy(tiny_model_dir)
    engine = HFEngine(model, tok, max_new_tokens=4)
    a = engine.generate(["x"], 2)
    b = engine.generate(["longer prompt here"], 2)
    a.scores, b.scores = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])
    merged = concat_rollouts([a, b], tok.pad_token_id)
    assert merged.group_ids.tolist() == [0, 0, 1, 1]
    assert merged.scores.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert merged.prompt_ids.shape[1] == max(a.prompt_ids.shape[1], b.prompt_ids.shape[1])


def test_informative_groups_keeps_only_groups_with_reward_spread():
    from covey.batch import Rollout
    from covey.training.rollout_phase import informative_groups
    r = Rollout(prompt_ids=torch.zeros(6, 1, dtype=torch.long), prompt_mask=torch.ones(6, 1, dtype=torch.long),
                response_ids=torch.zeros(6, 1, dtype=torch.long), response_mask=torch.ones(6, 1),
                group_ids=torch.tensor([7, 7, 3, 3, 9, 9]), truncated=torch.zeros(6, dtype=torch.bool),
                completions=[""] * 6, example_index=[0] * 6,
                scores=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]))
    # group 7 all 1.0 and group 9 all 0.5 carry no signal; group 3 has 0 and 1
    assert informative_groups(r).tolist() == [3]


def chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def engines(tiny_model_dir, max_new_tokens: int):
    from covey.models.load import load_policy
    from covey.rollout.fast import FastEngine
    model, tok = load_policy(tiny_model_dir)
    return tok, {"hf": HFEngine(model, tok, max_new_tokens=max_new_tokens),
                 "fast": FastEngine(model, tok, max_new_tokens=max_new_tokens)}


def test_token_ids_are_prompts_as_their_text_is(tiny_model_dir):
    """A prompt given as its ids (a row to continue) samples what its text does: the same padded prompt
    rows, the same greedy tokens, and with per-prompt seeds the same sampled tokens."""
    tok, by_name = engines(tiny_model_dir, 6)
    texts = [chat(tok, "What is 7 * 8?"), chat(tok, "Name a colour, then a much longer list of animals.")]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for name, engine in by_name.items():
        a, b = engine.generate(texts, 1, greedy=True), engine.generate(ids, 1, greedy=True)
        assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask), name
        assert torch.equal(a.response_ids, b.response_ids) and a.completions == b.completions, name
    fast = by_name["fast"]
    a, b = fast.generate(texts, 3, seeds=[11, 12]), fast.generate(ids, 3, seeds=[11, 12])
    assert torch.equal(a.response_ids, b.response_ids)


def test_a_row_continues_after_appended_ids(tiny_model_dir):
    """Greedy decoding from the prompt's ids plus the first 3 tokens it sampled gives the rest of the
    same reply: continuing a row re-reads its ids (prompt, the model's tokens, anything appended)
    and never decodes them to text."""
    tok, by_name = engines(tiny_model_dir, 8)
    prompt = tok(chat(tok, "What is 12 + 30?"), add_special_tokens=False)["input_ids"]
    for name, engine in by_name.items():
        whole = engine.generate([prompt], 1, greedy=True)
        n = int(whole.response_mask.sum())
        sampled = whole.response_ids[0, :n].tolist()
        assert n > 3, f"{name}: the tiny model ended its reply after {n} tokens"
        rest = engine.generate([prompt + sampled[:3]], 1, greedy=True, max_new_tokens=n - 3)
        assert rest.response_ids[0, :n - 3].tolist() == sampled[3:], name


def test_texts_and_ids_are_not_mixed(tiny_model_dir):
    import pytest

    from covey.rollout.base import encode_prompts
    tok, _ = engines(tiny_model_dir, 2)
    with pytest.raises(TypeError, match="all texts or all token-id lists"):
        encode_prompts(tok, ["text", [1, 2]])


def test_the_samplers_log_probs_are_the_models_at_its_temperature(tiny_model_dir):
    """fast and hf return, for every token they drew, log softmax(logits / T) of the model that drew it:
    the trainer's quantity, so on an fp32 model a teacher-forced pass gives the same numbers."""
    from covey.passes.logprobs import batched_logprobs
    tok, by_name = engines(tiny_model_dir, 6)
    prompts = [chat(tok, "What is 7 * 8?"), chat(tok, "Name a colour.")]
    for name, engine in by_name.items():
        engine.temperature = 0.7
        if name == "hf":
            engine.top_p, engine.top_k = 1.0, 0
        else:
            from covey.rollout.fast import hf_warpers
            engine.warpers = hf_warpers(0.7, 0, 1.0)
        torch.manual_seed(3)
        out = engine.generate(prompts, 2)
        assert out.sample_logp is not None and out.sample_logp.shape == out.response_ids.shape, name
        forced = batched_logprobs(engine.model, out, 0.7, 4)
        mask = out.response_mask.bool()
        assert torch.allclose(out.sample_logp[mask], forced[mask], atol=1e-4), name
        assert bool((out.sample_logp[~mask] == 0).all()), name
