"""The engine's one thread: requests gathered into batched `engine.generate` calls.

Request threads submit `Job`s (one prompt's ids, n, max_tokens, greedy, seed) and wait on their futures.
The engine's thread takes the first job waiting, then whatever arrives within `window_s` and whatever
queued while the engine was busy, groups them by their sampling settings (greedy, n: one engine call
samples one way; each row keeps its own max_tokens as its budget) and calls `engine.generate` once per group
of at most `max_rows` rows.
Each job carries its own seed, so its samples depend on its seed only, not on the batch it joined
(`Engine.generate`'s per-prompt seeds). A group whose call raises is retried job by job, so that one bad
request fails alone (its future gets the exception; the thread keeps serving).

The engine is only ever called from this thread; `between_batches(fn)` runs `fn` there between two calls
(a training run swapping in new weights: `engine.sync_weights`).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from covey.batch import Rollout
from covey.rollout.base import Engine


@dataclass
class Sample:
    """One sampled completion: its ids (up to and including the end-of-sequence token), the sampler's log-prob
    of each (None where the engine returned none), and whether it ran out of tokens before ending."""

    ids: list[int]
    logprobs: list[float] | None
    truncated: bool


@dataclass(eq=False)
class Job:
    """One request's prompt for the engine; `future` gets its n Samples."""

    prompt_ids: list[int]
    n: int
    max_tokens: int
    greedy: bool
    seed: int
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
    """engine.generate calls made (retries of a failed group included)."""
    rows: int = 0
    """Rows sampled."""
    largest_batch: int = 0
    """Most prompts in one call."""


def samples_of(rollout: Rollout, rows: range) -> list[Sample]:
    """Rows of a Rollout as Samples: the response ids under `response_mask`, their sampler log-probs."""
    out = []
    for row in rows:
        length = int(rollout.response_mask[row].sum())
        logps = rollout.sample_logp
        out.append(Sample(rollout.response_ids[row, :length].tolist(),
                          None if logps is None else logps[row, :length].tolist(), bool(rollout.truncated[row])))
    return out


class Batcher:
    """The engine's thread and its queue (see the module docstring)."""

    STOP = object()

    def __init__(self, engine: Engine, window_s: float = 0.005, max_rows: int = 256):
        self.engine, self.window_s, self.max_rows = engine, window_s, max_rows
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
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
        """Run `fn()` on the engine's thread between two engine calls; its result (or its exception)."""
        task = Task(fn)
        if self.closed:
            raise RuntimeError("the policy server is closed")
        self.queue.put(task)
        return task.future.result(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self.queue.put(self.STOP)
        self.thread.join(timeout_s)

    def loop(self) -> None:
        while True:
            jobs, stop, tasks = self.gather(self.queue.get())
            self.run(jobs)
            for task in tasks:
                try:
                    task.future.set_result(task.fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    task.future.set_exception(e)
            if stop:
                self.closed = True
                break
        while True:  # what came after STOP is refused, not left waiting
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not self.STOP:
                item.future.set_exception(RuntimeError("the policy server is closed"))

    def gather(self, first) -> tuple[list[Job], bool, list[Task]]:
        """The jobs that arrive within the window after `first` (all that queued meanwhile included); stops
        early at a task or at STOP, which run after these jobs."""
        jobs, tasks, item = [], [], first
        deadline = time.monotonic() + self.window_s
        while True:
            if item is self.STOP:
                return jobs, True, tasks
            if isinstance(item, Task):
                tasks.append(item)
                return jobs, False, tasks
            jobs.append(item)
            if len(jobs) >= self.max_rows:
                return jobs, False, tasks
            remaining = deadline - time.monotonic()
            try:
                item = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                return jobs, False, tasks

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
