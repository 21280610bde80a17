"""bench.optim_memory on the tiny model: the bytes it reports are the tensors' own, counted by hand."""

from bench.optim_memory import main
from covey.models.tiny import tiny_llama


def test_adamw_holds_two_fp32_moments_and_a_step_counter_per_tensor(capsys):
    [row] = main(["--model", "tiny", "--names", "adamw"])
    model = tiny_llama(512)
    count, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    assert row["parameters"] == count
    b = row["bytes_per_parameter"]
    assert b["weights"] == 4 and b["gradients"] == 4
    # exp_avg and exp_avg_sq: 8 bytes a parameter; one 4-byte step counter per tensor
    assert b["state"] == (8 * count + 4 * tensors) / count
    assert "| `adamw` | float32 | 4.00 | 4.00 | 8.0" in capsys.readouterr().out
