import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def run_from_the_repo_root():
    """Tests name user rewards as tests.module:function and data files by relative paths, which the
    CLI and its subprocesses resolve from the working directory: pin it, so `pytest` works from anywhere."""
    before = os.getcwd()
    os.chdir(REPO_ROOT)
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def no_native_bf16(monkeypatch):
    """`auto` precisions resolve to fp32 in every test, so a test's numbers do not depend on whether the
    machine running it has bf16 instructions. Tests of bf16 ask for it by name or patch this back.
    (Subprocesses do not see the patch: tests that compare them with this process set fp32 by key.)"""
    from covey.runtime import precision
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + tokenizer saved as an HF folder (seconds to build)."""
    from covey.models.tiny import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def tiny_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (a fresh object per test: a test may change its chat template)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)




def pytest_collection_modifyitems(config, items):
    """A test that takes the tiny model's folder loads (and most often trains) a model: marked `model`, which
    `make test-fast` leaves out. Tests marked `gpu` need CUDA: skipped (with the reason shown) on machines
    without it."""
    import torch
    for item in items:
        if "tiny_model_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: a folder named gpu is one
            item.add_marker(skip)
