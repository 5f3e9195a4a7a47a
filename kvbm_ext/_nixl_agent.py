"""This rank's NIXL agent for kvbm_ext.nixl: made with a progress thread that sleeps
between polls, thread-safe (the driver thread polls while the caller's posts), and its
memory registrations.  NIXL 1.5.1 (`nixl_cu13`), UCX backend.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

_make_lock = threading.Lock()
_registrations = itertools.count(1)


def nixl_errors() -> tuple[type[BaseException], ...]:
    """NIXL's exception classes (nixlRemoteDisconnectError, nixlBackendError, ...)."""
    import nixl_cu13._bindings as bindings

    return tuple(getattr(bindings, name) for name in dir(bindings)
                 if name.startswith("nixl") and name.endswith("Error"))


class _Bindings:
    """nixl_cu13's bindings module, but for the agent's configuration: its progress thread
    waits `delay_us` between polls."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._real, attribute)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def make_agent(name: str, progress_delay_us: int) -> Any:
    """A NIXL agent with the UCX backend, its calls serialized across threads (STRICT),
    and a progress thread that waits up to `progress_delay_us` between polls.

    nixl_cu13._api.nixl_agent sets the progress thread's delay to 0 (it spins, a good part
    of a core while idle) and offers no option: the agent is built while the module's
    bindings are a `_Bindings` that sets the delay on the configuration it is given."""
    import nixl_cu13._api as api

    config = api.nixl_agent_config(backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _make_lock:
        real = api.nixlBind
        api.nixlBind = _Bindings(real, progress_delay_us)
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind = real


@dataclasses.dataclass(eq=False)
class Registration:
    """A staging buffer registered with the agent: the tensor (kept alive while
    registered), its NIXL handle, where it is, and the partial metadata a peer loads to
    write into it (sent with READY)."""

    tensor: Any
    handle: Any
    address: int
    nbytes: int
    device_id: int
    memory: str
    id: int
    metadata: bytes


def register(agent: Any, tensor: Any) -> Registration:
    """Registers a contiguous tensor (device memory as VRAM, host memory as DRAM)."""
    memory = "VRAM" if tensor.is_cuda else "DRAM"
    device_id = tensor.device.index if tensor.is_cuda else 0
    address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    handle = agent.register_memory([(address, nbytes, device_id, "")], memory)
    metadata = agent.get_partial_agent_metadata(handle, inc_conn_info=False, backends=["UCX"])
    return Registration(tensor, handle, address, nbytes, device_id, memory, next(_registrations), metadata)
