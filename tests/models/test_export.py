"""covey/models/export.py and gguf_writer.py: GGUF files that covey's own GGUF import reads back to the same
model and tokenizer, LoRA adapters merged into full weights, and the model card of a run's final/."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("gguf")

import covey  # noqa: E402
from covey.models.default import convert_gguf, prepare_default_model  # noqa: E402
from covey.models.errors import ModelError  # noqa: E402
from covey.models.export import (  # noqa: E402
    BARS,
    export_run,
    held_out,
    model_card,
    run_card,
    sparkline,
)
from covey.models.gguf_writer import (  # noqa: E402
    check_exportable,
    encode,
    permute_qk,
    pre_tokenizer_name,
    write_gguf,
)
from covey.models.tiny import tiny_family_config  # noqa: E402
from tests.helpers import tiny_overrides  # noqa: E402

TEXTS = ["What is 12 + 7? Answer with a number.", "Hello world, 1234567 tokens!  two spaces\n\nnew lines\t tabs",
         "<|im_start|>user\nhi<|im_end|>\n", "émoji 🤖 ünïcödé", " leading space", ""]
# q8_0 logits against the run's model: at most this share of the largest |logit|. Measured 0.52% on the tiny
# model and 3.0% on SmolLM2-135M-Instruct (docs/export.md); each weight is kept to within half a step of
# its block's scale (max |x| / 127), about 0.4% of the block's largest weight.
Q8_0_LOGIT_SHARE = 0.02


def load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(str(folder))


def logits(model, tokenizer, text=TEXTS[0] + TEXTS[1]):
    with torch.no_grad():
        return model(torch.tensor([tokenizer(text)["input_ids"]])).logits[0]


def round_trip(model, tokenizer, tmp_path, quant):
    """The model and tokenizer that covey's GGUF import (model.path=FILE.gguf) makes of the exported file."""
    path = write_gguf(model, tokenizer, tmp_path / f"m-{quant}.gguf", quant)
    convert_gguf(path, tmp_path / f"back-{quant}")
    return load(tmp_path / f"back-{quant}")


def assert_same_tokenizer(tokenizer, back):
    for text in TEXTS:
        assert back(text)["input_ids"] == tokenizer(text)["input_ids"], text
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert back.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(back, name) == getattr(tokenizer, name), name


# --------------------------------------------------------------------------- the formulas


def test_permute_qk_moves_rows_as_llama_cpp_does():
    # one head of 4 rows (half = 2): HF row i * half + j goes to llama.cpp row 2j + i:
    # r0 (i0 j0) -> 0, r1 (i0 j1) -> 2, r2 (i1 j0) -> 1, r3 (i1 j1) -> 3: llama.cpp order r0 r2 r1 r3
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)  # row k holds (2k, 2k + 1)
    assert permute_qk(rows, 1)[:, 0].tolist() == [0, 4, 2, 6]
    # two heads of 4 rows: each head permuted alone
    assert permute_qk(np.arange(8, dtype=np.float32), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_q8_0_keeps_each_weight_to_half_a_step_of_its_block():
    # a row of 32: max |x| = 1.984375 = 127 / 64, so the step is d = 1/64 (exact in float16).
    # 0.0234375 = 1.5 d rounds away from zero to 2 d = 0.03125; -0.01 = -0.64 d -> -1 d = -0.015625
    row = np.zeros((1, 32), dtype=np.float32)
    row[0, :3] = [1.984375, 0.0234375, -0.01]
    import gguf
    data, raw = encode(row, "q8_0")
    assert raw == gguf.GGMLQuantizationType.Q8_0 and data.shape == (1, 34)  # 2 bytes of scale + 32 int8
    back = gguf.quants.dequantize(data, raw)
    assert back[0, :3].tolist() == [1.984375, 0.03125, -0.015625] and not back[0, 3:].any()
    # rows not a multiple of 32 stay float16; vectors float32
    assert encode(np.ones((2, 48), np.float32), "q8_0")[0].dtype == np.float16
    assert encode(np.ones(48, np.float32), "q8_0")[0].dtype == np.float32


def test_sparkline_scales_from_the_smallest_to_the_largest():
    # scale = 7 / (1 - 0) = 7: 0 -> 0.5 -> bar 0; 0.5 -> 4.0 -> bar 4; 1 -> 7.5 -> bar 7; 0.25 -> 2.25 -> bar 2
    assert sparkline([0, 0.5, 1, 0.25]) == BARS[0] + BARS[4] + BARS[7] + BARS[2] == "▁▅█▃"
    assert sparkline([3, 3]) == "▁▁"  # flat
    assert sparkline([0, 2, 4, 6], width=2) == "▁█"  # buckets (0 + 2) / 2 = 1 and (4 + 6) / 2 = 5
    assert sparkline([float("nan"), 1, 2]) == "▁█" and sparkline([]) == ""


def test_held_out_figures_are_the_step_0_and_final_lines():
    metrics = [{"step": 0, "eval/accuracy": 0.25, "eval/n": 8}, {"step": 1, "reward/mean": 0.5},
               {"step": 2, "eval/accuracy": 0.5, "eval/n": 8}, {"step": 3, "eval/accuracy": 0.625, "eval/n": 8,
                                                                "final": 1}]
    assert held_out(metrics, {"metric": "math"}) == ("25.0% of 8", "62.5% of 8")
    by_reward = [{"step": 0, "eval/reward_pass": 0.5, "eval/n": 4}, {"step": 1, "final": 1}]
    assert held_out(by_reward, {"metric": "reward"}) == ("50.0% of 4", "")


def test_refusals_name_what_is_not_supported():
    refused = r"^export to gguf: architecture 'qwen3' is not supported \(supported: llama\)$"
    with pytest.raises(ModelError, match=refused):
        check_exportable(tiny_family_config("qwen3", 512))
    from transformers import LlamaConfig
    scaled = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ModelError, match="rope scaling 'linear' is not supported"):
        check_exportable(scaled)
    with pytest.raises(ModelError, match="attention_bias=true"):
        check_exportable(LlamaConfig(attention_bias=True))


