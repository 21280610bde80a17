"""covey.offload: a frozen reference mapped from its model files for its passes only, same outputs."""

import torch

from covey.config import Config
from covey.models import load_policy, load_reference
from covey.offload import maybe_offload_reference, offload_reference, release_weights


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
