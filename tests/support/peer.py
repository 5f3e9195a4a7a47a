"""A serving process of kvbm_ext.peer for the peer tier's tests (tests/test_peer.py,
tests/test_vllm_offload.py): `python -m kvbm_ext.peer` started apart, meeting its clients
at a TCPStore this process hosts, over UCX's TCP transport (no RDMA here), which can be
stopped, killed and started again.  Where a GPU is present NIXL's UCX backend refuses a
UCX_TLS without a CUDA transport, so cuda_copy comes with tcp there."""

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from support import REPO_ROOT

# NIXL's Python logger prints INFO lines on stdout when an agent is made.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None,
                                reason="NIXL is not installed: pip install \"kvbm_ext[nixl]\" (nixl-cu13)")
UCX_ENV = {"UCX_TLS": "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"}
START_TIMEOUT = 60


def store_here():
    """A TCPStore hosted by the test process on a free port."""
    from kvbm_ext.peer import open_store

    return open_store("127.0.0.1:0", master=True)


class Server:
    """`python -m kvbm_ext.peer --name NAME --bytes NBYTES` against `store`, started at once."""

    def __init__(self, store, name="mem", nbytes="64M"):
        self.store, self.name, self.nbytes = store, name, nbytes
        self.address = f"127.0.0.1:{store.port}"
        self.proc = None
        self.start()

    @property
    def key(self):
        return f"kvbm_ext/peer/{self.name}"

    def record(self):
        return bytes(self.store.get(self.key)) if self.store.check([self.key]) else b""

    def start(self):
        before = self.record()
        env = dict(os.environ, **UCX_ENV, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbm_ext.peer", "--name", self.name, "--bytes",
                                      self.nbytes, "--store", self.address], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + START_TIMEOUT
        while self.record() in (before, b""):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the peer {self.name!r} did not publish its memory:\n{self.proc.stdout.read()}")
            time.sleep(0.02)

    def stop(self):
        """SIGSTOP: alive, but answering nothing."""
        self.proc.send_signal(signal.SIGSTOP)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
