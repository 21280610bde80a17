"""LLM-as-judge over a group: a judge model scores the G answers of one prompt relative to each other, in one
prompt (RULER, OpenPipe 2025: relative scores suit GRPO, whose advantages compare a group's answers anyway).

`JudgeReward` is a TRL-shaped reward function, the term `judge` (reward.judge.*). The rows of one call are
prompt-major, so a group is a run of consecutive rows with the same prompt, cut into runs of at most
rollout.group_size (`groups_of`). Each group becomes one judgment prompt: the rubric template (the built-in
`DEFAULT_TEMPLATE` or reward.judge.template) with {prompt} (the prompt as the dataset gives it; chat messages
as 'role: content' lines), {answers} (the answers numbered from 1, each between <answer K> and </answer K>)
and {count} (how many) filled in. The judge answers greedily.

Parse rule (`parse_judgment`, strict): text up to the last '</think>' is dropped (a reasoning model's
thoughts); every other non-blank line must read `answer K: SCORE` (K a whole number, SCORE a decimal number
without sign or exponent, 'answer' in any case); every K from 1 to G appears exactly once, and each SCORE
lies in [0, 1]. Anything else (a missing or repeated answer, a number out of range, any other text) is an
unparsed judgment: the group's answers get None, counted in `reward/judge_unparsed` (`judge_metrics`), and
a warning names the first reason once. A judgment prompt longer than a local judge's context is treated
the same way. None is covey's "not scored" (covey/rewards/combine.py): it adds nothing to the total, is
left out of reward/judge's mean, and a sample no other term scored gets 0 (counted in reward/unscored), so
a group without a judgment has equal rewards and no advantage.

The judge (reward.judge.model) is a local model (`LocalJudge`: loaded once onto train.device, frozen, in
bfloat16 where the device computes it natively, every group of a call in one batch of covey's fast engine)
or an OpenAI-compatible endpoint http(s)://host:port/v1 (`EndpointJudge`: `covey serve-policy`, vLLM, a
provider; one request per group, sent concurrently, through the `openai` client where installed, else
urllib). Connection errors, timeouts and 408/429/5xx answers are retried with backoff; after the last retry,
or on another status, a `JudgeError` names the URL: a reward fault, which reward.on_error handles.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from covey.config.errors import ConfigError
from covey.models.families import check_model_family
from covey.models.load import load_policy, resolve_model_path
from covey.rewards.rules import completion_text
from covey.rollout.local import DecodeOptions, local_engine
from covey.runtime.dist import resolve_device
from covey.runtime.errors import first_line
from covey.runtime.http import connect_error
from covey.runtime.precision import native_bf16
from covey.tasks.base import messages_text

TERM_NAME = "judge"  # the judge's reward term: metric reward/judge, part `judge` of the scores
UNPARSED_METRIC = "reward/judge_unparsed"
DEFAULT_TEMPLATE = """\
You are grading {count} answers to the same task. Read the task and every answer, then score each answer \
from 0 to 1 by comparing the answers with each other: a correct, complete and clear answer scores near 1, \
a wrong, empty or off-topic one near 0; a better answer scores higher than a worse one, and answers of \
equal quality score the same.

Task:
{prompt}

{answers}

Reply with exactly {count} lines and nothing else, one per answer, each of the form
answer K: SCORE
where K is the answer's number (1 to {count}) and SCORE a number from 0 to 1."""
PLACEHOLDER = re.compile(r"\{(prompt|answers|count)\}")
SCORE_LINE = re.compile(r"answer\s+(\d+)\s*:\s*(\d+(?:\.\d*)?|\.\d+)", re.IGNORECASE)
RETRIES = 3
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
MAX_REQUESTS = 16  # judgment requests in flight at once to an endpoint


class JudgeError(RuntimeError):
    """The judge endpoint gave no judgment (one line naming it): a reward fault."""


class JudgmentError(ValueError):
    """Why a judge's reply did not parse (one line)."""


@dataclass(frozen=True)
class JudgeOptions:
    """The judge of a run: reward.judge.* (each field the key of its name), and what it reads of the others."""
    model: str
    weight: float
    template: str
    max_new_tokens: int
    endpoint_model: str
    token_env: str
    timeout_s: float
    group_size: int
    """rollout.group_size: the most answers judged together (0: every run of one prompt's rows)."""
    device: str
    """train.device: where a local judge loads (auto | cpu | cuda)."""


