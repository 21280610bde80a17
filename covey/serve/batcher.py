"""The engine's one thread: requests gathered into the engine's decode, joining it as it runs where it can.

Request threads submit `Job`s (one prompt's ids, n, max_tokens, greedy, seed) and wait on their futures.
The engine's thread takes the first job waiting and whatever arrives within `window_s`, then:

- an engine that `serves_rows` (the fast engine's slot loop, covey/rollout/stream.py) gets the batcher as its
  `RowSource`: those jobs start at once, and a job that arrives while the engine decodes joins the running
  decode as slots free up (each row keeps its own max_tokens as its budget; greedy and sampled rows, and
  different n, share one decode), at most `max_rows` rows at a time;
- another engine gets `engine.generate` calls: the jobs grouped by their sampling settings (greedy, n: one
  call samples one way), at most `max_rows` rows a call; jobs that arrive meanwhile wait for the next call.

Each job carries its own seed, so its samples depend on its seed only, not on the jobs beside it
(`Engine.generate`'s per-prompt seeds; a stream's rows draw from their job's seed alike). A job that fails
fails alone: a stream encodes a failing group again job by job; a call that raises is retried job by job
(its future gets the exception; the thread keeps serving).

The engine is only ever called from this thread; `between_batches(fn)` runs `fn` there between two calls or
two streams (a training run swapping in new weights: `engine.sync_weights`): the running stream takes no new
job, its rows end, `fn` runs, and the jobs that waited start the next stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from covey.batch import Rollout
from covey.rollout.base import Engine, RowJob, RowSource, Sample


@dataclass(eq=False)
class Job(RowJob):
    """One request's prompt for the engine; `future` gets its n Samples."""

    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        return self.greedy, self.n


@dataclass(eq=False)
class Task:
    """A function to run on the engine's thread between two calls."""

    fn: Callable[[], object]
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    requests: int = 0
    """Jobs answered (or failed)."""
    engine_calls: int = 0
    """engine.generate calls made (retries of a failed group included), or streams served (`serve_rows` calls)."""
    rows: int = 0
    """Rows sampled."""
    largest_batch: int = 0
    """Most prompts in one call (a stream: most jobs taken and not yet answered at once)."""


def samples_of(rollout: Rollout, rows: range) -> list[Sample]:
    """Rows of a Rollout as Samples: the response ids under `response_mask`, their sampler log-probs."""
    out = []
    for row in rows:
        length = int(rollout.response_mask[row].sum())
        logps = rollout.sample_logp
        out.append(Sample(rollout.response_ids[row, :length].tolist(),
                          None if logps is None else logps[row, :length].tolist(), bool(rollout.truncated[row])))
    return out


