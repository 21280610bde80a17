"""Out-of-memory that halves the micro-batch: the retry loop on its own (the run-level test is
tests/train/test_out_of_memory.py; a real CUDA one is in tests/train/test_device_gpu.py)."""

import pytest
import torch

from covey.runtime.memory import MicroBatchSizes, OutOfMemoryAtOneRow, halving_on_oom, is_out_of_memory


def oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(oom())
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                         "can't allocate memory: you tried to allocate 8589934592 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))


def test_it_halves_until_the_pass_fits_and_keeps_the_size(capsys):
    sizes, tried, cleaned = MicroBatchSizes(8), [], []

    def attempt(size):
        tried.append(size)
        if size > 2:
            raise oom()
        return f"done at {size}"

    assert halving_on_oom("update", sizes, attempt, "cpu", cleanup=lambda: cleaned.append(1)) == "done at 2"
    assert tried == [8, 4, 2] and len(cleaned) == 2  # every failed attempt is undone before the next
    assert sizes.sizes == {"generate": 8, "logprobs": 8, "update": 2} and sizes.oom_retries == 2
    assert sizes.metrics() == {"memory/oom_retries": 2, "memory/micro_batch/generate": 8,
                               "memory/micro_batch/logprobs": 8, "memory/micro_batch/update": 2}
    assert "out of memory in the update phase at micro-batch 8: redone at 4" in capsys.readouterr().err
    # the next step starts at the kept size: one attempt
    tried.clear()
    halving_on_oom("update", sizes, attempt, "cpu")
    assert tried == [2]


def test_odd_sizes_round_down_and_stop_at_one():
    sizes = MicroBatchSizes(5)
    assert [sizes.halve("logprobs") for _ in range(3)] == [2, 1, 1]


def test_one_row_that_does_not_fit_ends_with_one_line_naming_phase_sizes_and_knobs():
    sizes = MicroBatchSizes(2, prompts_per_call=4)

    def attempt(size):
        raise oom()

    with pytest.raises(OutOfMemoryAtOneRow) as err:
        halving_on_oom("logprobs", sizes, attempt, "cpu")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("out of memory in the logprobs phase with one sequence per micro-batch "
                              "(sizes now: generate 4, logprobs 1, update 2; 1 halvings so far)")
    for knob in ("rollout.max_new_tokens", "model.gradient_checkpointing=true", "model.lora_rank"):
        assert knob in message


def test_other_errors_pass_through_untouched():
    sizes = MicroBatchSizes(4)

    def attempt(size):
        raise RuntimeError("expected scalar type Float")

    with pytest.raises(RuntimeError, match="expected scalar type Float"):
        halving_on_oom("update", sizes, attempt, "cpu")
    assert sizes.sizes["update"] == 4 and sizes.oom_retries == 0


def test_sizes_are_saved_and_restored():
    sizes = MicroBatchSizes(8)
    sizes.halve("update")
    restored = MicroBatchSizes(8)
    restored.load_state_dict(sizes.state_dict())
    assert restored.sizes == {"generate": 8, "logprobs": 8, "update": 4} and restored.oom_retries == 1


def test_no_grad_passes_take_what_fits_in_a_quarter_of_the_free_memory():
    """Qwen2.5-1.5B's shape with a 49152-entry vocabulary: per position 2 x 49152 (bf16 logits)
    + 6 x 8960 (MLP) + 16 x 1536 (hidden vectors) = 176640 bytes; 300 positions a sequence is
    52992000 bytes, so a quarter of 8 GiB (2147483648 bytes) holds 40 sequences."""
    from types import SimpleNamespace

    from covey.runtime.memory import rows_per_no_grad_pass
    config = SimpleNamespace(vocab_size=49152, intermediate_size=8960, hidden_size=1536)
    assert rows_per_no_grad_pass(config, 300, 8 * 2**30, least=8, most=64) == 40
    assert rows_per_no_grad_pass(config, 300, 80 * 2**30, least=8, most=64) == 64  # never more than the rollout
    assert rows_per_no_grad_pass(config, 300, 2**30, least=8, most=64) == 8  # never fewer than micro_batch_size


