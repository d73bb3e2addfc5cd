"""The worker thread of the host step and its queue: buckets whose gradients are on their way,
GradScaler unscales, and the `step()` (or discard) calls to finish, each acknowledged to the
caller that waits for it."""

from __future__ import annotations

import os
import queue
import threading
import warnings
from typing import Any

import torch

from torchoffload.optim._grads import _Unscale
from torchoffload.optim._host import Bucket
from torchoffload.optim._step import HostStep

# Note: [Host threads]
# The host step runs on its own thread, whose OpenMP team has `host_threads` threads (set with
# `torch.set_num_threads` on that thread: it changes that thread's setting and the default of
# threads started later, not the caller's). Leaving cores to backward's own host work was
# measured not to pay: on the H100 machine (16 cores, a Llama-3.2-3B shape, benchmarks/optim.py)
# a step took 1536 ms with all 16 threads and 1602 ms with 14; again with 12, with and
# without `step_ahead`: 1207 against 1307 ms, 1389 against 1443, run T13 in
# benchmarks/log/2026-11-27-clip-on-the-host.md. So the default keeps the process's setting.
# But `torchrun` sets OMP_NUM_THREADS=1 in each of several processes, and the host step then
# runs on one thread: FSDP2 on two H200s of a 32-core host stepped a Llama-3.2-3B shape's
# host step in 2567 ms a rank so, against 634 ms with 16 threads a rank
# (benchmarks/log/2026-11-27-fsdp2-offloaded-optimizer.md). So a process of one intra-op
# thread on a host of several cores is warned, unless ``host_threads`` says how many.

# Note: [The order of the host step]
# Backward finishes the last layers' buckets first, the next forward needs the first layers'
# first. The worker therefore steps, among the buckets it has, the one of the earliest
# parameters (the highest bucket index) first: when it lags behind backward, what is left when
# `step()` is called is the later layers', which the next forward needs last; after `step()`
# the rest goes in forward order. It picks only among buckets whose gradient copy has
# completed (else the oldest): the host launches backward well ahead of the device, so the
# newest bucket's copy completes only when the device gets there, and waiting on it would idle
# the worker for most of backward (picking the newest regardless, 3% of the host step ran
# during backward on two H100 machines, runs C and D in
# benchmarks/log/2026-11-23-optimizer-on-host.md; this rule is not measured yet). Among those,
# it first takes one copied aside ahead (Note: [Copies aside made ahead]): stepping it during
# backward costs no copy.


def warn_one_thread(host_threads: int | None) -> None:
    """Warn when the host step would run on one intra-op thread of a host of several cores
    (Note: [Host threads])."""
    cores = os.cpu_count() or 1
    if host_threads is None and torch.get_num_threads() == 1 and cores > 1:
        warnings.warn(
            f"OffloadedOptimizer: the host step would run on 1 intra-op thread while this host "
            f"has {cores} cores (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')!r}; torchrun "
            "sets 1 in each of several processes). Pass host_threads= the cores over the "
            "processes on this host, or host_threads=1 to keep one thread.",
            stacklevel=5,
        )


def completed(event: Any) -> bool:
    return event is None or event.query()