class Batcher(RowSource):
    """The engine's thread and its queue (see the module docstring); the `RowSource` of a stream."""

    STOP = object()

    def __init__(self, engine: Engine, window_s: float = 0.005, max_rows: int = 256):
        self.engine, self.window_s, self.max_rows = engine, window_s, max_rows
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: deque = deque()  # taken off the queue, not yet handled (the engine's thread only)
        self.running: set[Job] = set()  # jobs a stream took and has not answered
        self.stats = BatchStats()
        self.closed = False
        self.thread = threading.Thread(target=self.loop, name="covey-policy-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        if self.closed:
            raise RuntimeError("the policy server is closed")
        self.queue.put(job)
        return job.future

    def between_batches(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run `fn()` on the engine's thread between two engine calls (or streams); its result (or its exception)."""
        task = Task(fn)
        if self.closed:
            raise RuntimeError("the policy server is closed")
        self.queue.put(task)
        return task.future.result(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self.queue.put(self.STOP)
        self.thread.join(timeout_s)

    def next_item(self, block: bool, timeout_s: float | None = None):
        """The next item taken off the queue (first what was put back); None where none comes in time."""
        if self.pending:
            return self.pending.popleft()
        try:
            return self.queue.get(timeout=timeout_s) if block else self.queue.get_nowait()
        except queue.Empty:
            return None

    def loop(self) -> None:
        while True:
            item = self.next_item(block=True)
            if item is self.STOP:
                self.closed = True
                break
            if isinstance(item, Task):
                try:
                    item.future.set_result(item.fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    item.future.set_exception(e)
                continue
            jobs = self.gather(item)
            if self.engine.serves_rows:
                self.pending.extendleft(reversed(jobs))
                self.stream()
            else:
                self.run(jobs)
        while True:  # what came after STOP is refused, not left waiting
            item = self.next_item(block=False)
            if item is None:
                return
            if item is not self.STOP:
                item.future.set_exception(RuntimeError("the policy server is closed"))

    def gather(self, first: Job) -> list[Job]:
        """`first` and the jobs that arrive within the window after it (all that queued meanwhile included);
        stops early at a task or at STOP, put back to run after these jobs."""
        jobs, deadline = [first], time.monotonic() + self.window_s
        while len(jobs) < self.max_rows:
            remaining = deadline - time.monotonic()
            item = self.next_item(block=remaining > 0, timeout_s=max(remaining, 0.0))
            if item is None:
                break
            if not isinstance(item, Job):
                self.pending.appendleft(item)
                break
            jobs.append(item)
        return jobs

    # ----------------------------------------------------------------------- a stream (Engine.serve_rows)

    def stream(self) -> None:
        """One `engine.serve_rows` over the jobs waiting and those that come while it decodes; a job it leaves
        unanswered (an engine that raised) fails, and the thread goes on."""
        self.stats.engine_calls += 1
        error: BaseException = RuntimeError("the engine returned without answering the request")
        try:
            self.engine.serve_rows(self)
        except BaseException as e:  # noqa: BLE001 - the engine's fault fails its jobs, not the server
            error = e
        for job in list(self.running):
            self.fail(job, error)

    def take(self, room: int) -> list[Job]:
        """`RowSource.take`: the jobs waiting, at most `room` rows' worth (or one job, whatever its n); none once
        a task or STOP is next (the stream drains: it runs after the running rows end)."""
        jobs, rows = [], 0
        while rows < room:
            item = self.next_item(block=False)
            if item is None:
                break
            if not isinstance(item, Job) or (jobs and rows + item.n > room):
                self.pending.appendleft(item)
                break
            jobs.append(item)
            rows += item.n
        self.running.update(jobs)
        self.stats.largest_batch = max(self.stats.largest_batch, len(self.running))
        return jobs

    def finish(self, job: Job, samples: list[Sample]) -> None:
        self.running.discard(job)
        self.stats.requests += 1
        self.stats.rows += len(samples)
        job.future.set_result(samples)

    def fail(self, job: Job, error: BaseException) -> None:
        self.running.discard(job)
        self.stats.requests += 1
        job.future.set_exception(error)

    # ----------------------------------------------------------------------- calls (Engine.generate)

    def run(self, jobs: list[Job]) -> None:
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.key, []).append(job)
        for group in groups.values():
            size = max(1, self.max_rows // group[0].n)
            for start in range(0, len(group), size):
                self.generate(group[start:start + size])

    def generate(self, jobs: list[Job]) -> None:
        """One engine call for jobs of one key; on an exception, each job alone (the culprit fails alone)."""
        first = jobs[0]
        self.stats.engine_calls += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(jobs))
        try:
            rollout = self.engine.generate([j.prompt_ids for j in jobs], first.n, greedy=first.greedy,
                                           max_new_tokens=max(j.max_tokens for j in jobs), seeds=[j.seed for j in jobs],
                                           budgets=[j.max_tokens for j in jobs for _ in range(first.n)])
            answers = [samples_of(rollout, range(i * first.n, (i + 1) * first.n)) for i in range(len(jobs))]
        except BaseException as e:  # noqa: BLE001 - one request's fault must not stop the engine's thread
            if len(jobs) > 1:
                for job in jobs:
                    self.generate([job])
                return
            self.stats.requests += 1
            first.future.set_exception(e)
            return
        self.stats.requests += len(jobs)
        self.stats.rows += len(jobs) * first.n
        for job, samples in zip(jobs, answers):
            job.future.set_result(samples)
