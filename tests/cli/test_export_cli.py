"""`covey export`: docs/export.md's commands run as written (on the tiny model), and bad input is one line."""

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("peft")

from covey.cli.main import main  # noqa: E402
from tests.helpers import tiny_overrides  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "export.md").read_text()
COMMANDS = [line for line in re.search(r"## Commands.*?```bash\n(.*?)```", DOC, re.S).group(1).splitlines()
            if line.strip()]


def test_the_documented_commands_run_as_written(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from covey.models.default import convert_gguf
    from covey.models.lora import load_adapted
    assert [c.split()[:2] for c in COMMANDS] == [["covey", "train"]] + [["covey", "export"]] * 3
    run_dir = tmp_path / "export-demo"
    for command in COMMANDS:
        command = command.replace("runs/export-demo", str(run_dir)).replace("exported/", f"{tmp_path}/exported/")
        args = shlex.split(command)[1:]
        if args[0] == "train":  # the tiny model, 2 steps, and a reward that differs between samples
            args += tiny_overrides(tiny_model_dir, tmp_path, **{"train.run_name": "export-demo", "optim.lr": 0.01,
                                                                "reward.functions": "tests.helpers:varied_reward"})
        assert main(args) == 0, command
        capsys.readouterr()
    final = run_dir / "final"
    assert (final / "adapter_config.json").is_file()
    card = (final / "README.md").read_text()  # covey's card, written over PEFT's own
    assert card.startswith("---\nlibrary_name: peft\n") and "LoRA rank 8, alpha 16, on all-linear" in card
    merged_dir, hf_dir = run_dir / "export" / "merged", tmp_path / "exported" / "export-demo"
    gguf_file = run_dir / "export" / "export-demo-q8_0.gguf"
    assert gguf_file.is_file() and (merged_dir / "README.md").is_file() and (hf_dir / "README.md").is_file()
    adapted, tokenizer = load_adapted(final)
    ids = torch.tensor([tokenizer("What is 12 + 7? Answer with a number.")["input_ids"]])
    with torch.no_grad():
        expected = adapted.eval()(ids).logits
        for folder in (merged_dir, hf_dir):  # a LoRA run's plain HF folder is its merged model
            merged = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            assert torch.allclose(merged(ids).logits, expected, rtol=0, atol=1e-5), folder
        convert_gguf(gguf_file, tmp_path / "back")
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
        assert (back(ids).logits - expected).abs().max() <= 0.02 * expected.abs().max()


def test_a_folder_without_final_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--to", "gguf"]) == 2
    assert capsys.readouterr().err.strip() == (f"covey export: error: {tmp_path}: no final/ folder (the run did "
                                               "not finish, or it is not a covey run folder)")


def test_an_unknown_target_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["export", str(tmp_path), "--to", "onnx"])
    assert stop.value.code == 2
    assert "argument --to: invalid choice: 'onnx' (choose from 'gguf', 'merged', 'hf')" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["export", str(tmp_path), "--to", "hf", "--quant", "q8_0"])
    assert stop.value.code == 2 and "--quant q8_0 applies to --to gguf only" in capsys.readouterr().err


def test_an_unsupported_architecture_and_a_merge_of_full_weights_are_one_line(tiny_model_dir, tmp_path, capsys):
    from covey.models.tiny import tiny_family_model, tiny_tokenizer
    tokenizer = tiny_tokenizer()
    tiny_family_model("qwen3", len(tokenizer)).save_pretrained(tmp_path / "qwen" / "final")
    tokenizer.save_pretrained(tmp_path / "qwen" / "final")
    assert main(["export", str(tmp_path / "qwen"), "--to", "gguf"]) == 2
    assert capsys.readouterr().err.strip() == ("covey export: error: export to gguf: architecture 'qwen3' is not "
                                               "supported (supported: llama)")
    shutil.copytree(tiny_model_dir, tmp_path / "full" / "final")
    assert main(["export", str(tmp_path / "full"), "--to", "merged"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("covey export: error: ") and err.endswith(
        "final: full weights, not LoRA adapters: nothing to merge (--to hf copies them)") and "\n" not in err


def test_the_parser_offers_what_the_exporter_writes():
    """The parser keeps its own copies of the choices (building it loads no torch): they must not drift."""
    import covey.models.export
    from covey.cli import export
    from covey.models import gguf_writer
    assert export.TARGETS == covey.models.export.TARGETS and export.QUANTS == gguf_writer.QUANTS
