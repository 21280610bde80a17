"""covey.models.offload: a frozen reference read from its model files for its passes only, same outputs."""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from covey.config import ModelConfig
from covey.models.load import load_policy, load_reference
from covey.models.offload import (
    hold_linear_weights_in,
    maybe_hold_reference_in_bf16,
    maybe_offload_reference,
    offload_reference,
    read_safetensors,
    release_weights,
)
from covey.passes.logprobs import batched_logprobs
from covey.training.plan_setup import model_options
from tests.helpers import grouped_rollout


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
    model = model_options(ModelConfig(path=tiny_model_dir))
    assert not maybe_offload_reference(load_reference(policy), model, 2, reference_moves=False)
    # a refreshed or EMA reference (algo.ref_refresh_every, algo.ref_ema) moves away from the files
    assert not maybe_offload_reference(load_reference(policy), model, 1, reference_moves=True)
    assert not maybe_offload_reference(load_reference(policy), dataclasses.replace(model, lora_rank=8), 1,
                                       reference_moves=False)  # a LoRA reference is a view of the policy
    assert not maybe_offload_reference(load_reference(policy), dataclasses.replace(model, offload_reference=False),
                                       1, reference_moves=False)
    assert maybe_offload_reference(load_reference(policy), model, 1, reference_moves=False)
    assert not maybe_offload_reference(None, model, 1, reference_moves=False)


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


# ---------------------------------------------------------------- a bf16 reference under bf16 autocast


def reference_logprobs(model, rollout):
    return batched_logprobs(model, rollout, temperature=1.0, micro_batch_size=2, precision="bfloat16")


def test_bf16_linear_weights_give_the_same_bits_under_autocast(tiny_model_dir):
    """autocast rounds an fp32 Linear weight to bf16 at each call; holding it rounded changes no output bit."""
    policy, tok = load_policy(tiny_model_dir)
    kept, lowered = load_reference(policy), load_reference(policy)
    converted = hold_linear_weights_in(lowered, torch.bfloat16)
    layers = policy.config.num_hidden_layers
    assert converted == 7 * layers  # q, k, v, o, gate, up, down per layer; no biases
    assert lowered.lm_head.weight is lowered.model.embed_tokens.weight  # still tied
    assert lowered.lm_head.weight.dtype == torch.float32  # the lookup reads the embedding in fp32
    assert lowered.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    rollout = grouped_rollout(tok)
    a, b = reference_logprobs(kept, rollout), reference_logprobs(lowered, rollout)
    assert torch.equal(a, b)
    assert a.abs().sum() > 0


def test_offloaded_bf16_reference_reads_its_files_rounded(tiny_model_dir):
    policy, tok = load_policy(tiny_model_dir)
    kept, offloaded = load_reference(policy), load_reference(policy)
    model = model_options(ModelConfig(path=tiny_model_dir, autocast="bfloat16"))
    assert maybe_offload_reference(offloaded, model, 1, reference_moves=False)
    assert maybe_hold_reference_in_bf16(offloaded, model, 1, reference_moves=False)
    rollout = grouped_rollout(tok)
    assert torch.equal(reference_logprobs(offloaded, rollout), reference_logprobs(kept, rollout))
    up = offloaded.model.layers[1].mlp.up_proj.weight
    assert up.dtype == torch.bfloat16 and torch.equal(up, kept.model.layers[1].mlp.up_proj.weight.bfloat16())
    release_weights(offloaded)
    assert up.numel() == 0 and up.dtype == torch.bfloat16


def test_bf16_reference_only_for_an_unchanging_one_under_bf16_autocast(tiny_model_dir):
    policy, _ = load_policy(tiny_model_dir)

    def lowered(world_size=1, moves=False, **changes) -> bool:
        model = model_options(ModelConfig(**{"path": tiny_model_dir, "autocast": "bfloat16", **changes}))
        reference = load_reference(policy)
        done = maybe_hold_reference_in_bf16(reference, model, world_size, reference_moves=moves)
        dtypes = {p.dtype for p in reference.parameters()}
        assert dtypes == ({torch.float32, torch.bfloat16} if done else {torch.float32})
        return done

    assert lowered()
    assert not lowered(autocast="none")
    assert not lowered(moves=True)  # refreshed, or mixed from the policy each step (EMA): must stay exact
    assert not lowered(world_size=2)
    assert not maybe_hold_reference_in_bf16(None, model_options(ModelConfig()), 1, reference_moves=False)


def test_read_safetensors_converts_as_it_reads(tmp_path):
    path = tmp_path / "m.safetensors"
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    save_file({"w": w, "b": torch.ones(2)}, str(path))
    got = read_safetensors(path, ["w", "b"], {"w": torch.bfloat16})
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.bfloat16())
    assert got["b"].dtype == torch.float32


@pytest.mark.gpu
def test_bf16_reference_gives_the_same_bits_on_cuda(tiny_model_dir):
    """CUDA autocast, like the CPU's, uses a bf16 weight as it is and rounds an fp32 one to the same bits."""
    policy, tok = load_policy(tiny_model_dir, device="cuda")
    kept, lowered = load_reference(policy), load_reference(policy)
    assert hold_linear_weights_in(lowered, torch.bfloat16) > 0
    rollout = grouped_rollout(tok)
    a, b = reference_logprobs(kept, rollout), reference_logprobs(lowered, rollout)
    assert torch.equal(a, b) and a.abs().sum() > 0
