"""train.device: how auto / cpu / cuda resolve, the one-line error without a GPU, the start line,
and the per-phase GPU memory readings (nothing on a CPU)."""

import pytest
import torch

from covey.cli.main import main
from covey.runtime import dist
from covey.runtime.dist import DeviceError, describe_device, resolve_device
from covey.runtime.memory import record_gpu_peak, take_gpu_peak_mb
from tests.helpers import tiny_overrides


def no_gpu(monkeypatch):
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: False)


def two_gpus(monkeypatch):
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist.torch.cuda, "device_count", lambda: 2)


def test_auto_is_the_cpu_without_a_gpu_and_cuda_of_the_local_rank_with_one(monkeypatch):
    no_gpu(monkeypatch)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    two_gpus(monkeypatch)
    assert resolve_device("auto", local_rank=1) == "cuda:1"
    assert resolve_device("cuda", local_rank=0) == "cuda:0"
    assert resolve_device("cpu", local_rank=1) == "cpu"  # asked for by name: the CPU even with GPUs


def test_cuda_without_a_gpu_or_a_rank_beyond_the_gpus_is_a_one_line_error(monkeypatch):
    no_gpu(monkeypatch)
    with pytest.raises(DeviceError, match="train.device=cuda, but torch sees no CUDA GPU"):
        resolve_device("cuda")
    two_gpus(monkeypatch)
    with pytest.raises(DeviceError, match="LOCAL_RANK=2 needs cuda:2, but torch sees 2 GPU"):
        resolve_device("auto", local_rank=2)
    with pytest.raises(DeviceError, match="not one of"):
        resolve_device("tpu")


def test_the_start_line_names_the_cpu_threads():
    assert describe_device("cpu") == f"cpu ({torch.get_num_threads()} threads)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_covey_train_on_cuda_without_one_exits_2_before_loading_a_model(capsys, tmp_path):
    # model.path names no model at all: the run must stop on the device before it looks for one
    code = main(["train", *tiny_overrides("no-such-model", tmp_path), "train.device=cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err] and "train.device=cuda, but torch sees no CUDA GPU" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_vllm_needs_a_gpu(capsys, tmp_path):
    code = main(["train", *tiny_overrides("no-such-model", tmp_path), "rollout.engine=vllm"])
    assert code == 2 and "rollout.engine=vllm samples on a GPU" in capsys.readouterr().err


def test_gpu_memory_readings_are_absent_on_a_cpu():
    assert take_gpu_peak_mb("cpu") is None
    assert record_gpu_peak({"time/update": 1.0}, "cpu", "update") == {"time/update": 1.0}
