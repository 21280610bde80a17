"""The judge reward (covey/rewards/judge.py): the strict parse of a judgment, the groups and the judgment prompt,
scripted judges (a fake backend, a fake OpenAI-compatible endpoint) giving rewards worked by hand, covey's own
policy server as the judge endpoint, the exact prompt a local tiny judge sees, and two steps of `covey train`
with a judge."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from covey.cli.main import main
from covey.config import ConfigError, load_config
from covey.rewards.build import build_rewarder, check_reward_sources
from covey.rewards.combine import Rewarder, RewardTerm
from covey.rewards.judge import (
    DEFAULT_TEMPLATE,
    EndpointJudge,
    JudgeError,
    JudgeReward,
    JudgmentError,
    LocalJudge,
    groups_of,
    judge_metrics,
    judgment_text,
    parse_judgment,
)
from covey.runtime.precision import native_bf16
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides

# --------------------------------------------------------------------------- the strict parse


@pytest.mark.parametrize("reply, count, expected", [
    ("answer 1: 0.7\nanswer 2: 1", 2, [0.7, 1.0]),
    ("Answer 2: 0\n\n  ANSWER 1: .5  \n", 2, [0.5, 0.0]),  # any order, any case, blank lines and spaces
    ("answer 1:1.\nanswer 2 : 0.25\nanswer 3: 1.000", 3, [1.0, 0.25, 1.0]),
    ("<think>answer 2 is wrong; answer 1: right</think>\nanswer 1: 1\nanswer 2: 0", 2, [1.0, 0.0]),
    ("answer 1: 0", 1, [0.0]),
])
def test_a_well_formed_judgment_gives_every_answers_score(reply, count, expected):
    assert parse_judgment(reply, count) == expected


@pytest.mark.parametrize("reply, count, why", [
    ("answer 1: 0.5", 2, "does not score answer 2"),                                   # missing answer
    ("answer 1: 0.5\nanswer 1: 0.6\nanswer 2: 0", 2, "scores answer 1 twice"),       # duplicate
    ("answer 1: 1.5\nanswer 2: 0", 2, "score 1.5 is above 1"),                        # out of range, above
    ("answer 1: -0.2\nanswer 2: 0", 2, "is not 'answer K: SCORE'"),                   # out of range, below
    ("answer 1: 0\nanswer 3: 1", 2, "scores answer 3 of 2"),                          # no such answer
    ("answer 0: 1\nanswer 1: 1", 1, "scores answer 0 of 1"),
    ("Both answers look fine to me.", 2, "is not 'answer K: SCORE'"),                 # junk
    ("Scores:\nanswer 1: 1\nanswer 2: 0", 2, "'Scores:' is not"),                     # extra text before
    ("answer 1: 1\nanswer 2: 0\nThe first is better.", 2, "'The first is better.' is not"),  # extra text after
    ("answer 1: 1 (best)\nanswer 2: 0", 2, "'answer 1: 1 (best)' is not"),            # extra text on a line
    ("answer 1: nan\nanswer 2: 0", 2, "is not"),
    ("answer 1: 1e-1\nanswer 2: 0", 2, "is not"),
    ('{"answer 1": 1, "answer 2": 0}', 2, "is not"),                                  # JSON is not the format
    ("", 2, "does not score answer 1 (empty reply)"),
    ("<think>answer 1: 1\nanswer 2: 0", 2, "'<think>answer 1: 1' is not"),            # thoughts never closed
])
def test_a_malformed_judgment_is_refused_with_its_reason(reply, count, why):
    with pytest.raises(JudgmentError, match=re.escape(why)):
        parse_judgment(reply, count)


# --------------------------------------------------------------------------- groups and the judgment prompt


def test_groups_are_runs_of_one_prompt_cut_at_the_group_size():
    assert groups_of(["a", "a", "b", "b", "a", "a"]) == [range(0, 2), range(2, 4), range(4, 6)]
    assert groups_of(["a"] * 5, 2) == [range(0, 2), range(2, 4), range(4, 5)]  # one prompt drawn twice, and a rest
    chat = [[{"role": "user", "content": "q"}]] * 2 + [[{"role": "user", "content": "r"}]]
    assert groups_of(chat) == [range(0, 2), range(2, 3)]
    assert groups_of([]) == []


def test_the_judgment_prompt_fills_each_placeholder_once():
    template = "Q: {prompt}\n{answers}\nscore all {count}; {prompt}"
    # a brace in the prompt or an answer is text, never a placeholder filled again
    text = judgment_text(template, "Is {answers} literal?", ["x {count}", ""])
    assert text == ("Q: Is {answers} literal?\n<answer 1>\nx {count}\n</answer 1>\n\n<answer 2>\n\n</answer 2>\n"
                    "score all 2; Is {answers} literal?")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    expected = "system: Be brief.\nuser: 2+2?|<answer 1>\n4\n</answer 1>"
    assert judgment_text("{prompt}|{answers}", chat, ["4"]) == expected


# --------------------------------------------------------------------------- a scripted judge


class Scripted:
    """A judge backend answering each call's judgment prompts with the next replies of `replies`."""

    def __init__(self, *replies):
        self.replies, self.asked = list(replies), []

    def complete(self, texts):
        self.asked.append(texts)
        return [self.replies.pop(0) for _ in texts]