def test_pre_tokenizer_names():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    assert pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}) == "gpt-2"
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]}, "behavior": "Isolated"},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    assert pre_tokenizer_name(llama3) == "llama-bpe"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                    {"type": "ByteLevel", "add_prefix_space": False}]}
    with pytest.raises(ModelError, match="pre-tokenizer .* has no llama.cpp name"):
        pre_tokenizer_name(digits)  # transformers would read it back without the digit split


# --------------------------------------------------------------------------- GGUF round trips


def test_f16_round_trip_equals_the_model_up_to_f16_rounding(tiny_model_dir, tmp_path):
    model, tokenizer = load(tiny_model_dir)
    back, back_tokenizer = round_trip(model, tokenizer, tmp_path, "f16")
    assert_same_tokenizer(tokenizer, back_tokenizer)
    rounded = {k: v.half().float() if v.ndim == 2 else v for k, v in model.state_dict().items()}
    got = back.state_dict()
    assert got.keys() == rounded.keys()
    for name, weight in rounded.items():  # q/k permuted and unpermuted exactly; norms kept in float32
        assert torch.equal(got[name], weight), name
    model.load_state_dict(rounded)  # the run's model with its matrices rounded to float16: the same logits
    assert torch.allclose(logits(back, back_tokenizer), logits(model, tokenizer), rtol=0, atol=1e-6)


def test_q8_0_round_trip_is_llama_cpp_quantization_of_the_model(tiny_model_dir, tmp_path):
    import gguf
    model, tokenizer = load(tiny_model_dir)
    back, back_tokenizer = round_trip(model, tokenizer, tmp_path, "q8_0")
    assert_same_tokenizer(tokenizer, back_tokenizer)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, weight in model.state_dict().items():  # blocks run along rows: the q/k row permutation commutes
        expected = weight if weight.ndim == 1 else torch.from_numpy(
            gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), q8), q8))
        assert torch.equal(back.state_dict()[name], expected), name
    before, after = logits(model, tokenizer), logits(back, back_tokenizer)
    diff = (after - before).abs().max().item()
    assert 0 < diff <= Q8_0_LOGIT_SHARE * before.abs().max().item(), diff


def test_an_unsupported_architecture_is_refused_before_writing(tmp_path):
    from covey.models.tiny import tiny_family_model, tiny_tokenizer
    tokenizer = tiny_tokenizer()
    with pytest.raises(ModelError, match="architecture 'qwen3' is not supported"):
        write_gguf(tiny_family_model("qwen3", len(tokenizer)), tokenizer, tmp_path / "q.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(os.environ.get("COVEY_EXPORT_REAL") != "1",
                    reason="about 5 minutes and 2 GB: set COVEY_EXPORT_REAL=1 (docs/export.md)")
