"""Out-of-memory that halves the micro-batch: the retry loop on its own (the run-level test is
tests/training/test_out_of_memory.py; a real CUDA one is in tests/training/test_device_gpu.py)."""

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


def test_rows_and_prompts_that_fit():
    """Sequences of 52992000 bytes in 8 GiB (8589934592 bytes): 162 (162.1), capped at 64 and at least 1.
    Prompts of 8 samples of 1e6 bytes in 40e6: 5 prompts are 40 rows, held as 64 (a power of two): 64e6 too
    many; 4 prompts are 32 rows: 32e6 fit."""
    from covey.runtime.memory import prompts_that_fit, rows_that_fit
    assert rows_that_fit(52992000, 8 * 2**30, 1, 1000) == 162
    assert rows_that_fit(52992000, 8 * 2**30, 1, 64) == 64
    assert rows_that_fit(52992000, -1, 1, 64) == 1
    assert prompts_that_fit(10**6, 8, 40e6, most=8) == 4
    assert prompts_that_fit(10**6, 8, 10**12, most=8) == 8
    assert prompts_that_fit(10**9, 8, 1, most=8) == 1


def test_the_update_is_sized_once_to_what_the_budget_leaves(monkeypatch, capsys):
    """A policy of 1000 fp32 parameters with no gradient yet and AdamW without state: 4000 bytes of gradients
    and 8000 of moments are still to come. Budget 10**6 bytes, 100 allocated: 999900 of it left, less than
    free 10**9 + cached (reserved 300 - allocated 100); less 12000 pending: 987900 bytes. Sequences of
    1000 bytes a position x 10 positions = 10000 bytes: 98 fit, capped at the step's 16."""
    from covey.runtime import memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**9, 2 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 100)
    policy = torch.nn.Linear(100, 10, bias=False)  # 1000 parameters
    trained = [(policy, torch.optim.AdamW(policy.parameters()))]
    assert memory.budget_left(10**6, trained, "cuda") == 987_900
    sizes = MicroBatchSizes(4)
    memory.size_update_pass(sizes, 1000, trained, positions=10, rows=16, device="cuda", budget=10**6)
    assert sizes.sizes["update"] == 16 and sizes.update_sized
    assert capsys.readouterr().out == ("covey: update micro-batches of 16 sequences (algo.micro_batch_size=4), "
                                       "sized to the 0.0 GiB left of train.gpu_memory_gib=0.0 GiB\n")
    sizes.sizes["update"] = 4
    memory.size_update_pass(sizes, 1000, trained, positions=10, rows=16, device="cuda", budget=10**6)
    assert sizes.sizes["update"] == 4  # once per process
    smaller = MicroBatchSizes(4)  # 25000 bytes x 40 positions = 1e6 a sequence: none fits in 987900, one runs
    memory.size_update_pass(smaller, 25_000, trained, positions=40, rows=16, device="cuda", budget=10**6)
    assert smaller.sizes["update"] == 1