def test_a_scripted_judge_scores_each_group_and_leaves_an_unparsed_one_unscored(capsys):
    judge = JudgeReward(Scripted("answer 2: 0.9\nanswer 1: 0.2\nanswer 3: 0.5", "answer 1 is the best", None),
                        DEFAULT_TEMPLATE, max_group=3)
    prompts = ["p"] * 3 + ["q"] * 3 + ["r"]
    completions = ["a", "b", "c", "d", "e", "f", [{"role": "assistant", "content": "g"}]]
    values = judge(prompts=prompts, completions=completions)
    # group p scored as written; group q's reply is junk; group r's prompt did not fit (None from the backend)
    assert values == [0.2, 0.9, 0.5, None, None, None, None]
    assert len(judge.backend.asked) == 1 and len(judge.backend.asked[0]) == 3  # every group in one call
    assert judge.backend.asked[0][2] == judgment_text(DEFAULT_TEMPLATE, "r", ["g"])
    out = capsys.readouterr().out
    assert out.count("warning: reward.judge") == 1 and "is not 'answer K: SCORE'" in out  # once, the first reason


def test_scripted_judgments_through_the_rewarder_give_the_hand_worked_totals():
    """judge at weight 0.5 plus a term giving 1 to every sample:
    group p: 1 + 0.5 x (0.2, 0.9, 0.5) = 1.1, 1.45, 1.25; group q unparsed: the judge adds nothing, 1 each;
    reward/judge = mean over the scored samples (0.2 + 0.9 + 0.5) / 3 = 0.5333; 3 samples unparsed."""
    replies = ("answer 1: 0.2\nanswer 2: 0.9\nanswer 3: 0.5", "answer 1: 2\nanswer 2: 0\nanswer 3: 0")
    judge = JudgeReward(Scripted(*replies), DEFAULT_TEMPLATE, max_group=3)
    rewarder = Rewarder([RewardTerm("judge", judge, 0.5), RewardTerm("one", lambda completions, **_: [1.0] * 6, 1.0)])
    scores = rewarder(["p"] * 3 + ["q"] * 3, list("abcdef"), {})
    assert scores.total.tolist() == pytest.approx([1.1, 1.45, 1.25, 1.0, 1.0, 1.0])
    assert float(scores.parts["judge"].nanmean()) == pytest.approx(1.6 / 3)
    assert scores.errors == 0 and scores.unscored == 0
    assert judge_metrics(scores.parts) == {"reward/judge_unparsed": 3}
    assert judge_metrics({"one": torch.ones(2)}) == {}


