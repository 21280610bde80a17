"""A finished run's model out of covey: a GGUF file, LoRA adapters merged into full weights, a plain HF
folder; and the model card (README.md) every run writes into its final/.

`export_run(run_dir, to, out, quant)` reads `run_dir/final/`: a Hugging Face folder (a full run) or
PEFT adapters over the base model that `adapter_config.json` names (a LoRA run, model.lora_rank > 0).

- `gguf`: one llama.cpp file (covey/models/gguf_writer.py; `quant` f16 or q8_0); a LoRA run is merged first;
- `merged`: a LoRA run's adapters merged into the base weights (PEFT's `merge_and_unload`: each adapted
  weight becomes W + (alpha / r) B A), saved as a HF folder;
- `hf`: the final model as a plain HF folder: a copy for a full run (without the critic), the merged
  model for a LoRA run.

The folders get the run's model card. Without `out`, the export goes to `run_dir/export/`.

The model card (`model_card`) is built from the run's recorded config and metrics.jsonl: the base model,
the recipe, the data, the held-out evaluation before and after training (the lines the run logged at
step 0 and with `final`), a text curve of the training reward and accuracy, and covey's version.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import yaml

from covey import __version__
from covey.models.default import DEFAULT_ALIASES, DEFAULT_NAME
from covey.models.errors import ModelError
from covey.models.gguf_writer import write_gguf
from covey.models.load import load_policy
from covey.models.lora import load_adapted
from covey.runtime.metrics import write_whole

TARGETS = ("gguf", "merged", "hf")
CARD = "README.md"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BARS = "▁▂▃▄▅▆▇█"
CURVES = (("reward/mean", "training reward (mean)"), ("accuracy", "training accuracy"))
NOT_COPIED = {"critic.pt", CARD}


# --------------------------------------------------------------------------- export


def final_folder(run_dir: str | Path) -> Path:
    """The run's final/ folder; a one-line error naming the folder when the run has none."""
    final = Path(run_dir) / "final"
    if not final.is_dir():
        raise ModelError(f"{run_dir}: no final/ folder (the run did not finish, or it is not a covey run folder)")
    return final


def is_lora(folder: Path) -> bool:
    return (Path(folder) / "adapter_config.json").is_file()


def default_out(run_dir: Path, to: str, quant: str) -> Path:
    if to == "gguf":
        return Path(run_dir) / "export" / f"{Path(run_dir).resolve().name}-{quant}.gguf"
    return Path(run_dir) / "export" / to


def merged_model(final: Path):
    """(model, tokenizer): a LoRA run's adapters merged into its base weights, in float32."""
    adapted, tokenizer = load_adapted(final, dtype=torch.float32)
    return adapted.merge_and_unload(), tokenizer


def final_model(final: Path):
    """(model, tokenizer) of final/, merged when it holds adapters."""
    if is_lora(final):
        return merged_model(final)
    return load_policy(str(final), dtype=torch.float32)


def export_run(run_dir: str | Path, to: str, out: str | Path | None = None, quant: str = "f16") -> Path:
    """Export the run's final model as `to` (TARGETS) to `out`; the path written."""
    if to not in TARGETS:
        raise ModelError(f"export: unknown target '{to}' (one of {', '.join(TARGETS)})")
    run_dir = Path(run_dir)
    final = final_folder(run_dir)
    out = Path(out) if out else default_out(run_dir, to, quant)
    if to == "gguf" and out.is_dir():  # a folder to put the file in
        out = out / default_out(run_dir, to, quant).name
    if to == "merged" and not is_lora(final):
        raise ModelError(f"{final}: full weights, not LoRA adapters: nothing to merge (--to hf copies them)")
    if to != "gguf" and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"{out}: already exists: remove it or name another --out")
    card = run_card(run_dir, note=f"Exported by `covey export --to {to}`" + (
        ": the LoRA adapters merged into the base weights." if is_lora(final) else ": a copy of final/."),
        adapters=False)
    if to == "gguf":
        model, tokenizer = final_model(final)
        return write_gguf(model.eval(), tokenizer, out, quant, name=run_dir.resolve().name)
    return write_folder(final, out, card)


