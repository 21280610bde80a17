"""Reward-model data: JSONL files, the split by prompt, labelled samples, counterfactuals, generation.

Data (JSONL, one object per line):
- `bt`:  {"prompt", "chosen", "rejected"}: a preference pair;
- `prm`: {"prompt", "completion", "labels"}: one 0/1 label per step of the completion.
Both can be generated instead of hand-made: sample the policy on the task and
label with the exact verifier (`correctness_reward` for pairs: every correct
sample is paired with an incorrect one of the same prompt; `label_steps` for
the multi-step task, plus the reference solution and copies with one injected
error each, so a PRM also sees correct steps the base policy rarely writes;
`rm.samples_per_prompt=0` skips the policy and labels only those).
`rm.counterfactuals` adds training-only examples that differ from real ones in a
number alone (a swapped final answer; a wrong result in one step), so the RM has
to check the arithmetic rather than the wording; held-out data stay as generated.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from covey.config import RMConfig, RolloutConfig, TaskConfig
from covey.models.load import load_policy
from covey.rewards.learned import decode_separator
from covey.rewards.rules import correctness_reward
from covey.rollout.local import LOCAL_ENGINES, local_engine
from covey.runtime.metrics import write_whole
from covey.tasks.answers import NUMBER_RE, extract_answer, math_equal, normalize_number
from covey.tasks.data import format_prompts, load_task_data
from covey.tasks.multistep import corrupt_solution, label_steps, parse_corruptions, reference_steps, split_steps


class RewardDataError(ValueError):
    """Bad reward-model training data (one line naming file and line)."""


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass
class StepExample:
    prompt: str
    completion: str
    labels: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------- data files


def load_rm_data(path: str | Path, objective: str, separator: str = "\n") -> list:
    """PreferencePairs (bt) or StepExamples (prm) from JSONL; errors name file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reward-model data file not found: {path}")
    keys = ("prompt", "chosen", "rejected") if objective == "bt" else ("prompt", "completion", "labels")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RewardDataError(f"{path}:{number}: invalid JSON ({e.msg})") from None
        missing = [k for k in keys if not isinstance(row, dict) or k not in row]
        if missing:
            raise RewardDataError(f"{path}:{number}: missing key(s) {', '.join(missing)} for objective {objective}")
        out.append(_row_to_example(row, objective, f"{path}:{number}", separator))
    if not out:
        raise RewardDataError(f"{path}: no examples")
    return out


def _row_to_example(row: dict, objective: str, where: str, separator: str):
    if objective == "bt":
        return PreferencePair(str(row["prompt"]), str(row["chosen"]), str(row["rejected"]))
    labels = row["labels"]
    if not isinstance(labels, list) or any(v not in (0, 1) for v in labels):
        raise RewardDataError(f"{where}: labels must be a list of 0/1")
    steps = split_steps(str(row["completion"]), separator)
    if len(labels) != len(steps):
        raise RewardDataError(f"{where}: {len(labels)} labels for {len(steps)} steps")
    return StepExample(str(row["prompt"]), str(row["completion"]), [int(v) for v in labels])


def save_rm_data(path: str | Path, examples: list) -> None:
    """JSONL, one example per line; written to a temporary sibling and renamed (never half-written)."""
    write_whole(path, "".join(json.dumps(asdict(ex)) + "\n" for ex in examples))


