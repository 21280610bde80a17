"""The policy server's engine thread on an engine that serves rows (covey/serve/batcher.py over
covey/rollout/stream.py): a request that arrives while the engine decodes joins that decode and ends before the
rows it joined, `between_batches` runs once the running rows have ended, and a failing request or engine fails
its own jobs while the thread keeps serving."""

from __future__ import annotations

import threading

import pytest

from covey.rollout.base import EngineWrapper, RowSource
from covey.rollout.fast import FastEngine
from covey.serve.batcher import Batcher, Job, Task

WAIT_S = 60


class Paused(RowSource):
    """The batcher as a stream's source, but its `at`-th take waits for `gate` (a test queues work meanwhile)."""

    def __init__(self, inner: RowSource, at: int, reached: threading.Event, gate: threading.Event):
        self.inner, self.at, self.reached, self.gate, self.takes = inner, at, reached, gate, 0
        self.max_rows = inner.max_rows

    def take(self, room: int):
        self.takes += 1
        if self.takes == self.at:
            self.reached.set()
            assert self.gate.wait(WAIT_S)
        return self.inner.take(room)

    def finish(self, job, samples) -> None:
        self.inner.finish(job, samples)

    def fail(self, job, error) -> None:
        self.inner.fail(job, error)


class Gated(EngineWrapper):
    """The fast engine, its first stream paused at its 4th take (after the first rows' 3rd token)."""

    serves_rows = True

    def __init__(self, inner):
        super().__init__(inner)
        self.reached, self.gate, self.streams = threading.Event(), threading.Event(), 0

    def serve_rows(self, source: RowSource) -> None:
        self.streams += 1
        self.inner.serve_rows(Paused(source, 4, self.reached, self.gate) if self.streams == 1 else source)


@pytest.fixture
def gated(policy):
    model, tokenizer = policy
    engine = FastEngine(model, tokenizer, max_new_tokens=32, temperature=1.0)
    engine.eos = []  # every row runs to its budget
    gated = Gated(engine)
    batcher = Batcher(gated, window_s=0.0)
    yield gated, batcher, tokenizer
    gated.gate.set()
    batcher.close()


def prompt(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def on_end(order: list[Job], job: Job) -> Job:
    """`job`, appended to `order` when its future completes (lists append atomically)."""
    job.future.add_done_callback(lambda _: order.append(job))
    return job


def test_a_request_arriving_mid_decode_joins_it_and_ends_first(gated):
    engine, batcher, tok = gated
    order: list[Job] = []
    long = on_end(order, Job(prompt(tok, "a long answer please"), 2, 24, True, 1))
    batcher.submit(long)
    assert engine.reached.wait(WAIT_S)  # the long rows have drawn 3 of their 24 tokens
    short = on_end(order, Job(prompt(tok, "short"), 1, 3, False, 2))
    batcher.submit(short)
    engine.gate.set()
    samples = short.future.result(WAIT_S)
    assert [len(s.ids) for s in long.future.result(WAIT_S)] == [24, 24]
    assert order == [short, long] and batcher.stats.engine_calls == 1 == engine.streams
    alone = engine.inner.generate([short.prompt_ids], 1, seeds=[2], max_new_tokens=3)
    assert samples[0].ids == alone.response_ids[0].tolist()
    assert samples[0].logprobs == pytest.approx(alone.sample_logp[0].tolist(), abs=1e-4)


def test_a_task_runs_once_the_running_rows_end_and_the_jobs_after_it_wait(gated):
    engine, batcher, tok = gated
    first = Job(prompt(tok, "first"), 1, 12, True, 1)
    batcher.submit(first)
    assert engine.reached.wait(WAIT_S)
    after = Job(prompt(tok, "after"), 1, 4, True, 2)
    seen = []
    task = Task(lambda: seen.append((first.future.done(), after.future.done())) or "swapped")
    batcher.queue.put(task)  # queued before `after`: the stream takes nothing more and drains
    batcher.submit(after)
    engine.gate.set()
    assert task.future.result(WAIT_S) == "swapped" and seen == [(True, False)]
    assert len(after.future.result(WAIT_S)[0].ids) == 4
    assert batcher.stats.engine_calls == 2 == engine.streams  # `after` ran in a stream of its own


def test_a_bad_request_fails_alone_and_the_thread_keeps_serving(policy):
    model, tok = policy
    batcher = Batcher(FastEngine(model, tok, max_new_tokens=8), window_s=0.05)
    try:
        jobs = [Job(prompt(tok, "good"), 1, 5, True, 1), Job([5, 10**6], 1, 5, True, 2),
                Job(prompt(tok, "also good"), 2, 5, False, 3)]
        for job in jobs:
            batcher.submit(job)
        with pytest.raises(IndexError):
            jobs[1].future.result(WAIT_S)
        assert [len(s) for s in (jobs[0].future.result(WAIT_S), jobs[2].future.result(WAIT_S))] == [1, 2]
        assert len(batcher.submit(Job(prompt(tok, "later"), 1, 3, True, 4)).result(WAIT_S)) == 1
    finally:
        batcher.close()


class Broken(EngineWrapper):
    """Takes the waiting jobs and raises, once; then serves as the fast engine."""

    serves_rows = True
    broken = True

    def serve_rows(self, source: RowSource) -> None:
        if self.broken:
            self.broken = False
            source.take(source.max_rows)
            raise RuntimeError("the engine broke")
        self.inner.serve_rows(source)


def test_an_engine_that_raises_fails_the_jobs_it_took_and_the_next_are_served(policy):
    model, tok = policy
    batcher = Batcher(Broken(FastEngine(model, tok, max_new_tokens=8)), window_s=0.0)
    try:
        with pytest.raises(RuntimeError, match="the engine broke"):
            batcher.submit(Job(prompt(tok, "first"), 1, 3, True, 1)).result(WAIT_S)
        assert len(batcher.submit(Job(prompt(tok, "next"), 1, 3, True, 2)).result(WAIT_S)[0].ids) == 3
        assert batcher.stats.requests == 2 and not batcher.running
    finally:
        batcher.close()


def test_the_served_fast_engine_streams(served):
    assert served[1].serves_rows
