"""model.fused_kernels and model.load_in_4bit on a machine without CUDA (and without liger-kernel or
bitsandbytes): what auto resolves to, and one line naming the key for what cannot run, before any model loads."""

import pytest

from covey.config import ConfigError, load_config
from covey.models import kernels
from covey.models.errors import ModelError
from covey.models.kernels import check_model_options, resolve_fused_kernels


def test_auto_is_off_on_a_cpu_and_says_why():
    assert resolve_fused_kernels("auto", "cpu") == (False, "off (model.fused_kernels=auto: no CUDA device)")
    assert resolve_fused_kernels("off", "cuda")[0] is False


def test_auto_on_cuda_follows_the_package(monkeypatch):
    monkeypatch.setattr(kernels, "has_package", lambda name: False)
    on, why = resolve_fused_kernels("auto", "cuda")
    assert not on and "pip install 'covey[kernels]'" in why
    monkeypatch.setattr(kernels, "has_package", lambda name: True)
    assert resolve_fused_kernels("auto", "cuda")[0] is True


@pytest.mark.parametrize("device, has, message", [
    ("cpu", True, "model.fused_kernels=on needs a CUDA device"),
    ("cuda", False, "model.fused_kernels=on needs the optional package liger-kernel: pip install 'covey[kernels]'"),
])
def test_on_without_cuda_or_package_is_one_line(monkeypatch, device, has, message):
    monkeypatch.setattr(kernels, "has_package", lambda name: has)
    with pytest.raises(ModelError, match="^" + message.replace("[", r"\[").replace("]", r"\]")) as err:
        check_model_options("on", False, device)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("device, has, message", [
    ("cpu", True, "model.load_in_4bit=true needs a CUDA device"),
    ("cuda", False, "model.load_in_4bit=true needs the optional package bitsandbytes"),
])
def test_4bit_without_cuda_or_bitsandbytes_is_one_line(monkeypatch, device, has, message):
    monkeypatch.setattr(kernels, "has_package", lambda name: has)
    with pytest.raises(ModelError, match="^" + message) as err:
        check_model_options("off", True, device)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("keys, message", [
    (["model.fused_kernels=fast"], "model.fused_kernels='fast' is not one of: auto, on, off"),
    (["model.load_in_4bit=true"], "model.load_in_4bit=true freezes the base weights in 4-bit"),
    (["model.load_in_4bit=true", "model.lora_rank=8", "rollout.engine=vllm"], "rollout.engine=vllm is not supported"),
    (["model.load_in_4bit=true", "model.lora_rank=8", "rollout.precision=bfloat16"], "rollout.precision=bfloat16"),
])
def test_config_errors_name_the_key(keys, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("grpo", keys)


def test_a_4bit_run_on_a_cpu_stops_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    from covey.cli.main import main
    from tests.helpers import tiny_overrides
    keys = tiny_overrides(tiny_model_dir, tmp_path, **{"model.load_in_4bit": "true", "model.lora_rank": 4,
                                                       "train.device": "cpu"})
    assert main(["train", "grpo", *keys]) != 0
    err = capsys.readouterr().err
    assert "model.load_in_4bit=true needs a CUDA device" in err and "Traceback" not in err
    assert not (tmp_path / "t" / "metrics.jsonl").exists()
