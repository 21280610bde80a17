"""The vLLM engine: its pure parts and its orchestration on CPU (a stand-in LLM), the real thing on GPU.

vLLM cannot run without CUDA; the tests marked `gpu` are skipped here (tests/conftest.py)
and exercise the real `vllm.LLM` on a GPU machine.
"""

import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from covey.config import load_config
from covey.models.load import load_policy
from covey.rollout.factory import start_vllm
from covey.rollout.vllm import (
    SampledRollout,
    VLLMEngine,
    WeightSyncTimeout,
    lora_rank_for_vllm,
    outputs_to_rollout,
    run_with_timeout,
    weight_buckets,
)
from covey.training.plan import make_plan
from covey.training.token_weights import correct_sampler_mismatch
from tests.helpers import tiny_overrides


def completion(tokens, logps, finish="stop"):
    return SimpleNamespace(token_ids=tokens, finish_reason=finish,
                           logprobs=[{t: SimpleNamespace(logprob=lp), 0: SimpleNamespace(logprob=-9.0)}
                                     for t, lp in zip(tokens, logps)])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_policy(tiny_model_dir)[1]


def test_no_module_imports_vllm_unless_the_engine_is_built():
    """With `import vllm` made to fail, the package, the loop and this engine module still import."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'vllm' or name.startswith('vllm.'): raise ImportError('vllm imported')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import covey.cli.main, covey.training.loop, covey.runtime.dist, covey.models.lora, covey.rollout.vllm\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_outputs_to_rollout(tokenizer):
    pad = tokenizer.pad_token_id
    outputs = [SimpleNamespace(outputs=[completion([5, 6, 2], [-0.1, -0.2, -0.3]), completion([7], [-0.5], "length")]),
               SimpleNamespace(outputs=[completion([8, 9], [-1.0, -2.0]), completion([4, 4, 4], [-0.4] * 3, "length")])]
    enc = tokenizer(["a prompt", "another longer prompt"], return_tensors="pt", padding=True, add_special_tokens=False)
    r = outputs_to_rollout(outputs, enc, 2, tokenizer)
    assert r.response_ids.tolist() == [[5, 6, 2], [7, pad, pad], [8, 9, pad], [4, 4, 4]]
    assert r.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert r.truncated.tolist() == [False, True, False, True]
    assert r.group_ids.tolist() == [0, 0, 1, 1] and r.example_index == [0, 0, 1, 1]
    assert torch.allclose(r.sample_logp, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0, 0], [-1, -2, 0], [-0.4] * 3]))
    assert torch.equal(r.prompt_ids[2], enc["input_ids"][1])
    part = r.select(torch.tensor([3, 0]))  # selection (drops, micro-batches) keeps the sampler log-probs
    assert isinstance(part, SampledRollout) and torch.allclose(part.sample_logp[1], r.sample_logp[0])
    with pytest.raises(RuntimeError, match="samples for"):
        outputs_to_rollout(outputs[:1], enc, 3, tokenizer)


def test_weight_buckets_and_lora_ranks():
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # float32: 4 bytes each
    buckets = list(weight_buckets(tensors, bucket_bytes=80))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    assert lora_rank_for_vllm(4) == 8 and lora_rank_for_vllm(16) == 16 and lora_rank_for_vllm(17) == 32
    with pytest.raises(ValueError):
        lora_rank_for_vllm(1024)


def test_sync_timeout_raises_instead_of_hanging():
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncTimeout, match="within"):
        run_with_timeout(lambda: time.sleep(5), 0.2, "weight sync to vLLM")
    assert time.perf_counter() - t0 < 2
    assert run_with_timeout(lambda: 42, 5, "x") == 42
    with pytest.raises(KeyError):
        run_with_timeout(lambda: {}["missing"], 5, "x")


class FakeLLM:
    """Records what the engine asks of vLLM; answers generate with fixed samples."""

    def __init__(self):
        self.calls, self.loaded = [], {}
        model = SimpleNamespace(load_weights=lambda bucket: self.loaded.update(dict(bucket)))
        runner = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=runner))

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags):
        self.calls.append("wake:" + ",".join(tags))

    def reset_prefix_cache(self):
        self.calls.append("reset")

    def generate(self, prompts, sampling_params, use_tqdm, lora_request):
        self.calls.append("generate")
        self.params = sampling_params
        n = sampling_params[0].kwargs["n"]
        return [SimpleNamespace(outputs=[completion([5, 2], [-0.5, -0.25])] * n) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)


def test_engine_sleeps_wakes_and_pushes_the_policy(fake_vllm, tiny_model_dir):
    policy, tokenizer = load_policy(tiny_model_dir)
    llm = FakeLLM()
    engine = VLLMEngine(llm, policy, tokenizer, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                        sleep=True, bucket_mb=1, timeout_s=30, lora=False)
    assert llm.calls == ["sleep1"]  # the GPU is the trainer's until the first generation
    rollout = engine.generate(["p1", "p2"], 3, seeds=[11, 12])
    assert llm.calls[1:] == ["wake:weights", "wake:kv_cache", "generate", "sleep1"]  # vLLM loaded the same weights
    assert [p.kwargs["seed"] for p in llm.params] == [11, 12] and llm.params[0].kwargs["logprobs"] == 0
    assert rollout.sample_logp.shape == (6, 2) and len(rollout) == 6
    with torch.no_grad():
        policy.model.norm.weight.add_(1.0)  # "an optimizer step"
    engine.sync_weights(policy)
    assert llm.calls[-3:] == ["sleep1", "wake:weights", "reset"]  # pushed right after the update
    assert llm.loaded.keys() == {n for n, _ in policy.named_parameters()}
    assert all(torch.equal(llm.loaded[n], p) for n, p in policy.named_parameters())


def test_lora_adapters_reach_vllm_as_a_new_request(fake_vllm, monkeypatch, tiny_model_dir):
    from covey.models.lora import add_adapters
    request_module = types.ModuleType("vllm.lora.request")
    request_module.LoRARequest = lambda name, int_id, path: SimpleNamespace(name=name, int_id=int_id, path=path)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request_module)
    base, tokenizer = load_policy(tiny_model_dir)
    policy = add_adapters(base, 4, 8)
    llm = FakeLLM()
    engine = VLLMEngine(llm, policy, tokenizer, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                        sleep=False, bucket_mb=1, timeout_s=30, lora=True)
    engine.sync_weights(policy)
    engine.sync_weights(policy)
    request = engine.lora_request
    assert request.int_id == 2 and (Path(request.path) / "adapter_model.safetensors").is_file()
    assert not (Path(request.path).parent / "v1").exists()  # the previous adapters are cleaned up
    assert llm.loaded == {}  # the base weights in vLLM are never touched


def test_truncated_is_weights_each_token(tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"rollout.engine": "vllm", "algo.tis.cap": 2}))
    run = SimpleNamespace(plan=make_plan(cfg))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rollout = SampledRollout(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.ones(2, 2, dtype=torch.long), response_mask=mask, group_ids=torch.tensor([0, 0]),
        truncated=torch.tensor([False, False]), completions=["", ""], example_index=[0, 0],
        old_logp=torch.log(torch.tensor([[0.6, 0.2], [0.3, 0.3]])),
        sample_logp=torch.log(torch.tensor([[0.2, 0.4], [0.3, 0.9]])),
        advantages=torch.tensor([[1.0, 1.0], [-2.0, 0.0]]))
    metrics = correct_sampler_mismatch(run, rollout)
    # w = [[2 (cap), 0.5], [1]]: the weights beside the advantages, which stay as they were
    assert torch.allclose(rollout.is_weights * mask, torch.tensor([[2.0, 0.5], [1.0, 0.0]]))
    assert torch.allclose(rollout.advantages, torch.tensor([[1.0, 1.0], [-2.0, 0.0]]))
    assert metrics["tis/capped_frac"] == pytest.approx(1 / 3)
    rollout.sample_logp = None
    with pytest.raises(RuntimeError, match="no sampling log-probs"):
        correct_sampler_mismatch(run, rollout)


# --------------------------------------------------------------------------- GPU (real vLLM)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny random Llama with head_dim 64 (attention kernels want it), saved as an HF folder."""
    from covey.models.tiny import tiny_llama, tiny_tokenizer
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
    folder = tmp_path_factory.mktemp("vllm") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.mark.gpu