def test_default_model_round_trip(tmp_path, capsys):
    """SmolLM2-135M-Instruct: same ids, top-1 tokens and logits within each precision's tolerance."""
    model, tokenizer = load(prepare_default_model())
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Explain, then compute 17 * 23."},
         {"role": "assistant", "content": "The capital of France is Paris, on the Seine. 17 * 23 = 391."}],
        tokenize=False)
    before = logits(model, tokenizer, text)
    for quant, share, agree in (("f16", 0.002, 1.0), ("q8_0", 0.05, 0.95)):
        back, back_tokenizer = round_trip(model, tokenizer, tmp_path, quant)
        assert_same_tokenizer(tokenizer, back_tokenizer)
        after = logits(back, back_tokenizer, text)
        diff = (after - before).abs().max().item()
        top1 = (after.argmax(-1) == before.argmax(-1)).float().mean().item()
        with capsys.disabled():
            print(f"\n{quant}: max |logit diff| {diff:.4f} of max |logit| {before.abs().max():.2f}; top-1 {top1:.3f}")
        assert diff <= share * before.abs().max().item() and top1 >= agree
        shutil.rmtree(tmp_path / f"back-{quant}")


# --------------------------------------------------------------------------- LoRA merged


def adapter_run(model_dir, run_dir):
    """A run folder whose final/ holds LoRA adapters with random (non-zero) B: a model unlike its base."""
    from peft import LoraConfig, get_peft_model
    base, tokenizer = load(model_dir)
    torch.manual_seed(1)
    adapted = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                              init_lora_weights=False))
    adapted.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    return adapted.eval(), tokenizer


def test_merged_model_computes_base_plus_adapters(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    adapted, tokenizer = adapter_run(tiny_model_dir, tmp_path / "run")
    out = export_run(tmp_path / "run", "merged")
    assert out == tmp_path / "run" / "export" / "merged" and not (out / "adapter_config.json").exists()
    merged, merged_tokenizer = load(out)
    expected = logits(adapted, tokenizer)
    with adapted.disable_adapter():
        base = logits(adapted, tokenizer)
    assert (expected - base).abs().max() > 1e-2  # the adapters change the model
    # W x + s B A x against (W + s B A) x: equal up to float32 rounding
    assert torch.allclose(logits(merged, merged_tokenizer), expected, rtol=0, atol=1e-5)
    assert "Exported by `covey export --to merged`" in (out / "README.md").read_text()
    with pytest.raises(ModelError, match="already exists"):
        export_run(tmp_path / "run", "merged")
    gguf_path = export_run(tmp_path / "run", "gguf")  # merged first, then written
    convert_gguf(gguf_path, tmp_path / "back")
    back, back_tokenizer = load(tmp_path / "back")
    assert (logits(back, back_tokenizer) - expected).abs().max() < 1e-2


def test_errors_are_one_line_naming_the_folder(tiny_model_dir, tmp_path):
    with pytest.raises(ModelError, match=f"^{tmp_path}: no final/ folder"):
        export_run(tmp_path, "hf")
    shutil.copytree(tiny_model_dir, tmp_path / "final")
    with pytest.raises(ModelError, match="final: full weights, not LoRA adapters: nothing to merge"):
        export_run(tmp_path, "merged")


# --------------------------------------------------------------------------- the model card of a run


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """A 2-step tiny run whose reward differs between samples (a curve that moves)."""
    from covey.cli.main import main
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", *tiny_overrides(tiny_model_dir, out, **{
        "train.run_name": "card", "reward.functions": "tests.helpers:varied_reward"})]) == 0
    return out / "card"


def test_final_holds_a_model_card(trained_run, tiny_model_dir):
    card = (trained_run / "final" / "README.md").read_text()
    metrics = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    before, after = metrics[0]["eval/accuracy"], metrics[-1]["eval/accuracy"]
    assert len(rewards) == 2 and metrics[-1]["final"] == 1 and metrics[-1]["eval/n"] == 4
    assert card.startswith("---\nlibrary_name: transformers\ntags: [covey, reinforcement-learning, grpo]\n"
                           "---\n# card\n")
    for part in (f"covey {covey.__version__} from `{tiny_model_dir}`",
                 "estimator `grpo`, policy loss `ppo_clip`", "KL coefficient 0.04 (k3 estimator",
                 "adamw at learning rate 1e-05; full fine-tuning", "2 of 2 steps; 2 prompts x 4 samples per step",
                 "task `arithmetic` (built in); 16 train / 4 held-out examples",
                 f"accuracy (math verifier), greedy: before training {before:.1%} of 4, "
                 f"after training {after:.1%} of 4.",
                 f"training reward (mean)   {sparkline(rewards)}  (2 steps, from {rewards[0]:.3g} to {rewards[1]:.3g}"):
        assert part in card, part
    assert card == run_card(trained_run)  # the same card from the folder alone


