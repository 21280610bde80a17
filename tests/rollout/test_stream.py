"""A stream of jobs through the slot loop (covey/rollout/stream.py, `Engine.serve_rows`): a job's rows are the
ones `generate` gives it alone, whether it ran alone or joined a busy decode (greedy and seeded), jobs join
without waiting for the running rows to end, the buffers widen for a job that does not fit, and a bad job or a
failing step fails its own jobs while the stream goes on."""

from __future__ import annotations

import pytest
import torch

from covey.models.load import load_policy
from covey.models.tiny import tiny_family_model, tiny_tokenizer
from covey.rollout.base import Engine, EngineWrapper, RowJob, RowSource
from covey.rollout.fast import FastEngine
from covey.rollout.stream import StreamDecoder, slack_of

EOS = range(40, 90)  # many stop tokens: sampled rows end at different steps


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


def engine(model, tok, slots=0, eos=True, temperature=0.9):
    e = FastEngine(model, tok, max_new_tokens=64, temperature=temperature, slots=slots)
    e.eos = sorted({tok.eos_token_id, *EOS}) if eos else []
    return e


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class Timeline(RowSource):
    """Gives the jobs of `arrivals` {take: [jobs]} from the take they are due at (at most `room` rows' worth, or
    one job), and records each job's answer with the take it came at."""

    def __init__(self, arrivals: dict[int, list[RowJob]], max_rows: int = 64):
        self.due = sorted((at, k, job) for at, jobs in arrivals.items() for k, job in enumerate(jobs))
        self.max_rows, self.takes = max_rows, 0
        self.taken, self.answers, self.errors, self.ended = {}, {}, {}, {}

    def take(self, room: int) -> list[RowJob]:
        jobs, rows = [], 0
        while self.due and self.due[0][0] <= self.takes and (not jobs or rows + self.due[0][2].n <= room):
            job = self.due.pop(0)[2]
            jobs.append(job)
            rows += job.n
            self.taken[id(job)] = self.takes
        self.takes += 1
        return jobs

    def finish(self, job, samples) -> None:
        self.answers[id(job)], self.ended[id(job)] = samples, self.takes

    def fail(self, job, error) -> None:
        self.errors[id(job)] = error


def alone(e, job: RowJob) -> list[tuple[list[int], list[float], bool]]:
    """The job's rows from `generate` (one prompt, n rows, per-prompt seed): ids, log-probs, truncated."""
    out = e.generate([job.prompt_ids], job.n, greedy=job.greedy, seeds=[job.seed], max_new_tokens=job.max_tokens)
    lengths = out.response_mask.sum(1).long().tolist()
    return [(out.response_ids[r, :n].tolist(), out.sample_logp[r, :n].tolist(), bool(out.truncated[r]))
            for r, n in enumerate(lengths)]


def assert_as_alone(e, source: Timeline, job: RowJob) -> None:
    assert id(job) not in source.errors, source.errors.get(id(job))
    samples = source.answers[id(job)]
    expected = alone(e, job)
    assert [s.ids for s in samples] == [x[0] for x in expected]
    for s, x in zip(samples, expected):
        assert s.logprobs == pytest.approx(x[1], abs=1e-4)
    assert [s.truncated for s in samples] == [x[2] for x in expected]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_job_alone_and_joining_a_busy_decode_gets_the_engines_rows(tiny, greedy):
    # the joining job's row g takes its k-th token from draw k of its own seed, whatever runs beside it
    model, tok = tiny
    e = engine(model, tok)
    target = RowJob(ids(tok, "What is 2 + 3?"), 3, 12, greedy, seed=5)
    solo = Timeline({0: [target]})
    e.serve_rows(solo)
    assert_as_alone(e, solo, target)
    busy = [RowJob(ids(tok, f"tell me about the number {k} and more"), 2, 30, k % 2 == 0, seed=k) for k in range(4)]
    joined = RowJob(list(target.prompt_ids), 3, 12, greedy, seed=5)
    crowd = Timeline({0: busy, 4: [joined]})
    e.serve_rows(crowd)
    assert crowd.taken[id(joined)] == 4
    assert [s.ids for s in crowd.answers[id(joined)]] == [s.ids for s in solo.answers[id(target)]]
    assert_as_alone(e, crowd, joined)
    for job in busy:
        assert_as_alone(e, crowd, job)


def test_a_job_joins_the_running_decode_without_waiting_for_its_rows_to_end(tiny):
    # no end-of-sequence: the busy rows run their 30 tokens; a 3-token job due at the 5th take starts there
    # and ends 3 takes later, while the busy rows still run, in the same stream (one decoder, no new prefill)
    model, tok = tiny
    e = engine(model, tok, eos=False)
    busy = [RowJob(ids(tok, "a long answer please"), 2, 30, True, seed=1)]
    late = RowJob(ids(tok, "short"), 1, 3, False, seed=2)
    source = Timeline({0: busy, 5: [late]})
    e.serve_rows(source)
    assert source.taken[id(late)] == 5
    # take k follows the k-th draw of the busy rows; the late job's first token is drawn at take 5 itself, its
    # 2nd and 3rd with the busy rows' 6th and 7th: it ends before take 7 (5 + 3 - 1), the busy rows before take 30
    assert source.ended[id(late)] == 7 and source.ended[id(busy[0])] == 30
    assert all(len(s.ids) == 30 and s.truncated for s in source.answers[id(busy[0])])
    assert_as_alone(e, source, late)
    assert_as_alone(e, source, busy[0])