class TooShort:
    """An engine whose tokenizer is the tiny model's and whose replies are scripted (for the context limit)."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.prompts = tokenizer, reply, []

    def generate(self, prompts, group_size, *, greedy=False, max_new_tokens=None, **_):
        self.prompts.append(prompts)
        return type("Out", (), {"completions": [self.reply] * len(prompts)})()


def test_a_local_judgment_longer_than_the_context_is_not_asked(tiny_tokenizer):
    engine = TooShort(tiny_tokenizer, "answer 1: 1")
    short = LocalJudge(engine, max_new_tokens=4)
    length = len(tiny_tokenizer(short.prompt_text(judgment_text(DEFAULT_TEMPLATE, "q", ["x"])),
                                add_special_tokens=False)["input_ids"])
    judge = JudgeReward(LocalJudge(engine, max_new_tokens=4, context=length + 4))  # fits exactly
    assert judge(prompts=["q", "a much longer question"], completions=["x", "x"]) == [1.0, None]
    assert len(engine.prompts[-1]) == 1  # only the one that fits was sent


# --------------------------------------------------------------------------- a scripted endpoint


class FakeEndpoint(ThreadingHTTPServer):
    """An OpenAI-compatible endpoint: /v1/models lists `models`; /v1/chat/completions answers `reply(text)`
    for the user message `text`, after answering the statuses of `fail_first` once each."""

    daemon_threads = True

    def __init__(self, reply, fail_first=(), models=("scripted",)):
        self.reply, self.fail_first, self.requests, self.models = reply, list(fail_first), [], models
        super().__init__(("127.0.0.1", 0), FakeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self):
        self.shutdown()
        self.server_close()


class FakeHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer(200, {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tests"}
                                                     for name in self.server.models]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((body, self.headers.get("Authorization")))
        if self.server.fail_first:
            return self.answer(self.server.fail_first.pop(0), {"error": {"message": "scripted failure"}})
        text = self.server.reply(body["messages"][0]["content"])
        self.answer(200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": text}}]})


def graded(text):
    """Answer k of n gets (k - 1) / (n - 1): 0, 1/3, 2/3, 1 for four answers (1 for a single answer)."""
    n = len(re.findall(r"^<answer \d+>$", text, re.M))
    return "\n".join(f"answer {k}: {(k - 1) / (n - 1) if n > 1 else 1}" for k in range(1, n + 1))


@pytest.mark.parametrize("client", ["openai", "urllib"])
def test_a_scripted_endpoint_judges_each_group_through_either_client(client, monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
    server = FakeEndpoint(graded)
    try:
        judge = JudgeReward(EndpointJudge(server.url, token="s3cret", max_new_tokens=32, client=client),
                            max_group=4)
        values = judge(prompts=["p"] * 4 + ["q"] * 2, completions=list("abcdef"))
        assert values == pytest.approx([0, 1 / 3, 2 / 3, 1, 0, 1])
        bodies = sorted((b for b, _ in server.requests), key=lambda b: len(b["messages"][0]["content"]))
        assert [b["model"] for b in bodies] == ["scripted"] * 2  # the first model the endpoint lists
        assert all(b["temperature"] == 0 and b["max_tokens"] == 32 for b in bodies)
        assert bodies[0]["messages"] == [{"role": "user", "content": judgment_text(DEFAULT_TEMPLATE, "q", ["e", "f"])}]
        assert {auth for _, auth in server.requests} == {"Bearer s3cret"}
    finally:
        server.stop()


@pytest.mark.parametrize("client", ["openai", "urllib"])
def test_an_endpoint_retries_a_503_and_fails_at_once_on_a_401(client):
    server = FakeEndpoint(graded, fail_first=[503])
    try:
        judge = EndpointJudge(server.url, model_name="named", client=client)
        assert judge.complete(["<answer 1>\nx\n</answer 1>"]) == ["answer 1: 1"]
        assert [b["model"] for b, _ in server.requests] == ["named"] * 2  # the 503, then the answer
        server.fail_first = [401]
        with pytest.raises(JudgeError, match=f"reward.judge endpoint {re.escape(server.url)}: HTTP 401"):
            judge.complete(["x"])
        assert len(server.requests) == 3  # not retried
    finally:
        server.stop()
    server = FakeEndpoint(graded, models=())
    try:
        with pytest.raises(JudgeError, match="its /models lists no model: set reward.judge.endpoint_model"):
            EndpointJudge(server.url, client=client).complete(["x"])
    finally:
        server.stop()


def test_the_judge_key_builds_an_endpoint_judge_and_checks_it_before_loading(tmp_path, capsys):
    server = FakeEndpoint(graded)
    try:
        rewards = make_plan(load_config(None, [f"reward.judge.model={server.url}", "reward.judge.weight=2",
                                               "reward.correctness=0", "rollout.group_size=2"])).rewards
        check_reward_sources(rewards, [])  # the judge alone is a reward source; its endpoint answers
        assert "reward.timeout_s=30 bounds each whole judge call" in capsys.readouterr().out
        rewarder = build_rewarder(rewards)
        assert {t.name: t.weight for t in rewarder.terms} == {"judge": 2.0}
        # groups of 2 (rollout.group_size): 2 x (0, 1)
        assert rewarder(["p"] * 4, list("abcd"), {}).total.tolist() == [0.0, 2.0, 0.0, 2.0]
    finally:
        server.stop()
    template = tmp_path / "rubric.txt"
    template.write_text("Grade {answers}")
    for setting, message in [(f"reward.judge.template={template}", "lacks {prompt}"),
                             (f"reward.judge.template={tmp_path / 'none.txt'}", "no such file"),
                             ("reward.judge.max_new_tokens=0", "max_new_tokens >= 1 (got 0)")]:
        rewards = make_plan(load_config(None, ["reward.judge.model=tiny", setting])).rewards
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_reward_sources(rewards, [])
    rewards = make_plan(load_config(None, [f"reward.judge.model={server.url}"])).rewards  # shut down: no answer
    with pytest.raises(JudgeError, match="no connection to 127.0.0.1"):
        check_reward_sources(rewards, [])


# --------------------------------------------------------------------------- covey's own policy server, the tiny model


def test_covey_serve_policy_as_the_judge_gives_unparsed_judgments_counted(tiny_model_dir, capsys):
    """The tiny random model's greedy judgment is no 'answer K: SCORE' list: every group unscored, counted."""
    from covey.models.load import load_policy
    from covey.rollout.fast import FastEngine
    from covey.serve import PolicyServer, ServerOptions, context_length
    model, tokenizer = load_policy(tiny_model_dir)
    engine = FastEngine(model.eval(), tokenizer, max_new_tokens=8, temperature=1.0)
    server = PolicyServer(engine, ServerOptions(temperature=1.0, max_new_tokens=8,
                                                context_length=context_length(model), batch_window_s=0.02))
    server.start()
    try:
        for client in ("openai", "urllib"):
            backend = EndpointJudge(server.url + "/v1", max_new_tokens=12, client=client)
            replies = backend.complete(["Is 2 + 2 = 4?", "Is 3 + 3 = 7?"])
            assert backend.name == "covey-policy" and all(isinstance(r, str) for r in replies)
            judge = JudgeReward(backend, max_group=2)
            rewarder = Rewarder([RewardTerm("judge", judge, 1.0)])
            scores = rewarder(["What is 2 + 3?"] * 2 + ["What is 4 + 4?"] * 2, ["5", "6", "8", "7"], {})
            assert bool(scores.parts["judge"].isnan().all()) and scores.unscored == 4 and scores.errors == 0
            assert judge_metrics(scores.parts) == {"reward/judge_unparsed": 4}
    finally:
        server.close()
    assert "warning: reward.judge: a judgment did not parse" in capsys.readouterr().out


