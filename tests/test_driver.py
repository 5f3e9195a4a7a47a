"""The background driver of host-driven transfers (kvbm_ext._driver): a job is stepped until
it is done, fails or passes its deadline, and its handle says so exactly once; a handle's
wait() is bounded; a forked child starts its own driver."""

import os
import subprocess
import sys
import threading
import time

import pytest

from kvbm_ext import _driver


class Steps:
    """A job done after `moves` MOVED steps and `waits` WAITING ones, or raising at step `fail_at`."""

    def __init__(self, moves=3, waits=0, fail_at=None, deadline=None):
        self.handle = _driver.Handle("test job", nbytes=moves)
        self.deadline = deadline
        self.moves, self.waits, self.fail_at = moves, waits, fail_at
        self.steps, self.abandoned = 0, []
        self.thread = None
        self.threads = []       # the thread of each step

    def step(self):
        self.thread = threading.current_thread()
        self.threads.append(self.thread)
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise ValueError(f"step {self.steps} failed")
        if self.waits:
            self.waits -= 1
            return _driver.WAITING
        if self.moves:
            self.moves -= 1
            return _driver.MOVED
        return _driver.DONE

    def abandon(self, error):
        self.abandoned.append(error)


def test_a_job_is_stepped_to_its_end_on_the_driver_thread():
    job = Steps(moves=5, waits=3)
    handle = _driver.submit(job)
    handle.wait(10)
    assert handle.done() and handle.error is None and handle.seconds >= 0
    assert job.steps == 9 and not job.abandoned
    assert job.thread is not threading.current_thread() and job.thread.daemon


def test_a_failing_step_finishes_the_handle_with_its_error():
    job = Steps(moves=10, fail_at=4)
    handle = _driver.submit(job)
    with pytest.raises(ValueError, match="step 4 failed"):
        handle.wait(10)
    assert isinstance(handle.error, ValueError) and len(job.abandoned) == 1 and job.steps == 4


def test_step_now_takes_the_first_step_on_the_callers_thread():
    job = Steps(moves=4, waits=2)
    handle = _driver.submit(job, step_now=True)
    handle.wait(10)
    assert handle.error is None and job.steps == 7 and not job.abandoned
    me = threading.current_thread()
    assert job.threads[0] is me and all(t is not me and t.daemon for t in job.threads[1:]), job.threads


@pytest.mark.parametrize("fail", [False, True])
def test_a_job_that_ends_in_its_first_step_never_reaches_the_driver(fail):
    """Done, or failed, on the caller's thread: its handle finished there, exactly once,
    and the driver never steps it."""
    job = Steps(moves=0, fail_at=1 if fail else None)
    handle = _driver.submit(job, step_now=True)
    assert handle.done(), "the handle of a job that ended in its first step is not finished"
    assert job.steps == 1 and job.threads == [threading.current_thread()]
    if fail:
        assert isinstance(handle.error, ValueError) and len(job.abandoned) == 1
    else:
        assert handle.error is None and not job.abandoned
    time.sleep(0.05)
    assert job.steps == 1, "the driver stepped a job that had ended"


def test_a_job_past_its_deadline_is_abandoned():
    job = Steps(waits=10**9, deadline=time.monotonic() + 0.2)
    started = time.monotonic()
    handle = _driver.submit(job)
    with pytest.raises(TimeoutError, match="not finished by its deadline"):
        handle.wait(10)
    assert 0.2 <= time.monotonic() - started < 5
    assert len(job.abandoned) == 1 and isinstance(job.abandoned[0], TimeoutError)


def test_wait_is_bounded_and_the_transfer_goes_on():
    release = threading.Event()

    class Gate(Steps):
        def step(self):
            return _driver.DONE if release.is_set() else _driver.WAITING

    handle = _driver.submit(Gate())
    with pytest.raises(TimeoutError, match="goes on"):
        handle.wait(0.05)
    assert not handle.done()
    release.set()
    handle.wait(10)
    assert handle.done() and handle.error is None


def test_many_jobs_at_once_each_finish_once():
    jobs = [Steps(moves=i % 7, waits=i % 3, fail_at=7 if i % 5 == 0 else None) for i in range(200)]
    handles = [_driver.submit(job) for job in jobs]
    for job, handle in zip(jobs, handles):
        assert handle._finished.wait(10)
        assert (handle.error is None) == (job.fail_at is None or job.steps < job.fail_at)
        assert len(job.abandoned) == (handle.error is not None)


def test_a_forked_child_runs_its_own_driver():
    code = ("import os, sys\n"
            "from kvbm_ext import _driver\n"
            "from test_driver import Steps\n"
            "_driver.submit(Steps()).wait(10)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    _driver.submit(Steps(moves=4)).wait(10)\n"
            "    os._exit(0)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print('child', status)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.stdout.strip() == "child 0", result.stdout + result.stderr