# --------------------------------------------------------------------------- the judgment prompt and its parse


def read_template(path: str) -> str:
    """The rubric template of reward.judge.template ('' = DEFAULT_TEMPLATE); it must hold {prompt} and {answers}."""
    if not path:
        return DEFAULT_TEMPLATE
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"reward.judge.template={path}: no such file")
    text = file.read_text(encoding="utf-8")
    missing = [p for p in ("{prompt}", "{answers}") if p not in text]
    if missing:
        raise ConfigError(f"reward.judge.template={path}: the template lacks {' and '.join(missing)} (placeholders: "
                          "{prompt}, {answers}, {count})")
    return text


def prompt_of(prompt) -> str:
    """A prompt as the judge reads it: a string as it is, chat messages as 'role: content' lines."""
    return prompt if isinstance(prompt, str) else messages_text(prompt)


def numbered_answers(answers: list[str]) -> str:
    """The answers numbered from 1, each between <answer K> and </answer K>, a blank line between them."""
    return "\n\n".join(f"<answer {k}>\n{text}\n</answer {k}>" for k, text in enumerate(answers, 1))


def judgment_text(template: str, prompt, answers: list[str]) -> str:
    """The judgment prompt of one group: the template's placeholders filled in one pass (a brace in the prompt
    or an answer is never read as a placeholder)."""
    values = {"prompt": prompt_of(prompt), "answers": numbered_answers(answers), "count": str(len(answers))}
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_judgment(reply: str, count: int) -> list[float]:
    """The scores of answers 1..count from a judge's reply, by the strict rule of the module docstring;
    JudgmentError naming the first thing wrong."""
    text = reply.rsplit("</think>", 1)[-1]
    scores: dict[int, float] = {}
    for line in (raw.strip() for raw in text.splitlines()):
        if not line:
            continue
        match = SCORE_LINE.fullmatch(line)
        if match is None:
            raise JudgmentError(f"the line {line[:60]!r} is not 'answer K: SCORE'")
        k, score = int(match.group(1)), float(match.group(2))
        if not 1 <= k <= count:
            raise JudgmentError(f"it scores answer {k} of {count}")
        if k in scores:
            raise JudgmentError(f"it scores answer {k} twice")
        if score > 1:
            raise JudgmentError(f"answer {k}'s score {match.group(2)} is above 1")
        scores[k] = score
    missing = [k for k in range(1, count + 1) if k not in scores]
    if missing:
        raise JudgmentError(f"it does not score answer {missing[0]}" + (" (empty reply)" if not scores else ""))
    return [scores[k] for k in range(1, count + 1)]


def groups_of(prompts: list, max_size: int = 0) -> list[range]:
    """The rows of each group: runs of consecutive rows with equal prompts (rows are prompt-major), cut into
    runs of at most `max_size` rows (two draws of one prompt in a batch are two groups; 0: no cut)."""
    groups, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start] or (max_size and i - start == max_size):
            groups.append(range(start, i))
            start = i
    return groups


class JudgeReward:
    """The reward term `judge`: `fn(prompts, completions, **columns) -> list[float | None]`, one judgment per
    group. `backend.complete(texts)` answers each judgment prompt with the judge's reply, or None for one it
    could not ask (longer than a local judge's context)."""

    def __init__(self, backend, template: str = DEFAULT_TEMPLATE, max_group: int = 0):
        self.backend, self.template, self.max_group = backend, template, max_group
        self.warned = False

    def __call__(self, prompts, completions, **columns) -> list[float | None]:
        groups = groups_of(list(prompts), self.max_group)
        texts = [judgment_text(self.template, prompts[g.start], [completion_text(completions[i]) for i in g])
                 for g in groups]
        replies = self.backend.complete(texts)
        out: list[float | None] = [None] * len(completions)
        for rows, reply in zip(groups, replies):
            try:
                if reply is None:
                    raise JudgmentError("the judgment prompt is longer than the judge's context")
                scores = parse_judgment(reply, len(rows))
            except JudgmentError as why:
                self.warn(str(why))
                continue
            for i, score in zip(rows, scores):
                out[i] = score
        return out

    def warn(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"covey: warning: reward.judge: a judgment did not parse ({why}); its group is not scored by the "
                  f"judge ({UNPARSED_METRIC} counts such answers; this warning is shown once)")


