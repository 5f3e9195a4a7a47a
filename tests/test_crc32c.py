"""kvbm_ext.crc32c: the CRC-32C of host bytes, against a bit-by-bit reference written here,
for every length around the three-chain stretch, every producer of host arrays, chained
calls and threads; refusals name the argument."""

import threading
import zlib

import numpy as np
import pytest
import torch

import kvbm_ext
from support.producers import ArrayInterfaceOnly, DLPackOnly

POLY = 0x82F63B78


def reference(data, crc=0):
    crc ^= 0xFFFFFFFF
    for byte in bytes(data):
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ POLY if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_the_check_value_of_the_standard():
    assert kvbm_ext.crc32c(b"123456789") == 0xE3069283
    assert kvbm_ext.crc32c(b"") == 0
    assert kvbm_ext.crc32c(bytes(32)) == 0x8A9136AA        # RFC 3720, 32 bytes of zeros


@pytest.mark.parametrize("size", [1, 7, 8, 9, 4095, 4096, 12287, 12288, 12289, 3 * 4096 * 2 + 13, 40000])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_every_length_and_alignment(size, offset, gen):
    raw = torch.randint(0, 256, (size + offset,), dtype=torch.uint8, generator=gen).numpy()
    data = raw[offset:]
    assert kvbm_ext.crc32c(data) == reference(data)


def test_chained_calls_equal_one_call(gen):
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=gen).numpy()
    whole = kvbm_ext.crc32c(data)
    for cut in (0, 1, 4096, 12288, 50_000, 100_003):
        assert kvbm_ext.crc32c(data[cut:], kvbm_ext.crc32c(data[:cut])) == whole
    assert whole != zlib.crc32(data), "CRC-32C, not zlib's CRC-32"


def test_every_host_producer_sums_the_same_bytes(gen):
    t = torch.randint(-2**15, 2**15, (64, 33), dtype=torch.int16, generator=gen)
    want = reference(t.numpy().tobytes())
    pool = kvbm_ext.pinned_empty((64, 33), torch.int16)
    torch.from_dlpack(pool).copy_(t)
    for data in (t, t.numpy(), DLPackOnly(t), ArrayInterfaceOnly(t.numpy()), memoryview(t.numpy()),
                 t.numpy().tobytes(), bytearray(t.numpy().tobytes()), pool, t.view(torch.bfloat16)):
        assert kvbm_ext.crc32c(data) == want, type(data).__name__


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((torch.arange(12).reshape(3, 4)[:, ::2],), {}, ValueError, "data: must be C-contiguous"),
    ((b"x",), {"value": -1}, ValueError, "value"),
    ((b"x",), {"value": 2**32}, ValueError, "value"),
    ((b"x",), {"value": 1.5}, TypeError, "value"),
    (([1, 2, 3],), {}, TypeError, "data"),
    ((b"x", 0, 1), {}, TypeError, "crc32c"),
    ((), {"data": b"x"}, TypeError, "crc32c"),
])
def test_refusals_name_the_argument(args, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        kvbm_ext.crc32c(*args, **kwargs)


def test_threads_sum_at_once(gen):
    """Each call past 64 KiB releases the GIL: threads summing their own buffers agree with
    one thread."""
    buffers = [torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen).numpy() for _ in range(4)]
    want = [kvbm_ext.crc32c(b) for b in buffers]
    got = [None] * 4

    def run(i):
        for _ in range(20):
            got[i] = kvbm_ext.crc32c(buffers[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


@pytest.mark.gpu
def test_device_arrays_are_refused():
    with pytest.raises(ValueError, match="data: on a CUDA device"):
        kvbm_ext.crc32c(torch.zeros(16, device="cuda"))
