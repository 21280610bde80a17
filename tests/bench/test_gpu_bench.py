"""The GPU benchmark's arithmetic (bench/gpu.py, bench/workloads.py): the update's model FLOPs, the shapes'
parameter counts, the decode floor, the targets; and the random model folder whose responses run to full length."""

import pytest
import torch

from bench.gpu import gpu_summary, gpu_table, verdicts
from bench.workloads import build_model, floor_bytes, model_shape, update_flops, varied_reward


def test_qwen25_shapes_count_their_parameters():
    """Qwen2.5-1.5B's published count is 1.54B with its 151936-entry vocabulary: 1.31B in the layers
    plus 233M of tied embedding. With SmolLM2's 49152 entries: 1.31B + 75.5M."""
    from transformers import Qwen2Config
    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2)
    assert model_shape(config, 151936)["params"] == pytest.approx(1.54e9, rel=0.01)
    shape = model_shape(config, 49152)
    # per layer: q 1536^2 + k, v 2 x 1536 x 256 + o 1536^2 + MLP 3 x 1536 x 8960 = 46,792,704
    assert shape["matmul_params"] == 28 * 46_792_704 + 49152 * 1536
    assert (shape["head_dim"], shape["kv_heads"]) == (128, 2)


def test_update_flops_count_six_per_parameter_and_token_and_the_attention():
    """2 prompts of 10 tokens x 2 samples of 4 tokens, one layer of 1 head of dimension 2, 100 matrix
    parameters. Tokens: 4 x 4 responses + 2 x 10 prompts = 36 -> 6 x 100 x 36 = 21600.
    Query-key pairs: each response 4 x 10 + (1 + 2 + 3 + 4) = 50, x 4 = 200; each prompt 55, x 2 = 110;
    310 pairs x 3 x 4 x 1 x 2 x 1 = 7440."""
    shape = {"matmul_params": 100, "heads": 1, "head_dim": 2, "layers": 1}
    workload = {"prompts": 2, "group_size": 2, "new_tokens": 4}
    assert update_flops(shape, workload, 10) == 21600 + 7440


def test_the_decode_floor_reads_every_weight_and_the_cache_in_use():
    """1000 bf16 parameters = 2000 bytes; keys and values of 2 layers x 1 head x 4 = 2 x 2 x 1 x 4 x 2 bytes = 32
    bytes a position; 2 x 2 rows at 10 prompt + (4 + 1) / 2 response positions on average: 4 x 12.5 x 32 = 1600."""
    shape = {"params": 1000, "layers": 2, "kv_heads": 1, "head_dim": 4}
    assert floor_bytes(shape, {"prompts": 2, "group_size": 2, "new_tokens": 4}, 10) == 2000 + 1600


def test_summary_ratios_and_verdicts():
    def steps(s):
        return [{"step_s": x, "generate_s": x / 2, "logprobs_s": 0.1, "update_s": x / 4, "score_s": 0.0} for x in s]

    covey = {"steps": steps([9, 1, 1.2, 1.1]), "peak_gpu_mib": 20 * 1024, "decode": {"step_ms": 2.0, "rows": 64}}
    trl = {"steps": steps([9, 10, 10, 10]), "peak_gpu_mib": 40 * 1024}
    variant = {"steps": steps([9, 0.8, 0.9, 0.7]), "peak_gpu_mib": 30 * 1024}
    # the copy bandwidth is chosen so that the floor is 1 ms: covey's 2 ms decode step is 2 x its floor
    shape = {"matmul_params": 1e9, "params": 1e6, "heads": 12, "kv_heads": 2, "head_dim": 128, "layers": 28,
             "prompt_tokens_mean": 40}
    workload = {"prompts": 8, "group_size": 8, "new_tokens": 256}
    bandwidth = floor_bytes(shape, workload, 40) * 1000  # bytes per second: the floor is 1 ms
    row = gpu_summary("1.5b", {"copy_bytes_per_s": bandwidth, "matmul_tflops": 800}, shape,
                      {"covey": covey, "trl": trl, "covey-variant": variant}, workload)
    assert row["step_vs_trl"] == pytest.approx(0.11) and row["memory_vs_trl"] == 0.5  # covey's, not the variant's
    assert row["labels"] == ["covey", "trl", "covey-variant"] and row["covey-variant"]["step_s"] == 0.8
    assert "| 1.5b | covey-variant | 0.80 |" in gpu_table([row])
    assert row["decode_floor_ms"] == pytest.approx(1.0) and row["covey"]["decode_vs_floor"] == pytest.approx(2.0)
    lines = verdicts(row)
    assert any("step_vs_trl: 0.110 (target <= 0.25) met" in line for line in lines)
    assert any("decode_vs_floor: 2.000 (target <= 2.0) met" in line for line in lines)
    assert any(line.startswith("1.5b update_share_of_peak") for line in lines)


def test_the_reward_reads_plain_and_conversational_completions():
    assert varied_reward([], ["ab", [{"role": "assistant", "content": "ab"}]]) == [(97 + 98) % 7 / 6] * 2


def test_the_random_model_never_ends_a_response(tmp_path, tiny_model_dir):
    """The folder's end-of-sequence id lies past the model's vocabulary: sampled responses run to their length."""
    from covey.models.load import load_policy
    from covey.rollout.local import local_engine
    shape = build_model("smoke", str(tmp_path / "m"), tiny_model_dir, "gpu-smoke")
    model, tok = load_policy(str(tmp_path / "m"), dtype=torch.float32)
    assert tok.eos_token_id == len(tok) - 1 == model.get_output_embeddings().weight.shape[0]  # one past the logits
    assert shape["prompt_tokens_mean"] > 0
    rollout = local_engine("fast", model, tok, max_new_tokens=16).generate(["hello"], 8)
    assert rollout.response_mask.sum(1).tolist() == [16] * 8
