"""The GPU capacity grid on a CPU (bench/gpu.py, `python -m bench.gpu_capacity`): the cells' order (acceptance
first), each cell's record and the table, the driver over stub children, and the wheels scripts/gpu_capacity.sh
prepares."""

import json
import re
from pathlib import Path

import pytest

from bench import gpu
from bench.gpu import ACCEPTANCE, Cell, capacity_cells, describe, gpu_summary, gpu_table, run_cells, why_not

ROOT = Path(__file__).resolve().parents[2]


def test_acceptance_cells_run_first_and_every_cell_once():
    cells = capacity_cells()
    assert [c.name for c in cells[:5]] == ["covey-7b-full-80g", "covey-1.5b-full-24g", "covey-7b-qlora-16g",
                                           "covey-1.5b-defaults-80g", "trl-1.5b-defaults-80g"]
    assert [c.name for c in cells[5:8]] == ["trl-7b-full-80g", "trl-1.5b-full-24g", "trl-7b-qlora-16g"]
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    # the grid: 4 sizes x 3 setups x 2 caps x 2 trainers, plus 14B QLoRA at both caps for both, plus the
    # 8 acceptance cells and TRL's counterparts, of which 4 are grid cells too (7b-full-80g and 1.5b-full-24g
    # for either trainer; QLoRA at 16 GiB and the defaults are outside the grid)
    assert len(cells) == 4 * 3 * 2 * 2 + 4 + 8 - 4
    assert names[-4:] == ["covey-14b-qlora-24g", "trl-14b-qlora-24g", "covey-14b-qlora-80g", "trl-14b-qlora-80g"]
    assert all(c.trainer == "covey" for c in capacity_cells(trainers=("covey",)))
    assert cells[2].spec == {"setup": "qlora", "cap_gib": 16}


def test_dry_run_prints_each_cells_settings(capsys):
    assert gpu.main(["--dry-run", "--no-14b"], capacity=True) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(" 1. covey-7b-full-80g: model.dtype=bfloat16 optim.name=adamw_8bit")
    assert "[7B QLoRA under 16 GiB]" in out[2] and "model.load_in_4bit=true" in out[2]
    assert "optim=adamw_8bit" in out[5] and "use_liger_kernel=True" in out[5]
    assert not any("14b" in line for line in out)


def steps(*seconds):
    return [{"step_s": s, "generate_s": s / 2, "logprobs_s": 0.1, "update_s": s / 4, "score_s": 0.0} for s in seconds]


def test_each_cell_in_the_table_and_why_a_cell_gave_no_step(tmp_path):
    oom = tmp_path / "oom.log"
    oom.write_text("bench: ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nTraceback\n")
    fit = tmp_path / "fit.log"
    fit.write_text("covey: error: the run does not fit train.gpu_memory_gib=21.6: weights 12.0 GiB ...\n")
    assert why_not(oom).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert why_not(fit).startswith("covey: error: the run does not fit")
    assert why_not(tmp_path / "none.log") == "not run: no time left in the budget"
    # medians of steps 2..3: 11 s (10, 12); the first step 30 s; 70 GiB
    shape = {"matmul_params": 1e9, "params": 1e9, "heads": 12, "kv_heads": 2, "head_dim": 128, "layers": 28,
             "prompt_tokens_mean": 40, "describe": "stub"}
    row = gpu_summary("7b", {}, shape, {ACCEPTANCE[0].name: {"steps": steps(30, 10, 12), "peak_gpu_mib": 70 * 1024},
                                        ACCEPTANCE[2].name: None}, {"prompts": 8, "group_size": 8, "new_tokens": 512})
    text = gpu_table([row])
    assert "| 7b | covey-7b-full-80g | 11.00 | 30.00 |" in text and "| 70.00 |" in text
    assert "| 7b | covey-7b-qlora-16g | no step |" in text


class StubChildren:
    """Children that answer from a table instead of starting processes."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def left(self):
        return 400.0

    def skip(self, name, why):
        return None

    def run(self, side, role, name, spec, reserve_s=0.0):
        self.calls.append((role, name, reserve_s))
        if role == "build":
            Path(spec["model"]).mkdir(parents=True)
            return {"describe": "stub", "prompt_tokens_mean": 40}
        return self.answers.get(name)


def test_the_driver_builds_each_size_once_and_deletes_it_after_its_last_cell(tmp_path):
    cells = [Cell("a", "covey", "0.5b"), Cell("b", "covey", "1.5b"), Cell("c", "trl", "0.5b")]
    children = StubChildren({"a": {"steps": steps(5, 1, 1)}})
    results, shapes = run_cells(children, cells, tmp_path / "models", {"workload": "capacity"}, tmp_path / "c.jsonl")
    assert [c[:2] for c in children.calls] == [("build", "build-0.5b"), ("steps", "a"), ("build", "build-1.5b"),
                                               ("steps", "b"), ("steps", "c")]
    assert children.calls[1][2] == 400 - gpu.LIMIT_S["0.5b"]  # the run's own time limit
    assert results == {"a": {"steps": steps(5, 1, 1)}, "b": None, "c": None} and set(shapes) == {"0.5b", "1.5b"}
    assert [json.loads(line)["name"] for line in (tmp_path / "c.jsonl").read_text().splitlines()] == ["a", "b", "c"]
    assert not any((tmp_path / "models").iterdir())  # every folder deleted after its size's last cell


def test_prepare_downloads_exactly_the_carried_wheels():
    script = (ROOT / "scripts" / "gpu_capacity.sh").read_text()
    wheels = re.search(r'^WHEELS="\n(.*?)\n"', script, re.S | re.M).group(1).split()
    assert sorted(wheels) == sorted(["trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19",
                                     "torchao==0.18.0", "liger-kernel==0.8.5", "bitsandbytes==0.50.2"])
    prepare = script[script.index('if [ "${1:-}" = "--prepare" ]'):script.index("exit 0")]
    assert re.search(r"pip download --no-deps --only-binary=:all:.*-d \.whl \$WHEELS", prepare, re.S)
    assert "pyarrow" not in prepare  # the GPU machine has its own
    comment = " ".join(line.lstrip("# ") for line in script.splitlines() if line.startswith("#      "))
    assert all(w in comment for w in wheels)  # the header lists the same wheels


@pytest.mark.parametrize("cell", ACCEPTANCE)
def test_every_acceptance_cell_has_settings_for_its_trainer(cell):
    assert cell.name in {c.name for c in capacity_cells()} and describe(cell)