def judge_metrics(parts: dict) -> dict:
    """reward/judge_unparsed: the samples whose group got no judgment (the judge's None, NaN in its part of the
    scores); {} without a judge."""
    values = parts.get(TERM_NAME)
    return {} if values is None else {UNPARSED_METRIC: int(values.isnan().sum())}


# --------------------------------------------------------------------------- a local judge


class LocalJudge:
    """A judge model in this process, greedy through covey's fast engine; thread-safe (one lock).
    `context`: the judge's positions; a longer judgment prompt is not asked (its reply is None)."""

    def __init__(self, engine, max_new_tokens: int, context: int | None = None, where: str = "local"):
        self.engine, self.max_new_tokens, self.context, self.where = engine, max_new_tokens, context, where
        self.lock = threading.Lock()

    @classmethod
    def load(cls, spec: str, device_setting: str, max_new_tokens: int) -> "LocalJudge":
        """The model of `spec`, loaded once onto train.device (`device_setting`; under torchrun this process's
        GPU), in eval mode with no gradient, in bfloat16 where the device computes it natively."""
        device = resolve_device(device_setting, int(os.environ.get("LOCAL_RANK", "0")))
        path = resolve_model_path(spec)
        family = check_model_family(path)  # a family covey cannot serve fails before its weights load
        dtype = torch.bfloat16 if native_bf16(device) else torch.float32
        model, tokenizer = load_policy(path, dtype=dtype, device=device)
        model.eval().requires_grad_(False)
        engine = local_engine("fast", model, tokenizer, max_new_tokens=max_new_tokens, decode=DecodeOptions())
        return cls(engine, max_new_tokens, family.context, f"local, {str(dtype).removeprefix('torch.')} on {device}")

    def prompt_text(self, text: str) -> str:
        """The judgment prompt as the judge reads it: one user message in its chat template (the text itself for
        a model without one)."""
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return text
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    def complete(self, texts: list[str]) -> list[str | None]:
        tokenizer = self.engine.tokenizer
        chat = bool(getattr(tokenizer, "chat_template", None))  # the template writes the special tokens
        ids = [tokenizer(self.prompt_text(t), add_special_tokens=not chat)["input_ids"] for t in texts]
        asked = [i for i, row in enumerate(ids) if not self.context or len(row) + self.max_new_tokens <= self.context]
        out: list[str | None] = [None] * len(texts)
        if asked:
            with self.lock:
                rollout = self.engine.generate([ids[i] for i in asked], 1, greedy=True,
                                               max_new_tokens=self.max_new_tokens)
            for i, reply in zip(asked, rollout.completions):
                out[i] = reply
        return out

    def describe(self) -> str:
        return self.where


# --------------------------------------------------------------------------- a judge behind an endpoint