def test_update_micro_batch_takes_what_fits_in_its_share():
    """Qwen2.5-1.5B's shape (hidden 1536, MLP 8960, 28 layers, 12 query / 2 key-value heads of 128)
    under bf16 autocast: per layer and position 16 x 1536 (float32 norms) = 24576 bytes, plus
    2 x (8 x 1536 + 2 x 2 x 128 + 4 x 8960) = 2 x (12288 + 512 + 35840) = 97280 bytes: 121856; x 28
    layers = 3411968 bytes a position; 290 positions a sequence = 989470720 bytes. Half of 52e9
    bytes is 26e9: 26 sequences (26.28). In fp32 the elements take 4 bytes: 24576 + 194560 =
    219136 a layer, x 28 x 290 = 1779384320 a sequence: 14 (14.6)."""
    from types import SimpleNamespace

    from covey.runtime.memory import rows_per_update_pass
    config = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2)
    assert rows_per_update_pass(config, 290, 52 * 10**9, least=8, most=64, element_bytes=2, share=0.5) == 26
    assert rows_per_update_pass(config, 290, 52 * 10**9, least=8, most=64, element_bytes=4, share=0.5) == 14
    assert rows_per_update_pass(config, 290, 52 * 10**10, least=8, most=64, element_bytes=2, share=0.5) == 64
    assert rows_per_update_pass(config, 290, -10**9, least=8, most=64, element_bytes=2, share=0.5) == 8


def test_the_update_is_sized_once_from_free_memory_less_what_the_first_step_allocates(monkeypatch, capsys):
    """A policy of 1000 fp32 parameters with no gradient and no optimizer state yet: 4000 bytes of
    gradients and 8000 of AdamW moments are still to come. Free 1e9 + cached (reserved 300 -
    allocated 100) - 12000 = 999988200 bytes available; the estimate (fake shape below) is 1000
    bytes a position per layer x 2 layers x 10 positions = 20000 a sequence, so a share of 0.5
    holds 24999 sequences, capped at the step's 16."""
    from types import SimpleNamespace

    from covey.runtime import memory
    seen = {}
    real_rows = memory.rows_per_update_pass

    def fake_rows(config, positions, available, least, most, element_bytes, share):
        seen.update(positions=positions, available=available, element=element_bytes, share=share)
        return real_rows(SimpleNamespace(hidden_size=0, intermediate_size=250, num_hidden_layers=2,
                                         num_attention_heads=1, num_key_value_heads=1),
                         positions, available, least, most, 1, share)
    monkeypatch.setattr(memory, "rows_per_update_pass", fake_rows)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**9, 2 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 100)
    policy = torch.nn.Linear(100, 10, bias=False)  # 1000 parameters
    sizes = MicroBatchSizes(4)
    trained = [(policy, torch.optim.AdamW(policy.parameters()))]
    memory.size_update_pass(sizes, None, trained, positions=10, rows=16, device="cuda", element_bytes=2, share=0.5)
    assert seen == {"positions": 10, "available": 10**9 + 200 - 12000, "element": 2, "share": 0.5}
    assert sizes.sizes["update"] == 16 and sizes.update_sized
    assert capsys.readouterr().out == ("covey: update micro-batches of 16 sequences, sized to "
                                       "algo.update_memory_share=0.5 of 0.9 GiB free GPU memory "
                                       "(algo.update_memory_share=0 keeps 4)\n")
    sizes.sizes["update"] = 4
    memory.size_update_pass(sizes, None, trained, positions=10, rows=16, device="cuda", element_bytes=2, share=0.5)
    assert sizes.sizes["update"] == 4  # once per process