def test_rows_wait_for_a_slot_under_the_limit(tiny):
    # 2 slots, 2 jobs of 3 rows: rows take the slots in turn as others end, the same tokens as alone
    model, tok = tiny
    e = engine(model, tok, slots=2)
    jobs = [RowJob(ids(tok, "hello there, how are you doing today"), 3, 10, False, seed=3),
            RowJob(ids(tok, "x"), 3, 7, True, seed=4)]
    source = Timeline({0: jobs[:1], 2: jobs[1:]})
    e.serve_rows(source)
    for job in jobs:
        assert_as_alone(e, source, job)


def test_a_wider_and_longer_job_widens_the_buffers(tiny):
    # the first job sizes the buffers: prompt + 4 + slack_of(4) = 64 columns beyond its prompt; the second,
    # 120 prompt tokens and 100 new ones, would overflow them: they grow to 120 + 100 + slack_of(100) = 284
    model, tok = tiny
    e = engine(model, tok, eos=False)
    first = RowJob(ids(tok, "x"), 1, 4, True, seed=0)
    wide = RowJob((ids(tok, "count the words of this sentence ") * 40)[:120], 1, 100, False, seed=9)
    source = Timeline({0: [first], 2: [wide]})
    decoder = StreamDecoder(e, source)
    with torch.inference_mode():
        decoder.serve(source.take(decoder.slots))
    assert slack_of(4) == 64 and slack_of(100) == 64 and slack_of(400) == 100
    assert decoder.capacity == 120 + 100 + 64
    assert_as_alone(e, source, wide)
    assert_as_alone(e, source, first)


def test_a_bad_job_fails_alone_and_the_others_are_served(tiny):
    model, tok = tiny
    e = engine(model, tok)
    good = RowJob(ids(tok, "What is 2 + 3?"), 2, 8, False, seed=7)
    outside = RowJob([5, 10**6, 9], 1, 8, True, seed=1)  # an id beyond the vocabulary: its prefill raises
    empty = RowJob([5, 6], 0, 8, True, seed=1)
    later = RowJob(ids(tok, "hello there"), 1, 6, True, seed=2)
    source = Timeline({0: [good, outside, empty], 2: [later]})
    e.serve_rows(source)
    assert isinstance(source.errors[id(outside)], IndexError)
    assert "a job needs a prompt, n >= 1 and max_tokens >= 1, not 2 ids, n=0" in str(source.errors[id(empty)])
    assert_as_alone(e, source, good)
    assert_as_alone(e, source, later)


def test_a_step_that_raises_fails_the_running_jobs_and_the_next_stream_goes_on(tiny, monkeypatch):
    model, tok = tiny
    e = engine(model, tok, eos=False)
    step, calls = e.step_logits, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a broken step")
        return step(*args)

    running, after = RowJob(ids(tok, "x"), 2, 10, True, seed=1), RowJob(ids(tok, "y"), 1, 4, False, seed=2)
    source = Timeline({0: [running], 4: [after]})
    monkeypatch.setattr(e, "step_logits", flaky)
    e.serve_rows(source)
    assert str(source.errors[id(running)]) == "a broken step"
    monkeypatch.undo()
    assert_as_alone(e, source, after)


def test_linear_attention_states_start_each_joining_row_from_its_prompt():
    # Qwen3.5's Gated DeltaNet layers: a new slot copies slot 0's states, then takes its prompt's
    tok = tiny_tokenizer()
    model = tiny_family_model("qwen3_5", len(tok)).eval()
    e = engine(model, tok)
    assert e.serves_rows
    jobs = [RowJob(ids(tok, "What is 2 + 3?"), 2, 10, True, seed=0), RowJob(ids(tok, "hi"), 2, 8, False, seed=1)]
    source = Timeline({0: jobs[:1], 3: jobs[1:]})
    e.serve_rows(source)
    for job in jobs:
        assert_as_alone(e, source, job)


class Plain(Engine):
    def generate(self, prompts, group_size, **kwargs):
        raise AssertionError("not called")

    def sync_weights(self, model) -> None:
        pass


def test_which_engines_serve_rows(tiny):
    # a sliding-window model takes no slot loop; a wrapper serves rows only where it samples as its engine
    from covey.rollout.precision import LowPrecisionEngine
    model, tok = tiny
    gemma = tiny_family_model("gemma3", len(tiny_tokenizer())).eval()
    assert not engine(gemma, tiny_tokenizer()).serves_rows
    assert engine(model, tok).serves_rows and not EngineWrapper(engine(model, tok)).serves_rows
    with pytest.raises(NotImplementedError, match="Plain cannot serve a stream of rows"):
        Plain().serve_rows(Timeline({}))
    low = LowPrecisionEngine(FastEngine, model, tok, torch.bfloat16, max_new_tokens=8)
    assert low.serves_rows
    low.release_weights()  # a released copy is refilled before the stream
    job = RowJob(ids(tok, "What is 2 + 3?"), 1, 6, True, seed=0)
    source = Timeline({0: [job]})
    low.serve_rows(source)
    expected = low.generate([job.prompt_ids], 1, greedy=True, max_new_tokens=6)
    assert source.answers[id(job)][0].ids == expected.response_ids[0][expected.response_mask[0].bool()].tolist()
