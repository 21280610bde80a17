"""Where bf16 is native, and what rollout.precision=auto and model.autocast=auto resolve to there."""

import pytest
import torch

from covey.rollout.precision import resolve_precision
from covey.runtime import precision
from covey.runtime.precision import autocast_context, cpu_has_native_bf16, resolve_autocast


def write_cpuinfo(path, flags: str) -> str:
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: {flags}\n")
    return str(path)


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    assert cpu_has_native_bf16(write_cpuinfo(tmp_path / "amx", "fpu sse avx2 avx512f amx_bf16 amx_tile"))
    assert cpu_has_native_bf16(write_cpuinfo(tmp_path / "avx512", "fpu avx2 avx512f avx512_bf16"))
    # avx512f alone runs bf16 matmuls by conversion (slow): not native
    assert not cpu_has_native_bf16(write_cpuinfo(tmp_path / "zen3", "fpu sse avx avx2 fma avx512f"))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))


def test_rollout_precision_auto_picks_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == "float32"
    assert resolve_precision("bfloat16", "cpu") == "bfloat16"  # explicit settings are obeyed
    assert resolve_precision("float32", "cpu") == "float32"
    with pytest.raises(ValueError, match="rollout.precision='fp8'"):
        resolve_precision("fp8")


def test_autocast_auto_picks_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_autocast("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_autocast("auto", "cpu") == "none"
    assert resolve_autocast("bfloat16", "cpu") == "bfloat16"
    assert resolve_autocast("none", "cpu") == "none"
    with pytest.raises(ValueError, match="model.autocast='fp16'"):
        resolve_autocast("fp16")


@pytest.mark.parametrize("setting, native, dtype", [
    ("none", True, torch.float32), ("bfloat16", False, torch.bfloat16),
    ("auto", True, torch.bfloat16), ("auto", False, torch.float32)])
def test_autocast_context_runs_linear_layers_in_the_resolved_precision(monkeypatch, setting, native, dtype):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    with autocast_context(setting, x.device):
        assert layer(x).dtype == dtype


def test_bf16_autocast_reaches_the_policy_passes_and_a_training_step(tiny_model_dir, tmp_path):
    import json

    from covey.cli.main import main
    from covey.models.load import load_policy
    from covey.passes import logprobs
    from tests.helpers import grouped_rollout, tiny_overrides

    model, tokenizer = load_policy(tiny_model_dir)
    part = grouped_rollout(tokenizer, groups=2, group_size=2)
    with torch.no_grad():
        fp32, _, width = logprobs.policy_logprobs(model, part, 1.0, precision="none")
        bf16, _, _ = logprobs.policy_logprobs(model, part, 1.0, precision="bfloat16")
    mask = part.response_mask[:, :width].bool()
    gap = (fp32 - bf16)[mask].abs()
    assert 0 < gap.max() < 0.1  # rounded (so autocast ran), but only by bf16's ~3 significant digits

    args = tiny_overrides(tiny_model_dir, tmp_path, **{"model.autocast": "bfloat16", "train.steps": 1})
    assert main(["train", *args]) == 0
    step = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
            if '"policy/loss"' in line][0]
    assert all(map(torch.isfinite, torch.tensor([step["policy/loss"], step["kl/ref"], step["optim/grad_norm"]])))
