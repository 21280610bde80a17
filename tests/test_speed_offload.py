"""covey.offload: a frozen reference read from its model files for its passes only, same outputs."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from covey.config import Config
from covey.models import load_policy, load_reference
from covey.offload import maybe_offload_reference, offload_reference, read_safetensors, release_weights


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_offloaded_reference_gives_the_same_logits_and_leaves_memory(tiny_model_dir):
    policy, _ = load_policy(tiny_model_dir)
    kept, offloaded = load_reference(policy), load_reference(policy)
    assert offload_reference(offloaded, tiny_model_dir)
    assert all(p.numel() == 0 for p in offloaded.parameters())  # released until a forward needs it
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(offloaded, ids), logits(kept, ids), atol=0, rtol=0)
    assert all(p.numel() > 0 for p in offloaded.parameters())
    release_weights(offloaded)
    assert all(p.numel() == 0 for p in offloaded.parameters())
    torch.testing.assert_close(logits(offloaded, ids), logits(kept, ids), atol=0, rtol=0)  # and back
    release_weights(kept)  # a no-op for a model that is not offloaded
    assert all(p.numel() > 0 for p in kept.parameters())


def test_refused_when_the_weights_are_not_the_files(tiny_model_dir):
    policy, _ = load_policy(tiny_model_dir)
    reference = load_reference(policy)
    with torch.no_grad():
        next(reference.parameters()).add_(1e-3)
    assert not offload_reference(reference, tiny_model_dir)
    assert all(p.numel() > 0 for p in reference.parameters())


def test_only_a_reference_that_never_changes_in_one_process(tiny_model_dir):
    policy, _ = load_policy(tiny_model_dir)
    cfg = Config()
    cfg.model.path = tiny_model_dir
    assert not maybe_offload_reference(load_reference(policy), cfg, world_size=2)
    for key, value in (("ref_ema", 0.1), ("ref_refresh_every", 5)):
        changed = Config()
        changed.model.path = tiny_model_dir
        setattr(changed.algo, key, value)
        assert not maybe_offload_reference(load_reference(policy), changed, world_size=1)
    cfg.model.offload_reference = False
    assert not maybe_offload_reference(load_reference(policy), cfg, world_size=1)
    cfg.model.offload_reference = True
    assert maybe_offload_reference(load_reference(policy), cfg, world_size=1)
    assert not maybe_offload_reference(None, cfg, world_size=1)


def mappings_of(folder) -> int:
    """Memory mappings of the folder's safetensors files in this process (/proc/self/maps lines)."""
    files = {str(f.resolve()) for f in Path(folder).glob("*.safetensors")}
    assert files
    return sum(line.split()[-1] in files for line in Path("/proc/self/maps").read_text().splitlines())


def test_read_safetensors_equals_the_library_loader_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(5, 3, generator=g), "b.weight": torch.randn(4, generator=g).bfloat16(),
               "c": torch.randn(2, 2, generator=g).double(), "steps": torch.arange(3), "flag": torch.tensor(True),
               "empty": torch.zeros(0, 3)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    got = read_safetensors(path, [*tensors, "not-in-file"])
    assert set(got) == set(tensors)  # names the file lacks are skipped
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    assert read_safetensors(path, ["a.weight"]).keys() == {"a.weight"}


def test_read_safetensors_names_a_truncated_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(OSError, match="m.safetensors: w: file ends inside"):
        read_safetensors(path, ["w"])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_loaded_weights_are_read_not_mapped(tiny_model_dir):
    """Mapped file pages count in the resident set on top of the heap (the step's peak RSS)."""
    policy, _ = load_policy(tiny_model_dir)
    offloaded = load_reference(policy)
    assert offload_reference(offloaded, tiny_model_dir)
    before = mappings_of(tiny_model_dir)  # the loader of the policy may keep its own mapping
    logits(offloaded, torch.tensor([[5, 6, 7]]))
    assert all(p.numel() > 0 for p in offloaded.parameters())
    assert mappings_of(tiny_model_dir) == before


def test_read_safetensors_names_a_dtype_it_does_not_read(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4).to(torch.float8_e4m3fn)}, str(path))
    with pytest.raises(OSError, match="m.safetensors: w: dtype F8_E4M3 is not one covey reads"):
        read_safetensors(path, ["w"])