def test_vllm_sampling_logprobs_match_the_trainer_and_follow_a_sync(vllm_model_dir, tmp_path):
    pytest.importorskip("vllm")
    from covey.passes.logprobs import batched_logprobs
    cfg = load_config(None, tiny_overrides(vllm_model_dir, tmp_path, **{"rollout.engine": "vllm",
                                                                          "rollout.vllm_gpu_memory_utilization": 0.2}))
    policy, tokenizer = load_policy(vllm_model_dir, device="cuda")
    plan = make_plan(cfg)
    engine = start_vllm(plan.engine, plan.model, policy, tokenizer)
    prompts = ["<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"] * 2
    rollout = engine.generate(prompts, 4, seeds=[1, 2])
    trainer = batched_logprobs(policy, rollout, 1.0, 8)
    assert (rollout.sample_logp - trainer).abs()[rollout.response_mask.bool()].max() < 1e-2
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync_weights(policy)
    again = engine.generate(prompts, 4, seeds=[1, 2])
    trainer = batched_logprobs(policy, again, 1.0, 8)
    assert (again.sample_logp - trainer).abs()[again.response_mask.bool()].max() < 1e-2


@pytest.mark.gpu
def test_train_two_steps_with_vllm_and_truncated_is(vllm_model_dir, tmp_path):
    pytest.importorskip("vllm")
    import json

    from covey.cli.main import main
    keys = {"rollout.engine": "vllm", "algo.tis.cap": 2, "rollout.vllm_gpu_memory_utilization": 0.2}
    assert main(["train", *tiny_overrides(vllm_model_dir, tmp_path, **keys)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "policy/loss" in r][-1]
    assert {"tis/weight_mean", "tis/capped_frac", "tis/mismatch_kl", "time/sync_weights"} <= last.keys()