# --------------------------------------------------------------------------- a local judge, by hand


class Recording:
    """Wraps a judge's engine and keeps the ids of every prompt it is given."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.seen = engine, engine.tokenizer, []

    def generate(self, prompts, group_size, **kwargs):
        self.seen += [list(p) for p in prompts]
        return self.engine.generate(prompts, group_size, **kwargs)


EXPECTED_PROMPT = """<|im_start|>user
You are grading 2 answers to the same task. Read the task and every answer, then score each answer from 0 to 1 \
by comparing the answers with each other: a correct, complete and clear answer scores near 1, a wrong, empty or \
off-topic one near 0; a better answer scores higher than a worse one, and answers of equal quality score the same.

Task:
What is 2 + 3?

<answer 1>
The answer is 5.
</answer 1>

<answer 2>
6
</answer 2>

Reply with exactly 2 lines and nothing else, one per answer, each of the form
answer K: SCORE
where K is the answer's number (1 to 2) and SCORE a number from 0 to 1.<|im_end|>
<|im_start|>assistant
"""


def test_a_local_tiny_judge_sees_exactly_the_hand_written_prompt(tiny_model_dir):
    local = LocalJudge.load(tiny_model_dir, "cpu", max_new_tokens=6)
    model = local.engine.model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert local.context == 1024  # the tiny model's max_position_embeddings
    local.engine = Recording(local.engine)
    judge = JudgeReward(local, DEFAULT_TEMPLATE, max_group=2)
    values = judge(prompts=["What is 2 + 3?"] * 2, completions=["The answer is 5.", [{"role": "assistant",
                                                                                     "content": "6"}]])
    assert values == [None, None]  # a random model's six greedy tokens are no judgment
    [ids] = local.engine.seen
    assert local.engine.tokenizer.decode(ids) == EXPECTED_PROMPT


# --------------------------------------------------------------------------- two steps of covey train


def test_two_training_steps_with_a_local_judge_count_its_unparsed_groups(tiny_model_dir, tmp_path, capsys):
    overrides = tiny_overrides(tiny_model_dir, tmp_path, **{"reward.judge.model": tiny_model_dir,
                                                            "reward.judge.max_new_tokens": 8})
    assert main(["train", *overrides]) == 0
    assert f"covey: judge {tiny_model_dir} (local, " in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    assert len(steps) == 2
    # 2 prompts x 4 samples a step, none judged (the random judge writes no scores); correctness alone scores
    assert all(r["reward/judge_unparsed"] == 8 and "reward/judge" not in r and r["reward/errors"] == 0
               for r in steps)


def test_two_training_steps_with_an_endpoint_judge_reward_its_scores(tiny_model_dir, tmp_path):
    """Answers k = 1..4 of each group get (k - 1) / 3 from the scripted endpoint: reward/judge = 0.5 each step,
    and with the judge alone (reward.correctness=0) reward/mean is 0.5 too."""
    server = FakeEndpoint(graded)
    try:
        overrides = tiny_overrides(tiny_model_dir, tmp_path, **{"reward.judge.model": server.url,
                                                                "reward.correctness": 0})
        assert main(["train", *overrides]) == 0
    finally:
        server.stop()
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    assert len(steps) == 2 and len(server.requests) == 4  # one judgment per group: 2 groups x 2 steps
    for r in steps:
        assert r["reward/judge"] == pytest.approx(0.5) and r["reward/mean"] == pytest.approx(0.5)
        assert r["reward/judge_unparsed"] == 0


def test_prompt_only_data_trains_on_the_judge_and_records_its_files_absolute(tmp_path, monkeypatch):
    from covey.tasks.data import load_run_data
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"Write a line about {i}."}) + "\n"
                                              for i in range(6)))
    (tmp_path / "judge").mkdir()
    (tmp_path / "rubric.txt").write_text("{prompt}\n{answers}")
    keys = ["task.name=file", "task.path=d.jsonl", "task.eval_size=2"]
    with pytest.raises(ConfigError, match="no other reward is set"):
        load_run_data(load_config(None, keys))
    settled, _ = load_run_data(load_config(None, [*keys, "reward.judge.model=judge",
                                                  "reward.judge.template=rubric.txt"]))
    assert (settled.eval.metric, settled.reward.correctness) == ("reward", 0.0)
    assert (settled.reward.judge.model, settled.reward.judge.template) == (str(tmp_path / "judge"),
                                                                           str(tmp_path / "rubric.txt"))
    url, _ = load_run_data(load_config(None, [*keys, "reward.judge.model=http://127.0.0.1:9/v1"]))
    assert url.reward.judge.model == "http://127.0.0.1:9/v1"  # a URL is left as it is