def split_by_prompt(examples: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) with no prompt on both sides."""
    prompts = sorted({ex.prompt for ex in examples})
    random.Random(seed).shuffle(prompts)
    held_prompts = set(prompts[:max(1, round(len(prompts) * eval_fraction))])
    train = [ex for ex in examples if ex.prompt not in held_prompts]
    held = [ex for ex in examples if ex.prompt in held_prompts]
    if not train or not held:
        raise RewardDataError(f"need examples from at least 2 prompts to hold some out, got {len(prompts)}")
    return train, held


# --------------------------------------------------------------------------- labelled samples


def pairs_from_group(prompt: str, completions: list[str], correct: list[float], limit: int) -> list[PreferencePair]:
    """Pair distinct correct completions with distinct incorrect ones of the same prompt (at most `limit`)."""
    good = list(dict.fromkeys(c for c, ok in zip(completions, correct) if ok > 0.5 and c.strip()))
    bad = list(dict.fromkeys(c for c, ok in zip(completions, correct) if ok <= 0.5 and c.strip()))
    return [PreferencePair(prompt, g, b) for g, b in zip(good, bad)][:limit]


def swap_final_answer(prompt: str, text: str, old: str, new: str) -> str | None:
    """`text` with its final answer `old` written as `new`, or None if the result does not read as `new`.

    Every number in the text equal to `old` is rewritten (the answer is often restated:
    "42 * 9 = 378. The answer is 378."), except when `old` is also a number of the prompt
    (then it may be an operand, and only the last occurrence is rewritten)."""
    spans = [m.span() for m in NUMBER_RE.finditer(text) if normalize_number(m.group()) == old]
    if not spans:
        return None
    if old in {normalize_number(m.group()) for m in NUMBER_RE.finditer(prompt)}:
        spans = spans[-1:]
    for start, end in reversed(spans):
        text = text[:start] + new + text[end:]
    return text if math_equal(extract_answer(text), new) else None


def counterfactual_pairs(pairs: list[PreferencePair], per_pair: int, rng: random.Random,
                         spread: int = 30) -> list[PreferencePair]:
    """Up to `per_pair` extra pairs per sampled pair whose two sides differ only in the final number,
    so the only way to rank them is to check the arithmetic (style, length and wording match):
    the correct text with the wrong answer swapped in, the wrong text with the right answer
    swapped in, then the correct text against nearby wrong numbers (|error| <= spread, the size of
    the policy's own slips: 374, 380, 349 for 42 * 9 = 378). Each pair is re-checked by the verifier."""
    out = []
    for pair in pairs:
        right, wrong = extract_answer(pair.chosen), extract_answer(pair.rejected)
        if right is None or wrong is None or math_equal(wrong, right) or not right.lstrip("-").isdigit():
            continue
        value = int(right)
        offsets = [d for d in range(-spread, spread + 1) if d and (value + d >= 0) == (value >= 0)]
        near = [str(value + d) for d in rng.sample(offsets, min(per_pair, len(offsets)))]
        answering = lambda w: swap_final_answer(pair.prompt, pair.chosen, right, w)  # noqa: E731
        candidates = [(pair.chosen, answering(wrong)),
                      (swap_final_answer(pair.prompt, pair.rejected, wrong, right), pair.rejected)]
        candidates += [(pair.chosen, answering(w)) for w in near if w != wrong]
        sampled = (pair.chosen, pair.rejected)
        made = dict.fromkeys(c for c in candidates if all(c) and c[0] != c[1] and c != sampled)
        out += [PreferencePair(pair.prompt, c, r) for c, r in list(made)[:per_pair]]
    return out


def counterfactual_steps(train: list[StepExample], task_examples: list, per_prompt: int, rng: random.Random,
                         separator: str = "\n") -> list[StepExample]:
    """prm: for every training prompt of the multistep task, `per_prompt` copies of its reference
    solution with one wrong result (right operands, result off by 1-12; later steps follow it),
    exactly labelled: the one error a PRM can only catch by doing the arithmetic."""
    by_prompt = {ex.prompt: ex for ex in task_examples}
    seen = {(e.prompt, e.completion) for e in train}
    out = []
    for prompt in dict.fromkeys(e.prompt for e in train):
        example = by_prompt.get(prompt)
        if example is None:
            continue
        texts = [t.replace("\n", separator) for t in corrupted_solutions(example, rng, per_prompt, ("result",))[1:]]
        for row in step_examples_from_group(example, texts, separator=separator):
            if (row.prompt, row.completion) not in seen:
                seen.add((row.prompt, row.completion))
                out.append(row)
    return out


def corrupted_solutions(example, rng: random.Random, n: int = 1, kinds: tuple[str, ...] = ("result",)) -> list[str]:
    """The reference solution and `n` copies with one injected error each (kind drawn from `kinds`)."""
    right = "\n".join(reference_steps(example.meta["start"], example.meta["ops"]) + [f"Answer: {example.answer}"])
    return [right] + [corrupt_solution(example, rng, rng.choice(kinds)) for _ in range(n)]


def step_examples_from_group(example, completions: list[str], rng: random.Random | None = None,
                             separator: str = "\n", corruptions: int = 1,
                             kinds: tuple[str, ...] = ("result",)) -> list[StepExample]:
    """Exactly labelled steps of every distinct non-empty completion, plus (if rng) the reference
    solution and `corruptions` copies of it with one injected error each."""
    texts = list(completions)
    if rng is not None:
        texts += [sol.replace("\n", separator) for sol in corrupted_solutions(example, rng, corruptions, kinds)]
    out = []
    for text in dict.fromkeys(texts):
        steps, labels = label_steps(example, text, separator)
        if steps:
            out.append(StepExample(example.prompt, text, labels))
    return out


def generate_rm_data(rm: RMConfig, task: TaskConfig, rollout: RolloutConfig, *, policy_path: str,
                     step_separator: str, seed: int, log=print) -> list:
    """Label the task's training prompts exactly for `rm.objective`: samples of the policy at
    `policy_path` (model.path) and, for a PRM, the reference solution with corrupted copies
    (with rm.samples_per_prompt=0 only those). `seed` is train.seed."""
    examples = load_task_data(task, seed).train
    if rm.objective == "prm" and "ops" not in (examples[0].meta if examples else {}):
        raise RewardDataError("generating PRM data needs exact step labels: use task.name=multistep")
    rng, out, t0 = random.Random(seed), [], time.perf_counter()
    separator = decode_separator(step_separator)
    kinds = parse_corruptions(rm.corruption_kinds)
    sample = (_policy_sampler(policy_path, rollout, rm.samples_per_prompt, task.system_prompt)
              if rm.samples_per_prompt else (lambda batch: [[] for _ in batch]))
    per_call = max(1, rollout.prompts_per_step)
    for start in range(0, len(examples), per_call):
        batch = examples[start:start + per_call]
        for ex, texts in zip(batch, sample(batch)):
            if rm.objective == "bt":
                correct = correctness_reward(None, texts, answer=ex.answer)
                out += pairs_from_group(ex.prompt, texts, correct, limit=2)
            else:
                out += step_examples_from_group(ex, texts, rng, separator, rm.corruptions_per_prompt, kinds)
        if rm.samples_per_prompt:
            log(f"covey train-rm: sampled {start + len(batch)} prompts -> {len(out)} examples "
                f"({time.perf_counter() - t0:.0f}s)")
        if len(out) >= rm.num_examples:
            break
    return out[:rm.num_examples]


def _policy_sampler(policy_path: str, rollout: RolloutConfig, samples: int, system_prompt: str):
    """batch of examples -> per example, `samples` (rm.samples_per_prompt) completions of the policy."""
    policy, tokenizer = load_policy(policy_path)
    # The training loop's engine when it is local (fast: each prompt encoded once for its samples);
    # vllm would need its own server copy for a one-off data pass, so the fast engine stands in.
    name = rollout.engine if rollout.engine in LOCAL_ENGINES else "fast"
    engine = local_engine(name, policy, tokenizer, max_new_tokens=rollout.max_new_tokens,
                          temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)

    def sample(batch):
        sampled = engine.generate(format_prompts(tokenizer, batch, system_prompt), samples)
        return [[c for c, i in zip(sampled.completions, sampled.example_index) if i == j] for j in range(len(batch))]
    return sample


def counterfactual_examples(rm: RMConfig, train: list, task: TaskConfig, *, step_separator: str, seed: int) -> list:
    """rm.counterfactuals extra training examples (none for the held-out side)."""
    if not rm.counterfactuals:
        return []
    rng = random.Random(seed)
    if rm.objective == "bt":
        return counterfactual_pairs(train, rm.counterfactuals, rng)
    return counterfactual_steps(train, load_task_data(task, seed).train, rm.counterfactuals, rng,
                                decode_separator(step_separator))
