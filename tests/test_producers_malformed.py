"""Malformed DLPack producers, built with ctypes (tests/support/dlpack_producers.py): a NULL shape
with dimensions to describe, NULL strides (compact, which is legal), an ndim past what any
array has (9, 2**31 - 1) or negative, unsupported element types and devices, a NULL data
pointer. Each is handed over through the C exchange API and through versioned and legacy
`__dlpack__` capsules, as a source chunk, a destination universal, a PagedKVCache layer
and a PagedKVCache destination.

A malformed description gets a ValueError or TypeError naming the argument, and no
destination byte is written; a legal one moves the right bytes. Every call runs in a
child interpreter (numpy and kvbm_ext only), so that a crash fails the case that caused
it instead of ending the run.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from support.dlpack_producers import CUDA, Description, compact, producers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NT, NH, HD = 4, 2, 8
POISON = 0xA5

# name: (Description keywords for an array, expected exception type, words of its message);
# None: a legal description
DESCRIPTIONS = {
    "null shape": (lambda a: dict(shape=None), ValueError, "dimensions but a NULL shape"),
    "null shape, ndim 1": (lambda a: dict(shape=None, ndim=1), ValueError, "1 dimensions but a NULL shape"),
    "ndim 9": (lambda a: dict(ndim=9), ValueError, "arrays of 9 dimensions are not supported"),
    "ndim 2**31 - 1": (lambda a: dict(ndim=2**31 - 1), ValueError, "arrays of 2147483647 dimensions"),
    "ndim -1": (lambda a: dict(ndim=-1), ValueError, "arrays of -1 dimensions"),
    "ndim -2**31": (lambda a: dict(ndim=-(2**31)), ValueError, "arrays of -2147483648 dimensions"),
    "two lanes": (lambda a: dict(dtype=(2, 16, 2)), TypeError, "2 lanes"),
    "zero bits": (lambda a: dict(dtype=(2, 0, 1)), TypeError, "0 bits"),
    "twelve bits": (lambda a: dict(dtype=(2, 12, 1)), TypeError, "12 bits"),
    "OpenCL device": (lambda a: dict(device=(4, 0)), ValueError, "OpenCL"),
    "device type 99": (lambda a: dict(device=(99, 0)), ValueError, "DLPack device type 99"),
    "null data": (lambda a: dict(data=0), ValueError, "NULL data pointer"),
    "negative extent": (lambda a: dict(shape=(-a.shape[0],) + a.shape[1:]), ValueError, "negative extent"),
    "null strides": (lambda a: dict(strides=None), None, None),
}
ROUTES = ["exchange", "versioned", "legacy"]
POSITIONS = ["chunk", "universal", "layer", "paged universal"]


def chunk_of(rng):
    return compact((NT, NH, HD), np.float16, rng)


def universal_like(rng, poisoned):
    u = compact((NH, 1, 1, NT, HD), np.float16, rng)
    if poisoned:
        u.view(np.uint8)[...] = POISON
    return u


def scenario(name, route, position):
    """Runs one case here; returns (outcome, destination intact or right, message)."""
    import kvbm_ext

    rng = np.random.default_rng(abs(hash((name, route, position))) % 2**32)
    keywords = DESCRIPTIONS[name][0]
    chunk = chunk_of(rng)
    want = chunk.transpose(1, 0, 2)  # universal [nh, 1, 1, nt, hd] of the chunk, NHD
    if position == "chunk":
        producer = producers(Description(chunk, **keywords(chunk)))[route]
        dst = universal_like(rng, poisoned=True)
        call, written = (lambda: kvbm_ext.block_to_universal([[producer]], [dst], "NHD")), dst
    elif position == "universal":
        dst = universal_like(rng, poisoned=True)
        producer = producers(Description(dst, **keywords(dst)))[route]
        call, written = (lambda: kvbm_ext.block_to_universal([[chunk]], [producer], "NHD")), dst
    elif position == "layer":
        layer = chunk.reshape(1, 1, NT, NH, HD)  # "kbthd": one block of K only
        producer = producers(Description(layer, **keywords(layer)))[route]
        dst = universal_like(rng, poisoned=True)
        call = lambda: kvbm_ext.PagedKVCache([producer], "kbthd").to_universal([0], [dst])  # noqa: E731
        written = dst
    else:
        cache = kvbm_ext.PagedKVCache([chunk.reshape(1, 1, NT, NH, HD)], "kbthd")
        dst = universal_like(rng, poisoned=True)
        producer = producers(Description(dst, **keywords(dst)))[route]
        call, written = (lambda: cache.to_universal([0], [producer])), dst
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is the outcome
        intact = bool((written.view(np.uint8) == POISON).all())
        return type(error).__name__, intact, str(error)
    return "ok", bool(np.array_equal(written[:, 0, 0].view(np.uint16), want.view(np.uint16))), ""


def run_in_child(name):
    """Every (route, position) of description `name`, in one child interpreter: {(route,
    position): (outcome, destination good, message)}.  A crash fails naming the case."""
    code = (f"import sys; sys.path[:0] = [{HERE!r}, {ROOT!r}]\n"
            "import test_producers_malformed as t\n"
            f"for route in t.ROUTES:\n"
            f"    for position in t.POSITIONS:\n"
            f"        print('CASE', route, position, sep='|', flush=True)\n"
            f"        print('OUTCOME', *t.scenario({name!r}, route, position), sep='|', flush=True)\n")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                            cwd=ROOT)
    lines = result.stdout.splitlines()
    started = [line.split("|")[1:] for line in lines if line.startswith("CASE|")]
    assert result.returncode == 0, (f"the child died (exit status {result.returncode}) on {name} through "
                                    f"{started[-1] if started else '?'}:\n{result.stderr[-3000:]}")
    outcomes = [line.split("|", 3)[1:] for line in lines if line.startswith("OUTCOME|")]
    assert len(outcomes) == len(started) == len(ROUTES) * len(POSITIONS), result.stdout[-2000:]
    return {tuple(case): (outcome, good == "True", message) for case, (outcome, good, message)
            in zip(started, outcomes)}


@pytest.mark.parametrize("name", DESCRIPTIONS)
def test_malformed_producer_is_a_clean_error(name):
    _, error, words = DESCRIPTIONS[name]
    arguments = {"chunk": "blocks[0][0]", "universal": "universals[0]", "layer": "layers[0]",
                 "paged universal": "universals[0]"}
    failures = []
    for (route, position), (outcome, good, message) in run_in_child(name).items():
        if error is None:
            ok = outcome == "ok" and good
        else:
            ok = (outcome == error.__name__ and words in message and message.startswith(arguments[position])
                  and good)
        if not ok:
            failures.append(f"{route} as {position}: {outcome} (destination {'kept' if good else 'WRITTEN/WRONG'})"
                            f" {message}")
    assert not failures, "\n".join(failures)


def test_null_strides_describe_a_strided_array_as_compact():
    """NULL strides mean compact row-major, whatever the array behind the pointer: a
    producer describing a transposed view's memory with NULL strides gets that memory read
    in row-major order."""
    import kvbm_ext

    rng = np.random.default_rng(7)
    base = compact((HD, NH, NT), np.float16, rng)  # memory order [hd, nh, nt]
    view = base.transpose(2, 1, 0)                  # [nt, nh, hd], strided
    dst = universal_like(rng, poisoned=True)
    producer = producers(Description(view, strides=None))["exchange"]
    kvbm_ext.block_to_universal([[producer]], [dst], "NHD")
    read_as = base.reshape(-1).reshape(NT, NH, HD)  # the same bytes, row-major
    assert np.array_equal(dst[:, 0, 0].view(np.uint16), read_as.transpose(1, 0, 2).view(np.uint16))
    assert not np.array_equal(read_as.view(np.uint16), view.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("route", ROUTES)
def test_gpu_malformed_device_producer_is_a_clean_error(route):
    """A producer claiming a CUDA array with a NULL shape or a huge ndim: refused before the
    device is touched (memory of a torch CUDA tensor, described by the stand-in)."""
    import torch

    import kvbm_ext

    t = torch.zeros(NT, NH, HD, dtype=torch.float16, device="cuda")
    dst = torch.full((NH, 1, 1, NT, HD), -1.0, dtype=torch.float16, device="cuda")
    host = np.zeros((NT, NH, HD), np.float16)  # shape and dtype only; the address is the tensor's
    for keywords, words in ((dict(shape=None), "NULL shape"), (dict(ndim=2**31 - 1), "2147483647 dimensions")):
        producer = producers(Description(host, data=t.data_ptr(), device=(CUDA, t.device.index), **keywords))[route]
        with pytest.raises(ValueError, match=r"^blocks\[0\]\[0\]") as info:
            kvbm_ext.block_to_universal([[producer]], [dst], "NHD")
        assert words in str(info.value)
        torch.cuda.synchronize()
        assert bool((dst == -1).all()), "a destination byte was written"
