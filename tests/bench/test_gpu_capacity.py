"""bench/gpu_capacity.py on a CPU: the cells' order (acceptance first), each cell's record and the table,
the acceptance lines worked by hand, the driver over stub children, and the wheels scripts/gpu_capacity.sh
prepares."""

import json
import re
from pathlib import Path

import pytest

from bench import gpu_capacity as cap
from bench.gpu_capacity import ACCEPTANCE, Cell, acceptance_lines, cell_record, failure_line, plan_cells, table

ROOT = Path(__file__).resolve().parents[2]


def test_acceptance_cells_run_first_and_every_cell_once():
    cells = plan_cells()
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
    assert all(c.trainer == "covey" for c in plan_cells(trainers=("covey",)))


def test_dry_run_prints_each_cells_settings(capsys):
    assert cap.main(["--dry-run", "--no-14b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(" 1. covey-7b-full-80g: model.dtype=bfloat16 optim.name=adamw_8bit")
    assert "[7B QLoRA under 16 GiB]" in out[2] and "model.load_in_4bit=true" in out[2]
    assert "optim=adamw_8bit" in out[5] and "use_liger_kernel=True" in out[5]
    assert not any("14b" in line for line in out)


def steps(*seconds):
    return [{"step_s": s, "generate_s": s / 2, "reference_s": 0.1, "update_s": s / 4, "score_s": 0.0}
            for s in seconds]


def test_records_table_and_acceptance_by_hand(tmp_path):
    oom = tmp_path / "oom.log"
    oom.write_text("bench: ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    records = [
        cell_record(ACCEPTANCE[0], {"steps": steps(30, 10, 12), "peak_gpu_bytes": 70 * 2**30}, tmp_path / "a"),
        cell_record(ACCEPTANCE[1], None, oom),
        cell_record(ACCEPTANCE[2], None, tmp_path / "missing.log"),
        cell_record(ACCEPTANCE[3], {"steps": steps(8, 2, 2), "peak_gpu_bytes": 20 * 2**30}, tmp_path / "b"),
        cell_record(ACCEPTANCE[4], {"steps": steps(9, 4, 4), "peak_gpu_bytes": 40 * 2**30}, tmp_path / "c"),
    ]
    # medians of steps 2..3: 11 s (10, 12), 2 s and 4 s; first steps 30, 8 and 9 s
    assert records[0]["step_s"] == 11 and records[0]["first_step_s"] == 30 and records[0]["peak_gib"] == 70
    assert records[1]["error"].startswith("out of memory: torch.OutOfMemoryError")
    assert records[2]["error"] == "not run (no time left in the budget)"
    text = table(records)
    assert "| covey-7b-full-80g | yes | 70.0 | 11.00 | 30.0 | model.dtype=bfloat16" in text
    assert "| covey-1.5b-full-24g | no: out of memory" in text
    # update FLOPs of the 1.5B shape below: 6 x 1e9 x (64 x 512 + 8 x 40) tokens = 1.98528e14 plus attention;
    # the update took 2 / 4 = 0.5 s; against a 800 TFLOP/s peak
    shape = {"matmul_params": 1e9, "heads": 12, "head_dim": 128, "layers": 28, "prompt_tokens_mean": 40}
    workload = {"prompts": 8, "group_size": 8, "new_tokens": 512}
    lines = acceptance_lines(records, {"matmul_tflops": 800.0}, {"1.5b": shape}, workload)
    assert lines[0] == "7B full-parameter on 80 GB: runs, peak 70.0 GiB, 11.0 s/step"
    assert lines[1].startswith("1.5B full-parameter under 24 GiB: does not run (out of memory")
    # covey / TRL: 20 / 40 GiB = 0.50; 2 / 4 s = 0.50
    assert lines[3] == "1.5B defaults, covey / TRL: peak memory 0.50, step time 0.50"
    pairs = 64 * (512 * 40 + 512 * 513 / 2) + 8 * 40 * 41 / 2
    flops = 6e9 * (64 * 512 + 8 * 40) + 3 * 4 * 12 * 128 * 28 * pairs
    share = flops / 0.5 / 1e12 / 800
    assert re.search(rf"= {share:.2f} of the bf16 matmul peak", lines[4])
    # first / steady: 30 / 11 = 2.7, 8 / 2 = 4.0, 9 / 4 = 2.2 (2.25 rounds to 2.2)
    assert lines[5].startswith("first step / steady step: covey-7b-full-80g 2.7x, covey-1.5b-defaults-80g 4.0x")
    assert lines[5].endswith("(median 2.7x)")


def test_fit_check_refusal_is_named(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("covey: error: the run does not fit train.gpu_memory_gib=21.6: weights 12.0 GiB ...\n")
    assert failure_line(log).startswith("covey's fit check refused it: covey: error: the run does not fit")


class StubChildren:
    """Children that answer from a table instead of starting processes."""

    def __init__(self, log_dir, answers):
        self.log_dir, self.answers, self.calls = log_dir, answers, []

    def left(self):
        return 400.0

    def say(self, text):
        pass

    def run(self, module, role, name, args, reserve_s=0.0):
        self.calls.append((role, name, reserve_s))
        if role == "build":
            Path(args[args.index("--model") + 1]).mkdir(parents=True)
            return {"describe": "stub", "prompt_tokens_mean": 40}
        return self.answers.get(name)


def test_the_driver_builds_each_size_once_and_deletes_it_after_its_last_cell(tmp_path, monkeypatch):
    cells = [Cell("covey", "0.5b", "full", 24), Cell("covey", "1.5b", "full", 24), Cell("trl", "0.5b", "full", 24)]
    answers = {"covey-0.5b-full-24g": {"steps": steps(5, 1, 1), "peak_gpu_bytes": 2**30}}
    children = StubChildren(tmp_path / "logs", answers)
    (tmp_path / "logs").mkdir()
    args = cap.parse_args(["--budget-s", "400"])
    records, shapes = cap.run_cells(children, args, cells, tmp_path / "models", tmp_path / "c.jsonl")
    assert [c[:2] for c in children.calls] == [("build", "build-0.5b"), ("cell", "covey-0.5b-full-24g"),
                                               ("build", "build-1.5b"), ("cell", "covey-1.5b-full-24g"),
                                               ("cell", "trl-0.5b-full-24g")]
    assert children.calls[1][2] == 400 - cap.CELL_LIMIT_S["0.5b"]  # the cell's own time limit
    assert [r["runs"] for r in records] == [True, False, False] and set(shapes) == {"0.5b", "1.5b"}
    assert [json.loads(line)["name"] for line in (tmp_path / "c.jsonl").read_text().splitlines()] == [
        c.name for c in cells]
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
    assert cell.name in {c.name for c in plan_cells()} and cap.describe(cell)