class HostWorker:
    """The thread that runs ``stepper`` on what the caller's threads queue. ``host_threads``:
    its intra-op threads (Note: [Host threads]); None keeps the process's setting."""

    def __init__(self, stepper: HostStep, buckets: list[Bucket], host_threads: int | None):
        warn_one_thread(host_threads)  # Note: [Host threads]
        self.stepper = stepper
        self.buckets = buckets
        self.host_threads = host_threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._finish_seq = 0  # finishes queued
        self._done_seq = 0  # finishes the worker completed
        # Copies aside made ahead while idle (Note: [Copies aside made ahead]): allowed until
        # the caller reads or loads the state, again after the next step; held while one runs
        self._prepare = threading.Lock()
        self._may_prepare = True
        self.prepare_error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="torchoffload-host-step",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    # - The caller's threads
    def send(self, bucket: Bucket, event: Any) -> None:
        """The bucket's gradients are on the host once ``event`` (None: now) completes."""
        self._queue.put(("bucket", bucket, event, bucket.gen))

    def unscale(self, job: _Unscale) -> None:
        """Run ``job`` after the buckets queued before it (Note: [Loss scaling])."""
        self._queue.put(("unscale", job))

    def finish(self, step_rest: bool, snapshot: list[dict[str, Any]]) -> None:
        """Finish the call: `HostStep.finish` once the buckets queued before it are in."""
        self._finish_seq += 1
        self._queue.put(("finish", step_rest, snapshot, self._finish_seq))

    def wait_done(self) -> BaseException | None:
        """Wait for the worker to complete the last finish queued. An interrupt (Ctrl-C) does
        not cut the handshake: the wait goes on, and the interrupt is returned to re-raise."""
        seq, interrupted = self._finish_seq, None
        while True:
            try:
                with self._done:
                    self._done.wait_for(lambda: self._done_seq >= seq)
                return interrupted
            except BaseException as exc:
                interrupted = interrupted or exc

    def idle(self) -> None:
        """The call is over and its buckets reset: copy aside ahead while nothing else comes
        (Note: [Copies aside made ahead])."""
        self._queue.put(("idle",))

    def pause_preparing(self) -> None:
        """No copy aside ahead from now until the next `step()` is done (the caller is about to
        read or replace the state), and none of those made is used; waits for one that is
        running."""
        with self._prepare:
            self._may_prepare = False
            for bucket in self.buckets:
                bucket.undo.forget()

    def _prepare_one(self) -> bool:
        with self._prepare:
            if not self._may_prepare:
                return False
            try:
                return self._prepare_next()
            except Exception as exc:  # an optimization only: `save` copies as before
                self.prepare_error = exc
                self._may_prepare = False
                return False

    def _prepare_next(self) -> bool:
        """Copy aside ahead one bucket likely to be stepped during the next backward (Note:
        [Copies aside made ahead]); whether there was one."""
        stepper = self.stepper
        if not stepper.steps_early():
            return False
        for index in stepper.hint:
            bucket = self.buckets[index]
            fresh = not (bucket.dispatched or bucket.stepped or bucket.pending)
            if fresh and not bucket.undo.prepared_for(bucket.steps):
                bucket.undo.prepare(bucket.optimizer, bucket.steps)
                stepper.prepared += 1
                return True
        return False

    def stop(self) -> None:
        self._queue.put(("stop",))
        self._thread.join()
        self.stepper.norms.close()

    # - The worker's thread
    def _work(self) -> None:
        if self.host_threads is not None:
            torch.set_num_threads(self.host_threads)
        stepper = self.stepper
        ready: dict[int, tuple[Bucket, Any]] = {}
        finish = None
        jobs: list[_Unscale] = []  # after the buckets queued before them, before a finish
        while True:
            items = []
            if not (ready or finish or jobs):
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    if self._prepare_one():  # idle: Note: [Copies aside made ahead]
                        continue
                    items.append(self._queue.get())
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item[0] == "stop":
                    return
                if item[0] == "bucket":
                    ready[item[1].index] = (item[1], item[2], item[3])
                elif item[0] == "unscale":
                    jobs.append(item[1])
                elif item[0] == "finish":
                    finish = item
            try:
                if ready:  # Note: [The order of the host step]
                    copied = [i for i, (_, e, _) in ready.items() if completed(e)]
                    cheap = [i for i in copied
                             if ready[i][0].undo.prepared_for(ready[i][0].steps)]  # fmt: skip
                    bucket, event, gen = ready.pop(max(cheap or copied) if copied else min(ready))
                    with stepper.lock:  # recalled before it was taken: Note: [A second
                        taken = bucket.taken = gen == bucket.gen  # backward]
                    if taken:
                        try:
                            stepper.arrive(bucket, event)
                        finally:
                            bucket.handled.set()
                    continue
                if jobs:
                    jobs.pop(0).run(stepper)
                    continue
                if finish is not None:
                    stepper.finish(finish[1], finish[2])
            except BaseException as exc:  # reported by step()
                stepper.errors.append((-1, exc))
            if finish is not None:
                seq = finish[3]
                if finish[1]:  # a step: copies ahead again
                    with self._prepare:
                        self._may_prepare = self.prepare_error is None
                finish = None
                for bucket in self.buckets:
                    bucket.done.set()
                with self._done:
                    self._done_seq = seq
                    self._done.notify_all()