def write_folder(final: Path, out: Path, card: str) -> Path:
    """final/ as a plain HF folder at `out` (merged when it holds adapters), with `card`; written to a hidden
    sibling and renamed into place when complete."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if is_lora(final):
            model, tokenizer = merged_model(final)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        else:
            shutil.copytree(final, tmp, ignore=lambda _, names: [n for n in names if n in NOT_COPIED])
        write_whole(tmp / CARD, card)
        if out.exists():
            out.rmdir()  # empty (export_run refuses any other)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- the model card


def sparkline(values: list[float], width: int = 60) -> str:
    """One bar per value, scaled from the smallest (▁) to the largest (█); more than `width` values
    are averaged in `width` consecutive buckets first. All equal: all ▁."""
    values = [float(v) for v in values if v is not None and math.isfinite(v)]
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    scale = (len(BARS) - 1) / (hi - lo) if hi > lo else 0.0
    return "".join(BARS[math.floor((v - lo) * scale + 0.5)] for v in values)


def read_run_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's lines ([] without the file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out(metrics: list[dict], judge: dict) -> tuple[str, str]:
    """The held-out figure before training (step 0) and after (the `final` line); '' where not logged."""
    key = "eval/reward_pass" if judge.get("metric") == "reward" else "eval/accuracy"

    def figure(line: dict | None) -> str:
        if not line or key not in line:
            return ""
        return f"{line[key]:.1%} of {line.get('eval/n', '?')}"

    before = next((m for m in metrics if m.get("step") == 0 and key in m), None)
    after = next((m for m in reversed(metrics) if m.get("final")), None)
    return figure(before), figure(after)


def base_model(path: str) -> tuple[str, str]:
    """(how the card names the base model, its hub id or '')."""
    if path in DEFAULT_ALIASES:
        return f"{DEFAULT_NAME} (`model.path={path}`: covey's default model)", DEFAULT_HUB_ID
    is_hub = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).exists()
    return f"`{path}`", path if is_hub else ""


def recipe_lines(record: dict, steps_done) -> list[str]:
    m, a, r, o, t = (record.get(k, {}) for k in ("model", "algo", "rollout", "optim", "train"))
    lora = (f"LoRA rank {m['lora_rank']}, alpha {m.get('lora_alpha')}, on {m.get('lora_targets')}"
            if m.get("lora_rank") else "full fine-tuning")
    learner = (f"- learner `advantage`, estimator `{a.get('estimator')}`, policy loss `{a.get('policy_loss')}`, "
               f"aggregation `{a.get('loss_agg')}`" if a.get("learner", "advantage") == "advantage"
               else f"- learner `{a['learner']}`")
    return [learner,
            f"- KL coefficient {a.get('beta')} ({a.get('kl_estimator')} estimator, `kl_in={a.get('kl_in')}`)",
            f"- {o.get('name')} at learning rate {o.get('lr')}; {lora}",
            f"- {steps_done} of {t.get('steps')} steps; {r.get('prompts_per_step')} prompts x "
            f"{r.get('group_size')} samples per step, up to {r.get('max_new_tokens')} new tokens at "
            f"temperature {r.get('temperature')}; seed {t.get('seed')}"]


def data_line(task: dict) -> str:
    name = task.get("name", "?")
    if task.get("path"):
        source = f"`{task['path']}`" + (f" (split {task['split']})" if task.get("split") else "")
        held = f", held-out `{task['eval_path']}`" if task.get("eval_path") else ""
        return f"task `{name}`: {source}{held}; {task.get('train_size')} train / {task.get('eval_size')} held-out"
    return f"task `{name}` (built in); {task.get('train_size')} train / {task.get('eval_size')} held-out examples"


def curve_lines(metrics: list[dict]) -> list[str]:
    steps = [m for m in metrics if m.get("step", 0) >= 1 and not m.get("final")]
    lines = []
    for key, label in CURVES:
        values = [m[key] for m in steps if isinstance(m.get(key), (int, float))]
        if values:
            lines.append(f"{label:<24} {sparkline(values)}  ({len(values)} steps, from {values[0]:.3g} to "
                         f"{values[-1]:.3g}; min {min(values):.3g}, max {max(values):.3g})")
    return lines or ["(no training steps logged)"]


def model_card(record: dict, metrics: list[dict], note: str = "", adapters: bool | None = None) -> str:
    """The README.md of a run's model, from its recorded config and its metrics.jsonl lines. `adapters`: whether
    the folder holds LoRA adapters (default: whether the run trained them)."""
    model, task, judge = record.get("model", {}), record.get("task", {}), record.get("eval", {})
    base, hub = base_model(str(model.get("path", "?")))
    lora = bool(model.get("lora_rank"))
    adapters = lora if adapters is None else adapters
    algo = record.get("algo", {})
    estimator = algo.get("estimator", "rl") if algo.get("learner", "advantage") == "advantage" else algo["learner"]
    front = ["---", f"library_name: {'peft' if adapters else 'transformers'}", *([f"base_model: {hub}"] if hub else []),
             f"tags: [covey, reinforcement-learning, {estimator}]", "---"]
    before, after = held_out(metrics, judge)
    what = ("share of greedy answers at reward >= " + str(judge.get("reward_threshold", 1.0))
            if judge.get("metric") == "reward" else f"accuracy ({judge.get('metric', '?')} verifier), greedy")
    steps_done = next((m.get("step") for m in reversed(metrics) if m.get("final")), "?")
    body = [f"# {record.get('train', {}).get('run_name') or 'covey run'}", "",
            f"Post-trained with covey {__version__} from {base}." + (f" {note}" if note else ""), "",
            "## Recipe", *recipe_lines(record, steps_done), "",
            "## Data", data_line(task), "",
            "## Held-out evaluation", f"{what}: before training {before or 'not evaluated'}, "
            f"after training {after or 'not evaluated'}.", "",
            "## Training curve", "```", *curve_lines(metrics), "```", "",
            "## Use", "```bash", "covey export RUN_DIR --to gguf --quant q8_0   # a llama.cpp file",
            "covey export RUN_DIR --to " + ("merged   # the adapters merged into full weights" if lora
                                             else "hf       # a plain Hugging Face folder"), "```"]
    return "\n".join(front + body) + "\n"


def run_card(run_dir: Path, record: dict | None = None, note: str = "", adapters: bool | None = None) -> str:
    """The model card of the run in `run_dir` (its config.yaml unless `record` is given)."""
    if record is None:
        config = Path(run_dir) / "config.yaml"
        record = yaml.safe_load(config.read_text()) if config.is_file() else {}
    return model_card(record or {}, read_run_metrics(run_dir), note, adapters)


def write_model_card(folder: Path, run_dir: Path, record: dict) -> Path:
    """`folder`/README.md: the card of the run in `run_dir`."""
    path = Path(folder) / CARD
    path.write_text(run_card(run_dir, record))
    return path