def check_endpoint(url: str, timeout_s: float = 2.0) -> None:
    """One TCP connection to the endpoint's host and port before any model loads; one line otherwise."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ConfigError(f"reward.judge.model={url}: an endpoint must look like http://host:port/v1")
    why = connect_error(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), timeout_s)
    if why:
        raise JudgeError(f"reward.judge.model={url}: {why}: start the judge (covey serve-policy MODEL) or fix the URL")


class EndpointJudge:
    """A judge behind an OpenAI-compatible endpoint (`url` ends in /v1): one greedy chat request per judgment
    prompt, up to MAX_REQUESTS at once. `client`: openai (the `openai` package) | urllib | auto (openai where
    installed)."""

    def __init__(self, url: str, *, model_name: str = "", token: str = "", timeout_s: float = 60.0,
                 max_new_tokens: int = 256, client: str = "auto"):
        self.url, self.name, self.token = url.rstrip("/"), model_name, token
        self.timeout_s, self.max_new_tokens = timeout_s, max_new_tokens
        self.openai = None
        if client in ("auto", "openai"):
            try:
                from openai import OpenAI
                self.openai = OpenAI(base_url=self.url, api_key=token or "unused", timeout=timeout_s,
                                     max_retries=RETRIES)
            except ImportError:
                if client == "openai":
                    raise
        self.lock = threading.Lock()

    def served_model(self) -> str:
        """reward.judge.endpoint_model, else the first model the endpoint lists (asked once)."""
        with self.lock:
            try:
                self.name = self.name or str(self.call(lambda: self.openai.models.list().data[0].id)
                                             if self.openai is not None else self.request("/models")["data"][0]["id"])
            except (LookupError, TypeError):
                raise JudgeError(f"reward.judge endpoint {self.url}: its /models lists no model: set "
                                 "reward.judge.endpoint_model") from None
        return self.name

    def complete(self, texts: list[str]) -> list[str]:
        if not texts:
            return []
        name = self.served_model()
        pool = ThreadPoolExecutor(max_workers=min(len(texts), MAX_REQUESTS), thread_name_prefix="covey-judge")
        try:
            return list(pool.map(lambda text: self.ask(name, text), texts))
        finally:  # a reward timeout leaves the requests in flight to end by their own timeout
            pool.shutdown(wait=False, cancel_futures=True)

    def ask(self, name: str, text: str) -> str:
        body = {"model": name, "messages": [{"role": "user", "content": text}], "temperature": 0,
                "max_tokens": self.max_new_tokens}
        if self.openai is not None:
            reply = self.call(lambda: self.openai.chat.completions.create(**body))
            return reply.choices[0].message.content or ""
        return self.request("/chat/completions", body)["choices"][0]["message"]["content"] or ""

    def call(self, fn):
        """An `openai` call (the client retries), its errors as one JudgeError line."""
        import openai
        try:
            return fn()
        except openai.APIStatusError as err:
            raise JudgeError(f"reward.judge endpoint {self.url}: HTTP {err.status_code}: {first_line(err)}") from None
        except openai.APIError as err:  # no connection or a timeout, after the client's retries
            raise JudgeError(f"reward.judge endpoint {self.url}: no answer after {RETRIES + 1} attempts (last: "
                             f"{type(err).__name__}: {first_line(err)})") from None

    def request(self, path: str, body: dict | None = None) -> dict:
        """GET (no body) or POST JSON through urllib, retried as the module docstring says; the answer's JSON."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.token}"}
                                                          if self.token else {})}
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data, headers=headers),
                                            timeout=self.timeout_s) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code}: {err.read()[:200].decode(errors='replace')}"
                if err.code not in RETRY_STATUS:
                    raise JudgeError(f"reward.judge endpoint {self.url}: {last}") from None
            except (OSError, ValueError) as err:  # no connection, a timeout, an answer that is not JSON
                last = f"{type(err).__name__}: {first_line(err)}"
        raise JudgeError(f"reward.judge endpoint {self.url}: no answer after {RETRIES + 1} attempts (last: {last})")

    def describe(self) -> str:
        return f"endpoint {self.url}, model {self.name or '(the first it lists)'}"


# --------------------------------------------------------------------------- from the plan


def check_judge(options: JudgeOptions, reward_timeout_s: float) -> None:
    """reward.judge.* checked before any model loads: the numbers, the template, an endpoint's connection; a
    warning when reward.timeout_s (the limit of one whole judge call) is below one request's timeout."""
    o = options
    if not o.model:
        return
    if not math.isfinite(o.weight) or o.max_new_tokens < 1 or not o.timeout_s > 0:
        raise ConfigError(f"reward.judge: weight must be finite (got {o.weight}), max_new_tokens >= 1 (got "
                          f"{o.max_new_tokens}) and timeout_s > 0 (got {o.timeout_s})")
    read_template(o.template)
    if o.model.startswith(("http://", "https://")):
        check_endpoint(o.model)
        if 0 < reward_timeout_s < o.timeout_s:
            print(f"covey: warning: reward.timeout_s={reward_timeout_s:g} bounds each whole judge call, below "
                  f"reward.judge.timeout_s={o.timeout_s:g}: a slow judge is a reward fault; raise reward.timeout_s")


def load_judge(options: JudgeOptions) -> JudgeReward:
    """The judge of reward.judge.model: an endpoint, or a local model loaded now (once)."""
    o = options
    if o.model.startswith(("http://", "https://")):
        backend = EndpointJudge(o.model, model_name=o.endpoint_model, token=os.environ.get(o.token_env, ""),
                                timeout_s=o.timeout_s, max_new_tokens=o.max_new_tokens)
    else:
        backend = LocalJudge.load(o.model, o.device, o.max_new_tokens)
    print(f"covey: judge {o.model} ({backend.describe()}), rubric {o.template or 'built in'}")
    return JudgeReward(backend, read_template(o.template), o.group_size)
