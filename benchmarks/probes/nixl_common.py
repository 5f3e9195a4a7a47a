"""Shared helpers for the nixl_*.py probes (NIXL 1.5.1, module nixl_cu13).

Run any probe with PYTHONPATH=/work/nixl-site (nixl-cu13 installed --no-deps there).
Two-process probes: the parent ("A", initiator) hosts a torch.distributed.TCPStore and
starts the child ("B", target) with `python3 <probe> B <port> [args]`.
"""
import os
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nixl_cu13._api import nixl_agent, nixl_agent_config  # noqa: F401


def store_host(port=0):
    return dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True,
                         timeout=timedelta(seconds=60), wait_for_workers=False)


def store_client(port):
    return dist.TCPStore("127.0.0.1", int(port), world_size=None, is_master=False,
                         timeout=timedelta(seconds=60))


def spawn_child(script, port, *args, env=None):
    e = dict(os.environ)
    if env:
        e.update(env)
    return subprocess.Popen([sys.executable, script, "B", str(port), *map(str, args)], env=e)


class _BindShim:
    """nixl_cu13._api hard-codes agent_config.pthrDelay = 0 (progress thread polls with a
    0 ms timeout: ~0.35 core when idle, measured). This shim sets pthrDelay (us) just before
    the C++ agent is built; everything else forwards to the real bindings."""

    def __init__(self, real, delay_us):
        self._real, self._delay = real, delay_us

    def __getattr__(self, k):
        return getattr(self._real, k)

    def nixlAgent(self, name, cfg):
        cfg.pthrDelay = self._delay
        return self._real.nixlAgent(name, cfg)


def make_agent(name, pthr_delay_us=None, **cfg):
    """nixl_agent with UCX. Env PROBE_PROG=0 turns the UCX progress thread off (default on);
    env PROBE_PTHR_DELAY_US (or pthr_delay_us) sets the progress thread's poll timeout."""
    import nixl_cu13._api as api
    cfg.setdefault("backends", ["UCX"])
    cfg.setdefault("enable_prog_thread", os.environ.get("PROBE_PROG", "1") != "0")
    if pthr_delay_us is None and os.environ.get("PROBE_PTHR_DELAY_US"):
        pthr_delay_us = int(os.environ["PROBE_PTHR_DELAY_US"])
    real = api.nixlBind._real if isinstance(api.nixlBind, _BindShim) else api.nixlBind
    api.nixlBind = _BindShim(real, pthr_delay_us) if pthr_delay_us else real
    return nixl_agent(name, nixl_agent_config(**cfg))


def buf(nbytes, fill=None):
    """A CPU uint8 tensor (DRAM). Returns (tensor, addr)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if fill is not None:
        t.fill_(fill)
    return t, t.data_ptr()


def wait_done(agent, h, timeout=30.0):
    """Spin on check_xfer_state until DONE; returns (state, seconds)."""
    t0 = time.perf_counter()
    while True:
        s = agent.check_xfer_state(h)
        if s != "PROC":
            return s, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            return "TIMEOUT", time.perf_counter() - t0


def wait_notif(agent, peer, timeout=30.0):
    """Poll get_new_notifs until one arrives from peer; returns list of bytes (or None)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        n = agent.get_new_notifs()
        if peer in n and n[peer]:
            return n[peer]
    return None


def med_us(ts):
    return float(np.median(ts)) * 1e6
