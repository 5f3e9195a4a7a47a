"""Transfers that complete in the background: the `Handle` a caller polls or waits on, and
the driver, one daemon thread per process that advances every pending job.

A job is a transfer whose far side is driven from the host (a NIXL transfer to a peer, a
file write or read): each of its steps waits for something only the host can see (a CUDA
event, a transfer's state, a notification), so something must look again later.  The
caller's call enqueues the GPU work, submits the job and returns; the driver calls
`job.step()` until the job says it is finished, raises, or passes its deadline, and then
finishes its handle.  One thread serves every job of the process: engines' agents and
I/O engines (NIXL's progress thread, its POSIX backend's queues) carry the bytes; the
driver only posts and polls.

Import cost: nothing but the standard library.  torch is imported by a handle's
`wait_stream` alone.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

# What a job's step() returns.
DONE = "done"          # finished: its handle is finished successfully
MOVED = "moved"        # did something (posted, completed a piece): step again at once
WAITING = "waiting"    # nothing it waits for happened yet

# When no job moved, the driver yields the GIL for a few rounds (a piece's event or
# transfer usually completes within them), then sleeps longer each round, up to a
# millisecond, so that a long wait costs the caller's threads little.
SPIN_ROUNDS = 64
SLEEP_MIN_S = 20e-6
SLEEP_MAX_S = 1e-3


class Handle:
    """A transfer completing in the background.

    `done()` says whether it finished (successfully or not) and never raises; `wait(timeout)`
    blocks until it finished and raises its error, or TimeoutError when `timeout` seconds pass
    first (the transfer goes on); `error` is the exception it failed with, or None; `nbytes`
    the bytes it moved and `seconds` the time from submission to its end (None before).
    `wait_stream(stream)` makes a CUDA stream wait for the transfer's GPU side (blocks the
    host only until that side is enqueued; raises the transfer's error if it failed first)."""

    def __init__(self, what: str, nbytes: int = 0) -> None:
        self.what = what
        self.nbytes = nbytes
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._started = time.monotonic()
        self._finished = threading.Event()
        self._gpu_done: Any = None          # a torch.cuda.Event after the transfer's last GPU work
        self._gpu_enqueued = threading.Event()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else "failed" if self.error is not None else "done"
        return f"<kvbm_ext transfer {self.what}: {state}, {self.nbytes} bytes>"

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.what}: not finished within {timeout} s (it goes on; wait again, or "
                               "poll done())")
        if self.error is not None:
            raise self.error

    def wait_stream(self, stream: Any = None, timeout: float | None = None) -> None:
        """The stream (None: torch's current one) waits for the transfer's GPU work."""
        if not self._gpu_enqueued.wait(timeout):
            raise TimeoutError(f"{self.what}: its GPU work was not enqueued within {timeout} s")
        if self.error is not None:
            raise self.error
        if self._gpu_done is not None:
            import torch

            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self._gpu_done)

    # ------------------------------------------------------------ for jobs

    def gpu_enqueued(self, event: Any = None) -> None:
        """The job's last GPU work is enqueued; `event` (recorded after it) is what a
        stream waits for (None: the transfer has no GPU side)."""
        self._gpu_done = event
        self._gpu_enqueued.set()

    def finish(self, error: BaseException | None = None) -> None:
        if self._finished.is_set():
            return
        self.error = error
        self.seconds = time.monotonic() - self._started
        self._gpu_enqueued.set()
        self._finished.set()


class Job(Protocol):
    """What the driver advances: `handle`, `deadline` (time.monotonic() seconds, or None),
    `step()` (advances without blocking and returns DONE, MOVED or WAITING; raises to fail)
    and `abandon(error)` (releases what the job holds after a failure or its deadline; must
    not raise)."""

    handle: Handle
    deadline: float | None

    def step(self) -> str: ...
    def abandon(self, error: BaseException) -> None: ...


class _Driver:
    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvbm_ext-driver", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Handle:
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()
        return job.handle

    def _run(self) -> None:
        idle = 0
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                jobs = list(self._jobs)
            moved = False
            for job in jobs:
                state = _advance(job)
                moved = moved or state != WAITING
                if state == DONE:
                    with self._wake:
                        self._jobs.remove(job)
            idle = 0 if moved else min(idle + 1, SPIN_ROUNDS + 8)
            if idle:
                time.sleep(0 if idle <= SPIN_ROUNDS else min(SLEEP_MIN_S * 2 ** (idle - SPIN_ROUNDS), SLEEP_MAX_S))


def _advance(job: Job) -> str:
    """One step of `job`: DONE once it ended (its handle finished, successfully or not, and
    after a failure or its deadline abandoned), else what its step said."""
    state: str = WAITING
    error: BaseException | None = None
    try:
        state = job.step()
        if state == WAITING and job.deadline is not None and time.monotonic() > job.deadline:
            error = TimeoutError(f"{job.handle.what}: not finished by its deadline")
    except BaseException as failure:  # noqa: BLE001 - every failure finishes the handle
        error = failure
    if error is not None:
        try:
            job.abandon(error)
        finally:
            job.handle.finish(error)
        return DONE
    if state == DONE:
        job.handle.finish()
    return state


_driver: _Driver | None = None
_lock = threading.Lock()


def submit(job: Job, step_now: bool = False) -> Handle:
    """Hands `job` to the process's driver (started on first use) and returns its handle.

    `step_now`: the job's first step runs on the caller's thread first.  A first step that
    can act at once (a message to send, a piece to post) then does not wait for the driver
    thread to wake and take the GIL, which the caller holds until it blocks."""
    if step_now and _advance(job) == DONE:
        return job.handle
    global _driver
    with _lock:
        if _driver is None:
            _driver = _Driver()
        driver = _driver
    return driver.submit(job)


def _forget_after_fork() -> None:
    # A forked child has no driver thread: it starts its own when it first submits.
    global _driver, _lock
    _driver, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