def test_hf_and_gguf_exports_of_a_full_run(trained_run, tmp_path):
    hf = export_run(trained_run, "hf", tmp_path / "hf")
    final = trained_run / "final"
    assert sorted(p.name for p in hf.iterdir()) == sorted(p.name for p in final.iterdir())
    assert (hf / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    assert "Exported by `covey export --to hf`: a copy of final/." in (hf / "README.md").read_text()
    path = export_run(trained_run, "gguf", quant="q8_0")
    assert path == trained_run / "export" / "card-q8_0.gguf"
    model, tokenizer = load(final)
    convert_gguf(path, tmp_path / "back")
    back, back_tokenizer = load(tmp_path / "back")
    assert_same_tokenizer(tokenizer, back_tokenizer)
    before = logits(model, tokenizer)
    assert (logits(back, back_tokenizer) - before).abs().max() <= Q8_0_LOGIT_SHARE * before.abs().max()
    (tmp_path / "files").mkdir()
    assert export_run(trained_run, "gguf", tmp_path / "files") == tmp_path / "files" / "card-f16.gguf"  # into a folder


def test_card_of_a_lora_run_on_a_file_task_judged_by_reward():
    record = {"model": {"path": "default", "lora_rank": 8, "lora_alpha": 16, "lora_targets": "all-linear"},
              "task": {"name": "file", "path": "data/train.jsonl", "eval_path": "data/test.jsonl", "train_size": 100,
                       "eval_size": 20},
              "algo": {"estimator": "rloo"}, "eval": {"metric": "reward", "reward_threshold": 0.5},
              "train": {"run_name": "r", "steps": 5}}
    metrics = [{"step": 0, "eval/reward_pass": 0.2, "eval/n": 20}, {"step": 1, "reward/mean": 0.1},
               {"step": 2, "reward/mean": 0.3}, {"step": 2, "eval/reward_pass": 0.4, "eval/n": 20, "final": 1}]
    card = model_card(record, metrics)
    assert "library_name: peft\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card
    assert "LoRA rank 8, alpha 16, on all-linear" in card and "2 of 5 steps" in card
    assert "task `file`: `data/train.jsonl`, held-out `data/test.jsonl`; 100 train / 20 held-out" in card
    assert "share of greedy answers at reward >= 0.5: before training 20.0% of 20, after training 40.0% of 20." in card
    assert "training reward (mean)   ▁█  (2 steps, from 0.1 to 0.3; min 0.1, max 0.3)" in card
    assert "training accuracy" not in card  # not logged
    assert yaml.safe_load(card.split("---")[1])["tags"] == ["covey", "reinforcement-learning", "rloo"]
    dpo = model_card({**record, "algo": {"learner": "dpo", "estimator": "grpo"}}, metrics)
    assert "- learner `dpo`\n" in dpo and "estimator `" not in dpo
    assert "tags: [covey, reinforcement-learning, dpo]" in dpo


def test_a_vocabulary_wider_than_the_tokenizer_is_padded(tiny_model_dir, tmp_path):
    """Rows past the tokenizer's last id (a model padded to a round vocabulary) become unused [PAD<id>] tokens:
    the file keeps every row, and the tokenizer read back gives the same ids."""
    model, tokenizer = load(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer) + 8)
    back, back_tokenizer = round_trip(model, tokenizer, tmp_path, "f16")
    assert back.config.vocab_size == len(tokenizer) + 8 == len(back_tokenizer)
    assert back_tokenizer.convert_ids_to_tokens(len(tokenizer)) == f"[PAD{len(tokenizer)}]"
    assert_same_tokenizer(tokenizer, back_tokenizer)
    assert torch.equal(back.get_input_embeddings().weight, model.get_input_embeddings().weight.half().float())
