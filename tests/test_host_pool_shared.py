"""kvbm_ext.pinned_empty(..., shared=NAME): one pinned pool in a named POSIX shared-memory
object (/dev/shm/NAME), mapped by several processes (vLLM's tensor-parallel workers).

CPU: two and four processes map one name and see each other's bytes bit for bit; exactly
one of processes started together creates it; a live region of another size is refused;
bad names; the lifetime rule (the name lives while some process maps it: the last to let
go unlinks it, at close(), at its last reference or at a normal exit; a region no process
maps any more, left by a killed process or os._exit, is replaced by the next pinned_empty
of the name or removed by unlink_shared); no /dev/shm entry left behind.  GPU: two
processes on one GPU map the region pinned; torch copies a CUDA tensor into it
(non_blocking) in one and reads it back onto the GPU in the other, bit for bit.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch

import kvbm_ext
from support import REPO_ROOT

MIB = 1 << 20
SHM = "/dev/shm"
ON_GPU = torch.cuda.is_available() and not kvbm_ext.is_using_stubs()
# Every name these tests make starts so: what is left under /dev/shm is checked by prefix.
PREFIX = f"kvbmtest-{os.getpid()}-"


def shm_entries():
    return sorted(name for name in os.listdir(SHM) if name.startswith(PREFIX))


@pytest.fixture(scope="module", autouse=True)
def nothing_left_in_dev_shm():
    """After the module: no /dev/shm entry of these tests is left (removed if one is, so
    that a failure leaves no litter, and reported)."""
    assert shm_entries() == []
    yield
    left = shm_entries()
    for name in left:
        os.unlink(os.path.join(SHM, name))
    assert left == [], f"left in {SHM}: {left}"


@pytest.fixture
def name():
    """A fresh name; at the end of the test, its /dev/shm entry must be gone."""
    made = PREFIX + uuid.uuid4().hex[:12]
    yield made
    path = os.path.join(SHM, made)
    left = os.path.exists(path)
    if left:
        os.unlink(path)
    assert not left, f"{path} was left behind"


def shm_size(name):
    path = os.path.join(SHM, name)
    return os.stat(path).st_size if os.path.exists(path) else None


def maps_of(name):
    """The lines of /proc/self/maps of mappings of /dev/shm/`name`."""
    with open("/proc/self/maps") as f:
        return [line for line in f if line.rstrip().endswith(os.path.join(SHM, name))]


def random_bytes(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# --------------------------------------------------------------------------
# A peer: another process that maps the name and obeys one command a line.
# --------------------------------------------------------------------------

PEER = textwrap.dedent(r"""
    import ctypes, json, os, sys
    import numpy as np
    import kvbm_ext

    name, nbytes = sys.argv[1], int(sys.argv[2])
    buf = kvbm_ext.pinned_empty(nbytes, "uint8", shared=name, threads=2)
    print(json.dumps({"created": buf.created, "shared": buf.shared, "pinned": buf.pinned}), flush=True)
    view = np.asarray(buf)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "write":
            view[:] = np.random.default_rng(int(args[0])).integers(0, 256, view.size, dtype=np.uint8)
            reply = "written"
        elif command == "check":
            expected = np.random.default_rng(int(args[0])).integers(0, 256, view.size, dtype=np.uint8)
            reply = "equal" if np.array_equal(view, expected) else "differ"
        elif command == "close":
            del view
            buf.close()
            reply = "closed"
        elif command == "leak":
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(buf))   # never deallocated
            del view, buf
            reply = "leaked"
        elif command == "exit":
            sys.exit(0)
        elif command == "os_exit":
            os._exit(0)
        print(reply, flush=True)
""")


class Peer:
    """A process running PEER on `name`: its first line says what pinned_empty gave."""

    def __init__(self, name, nbytes, script=PEER):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen([sys.executable, "-c", script, name, str(nbytes)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.info = None

    def started(self):
        if self.info is None:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the peer failed: {self.process.stderr.read()[-3000:]}")
            self.info = json.loads(line)
        return self.info

    def ask(self, command):
        self.started()
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline().strip()
        if not line and command not in ("exit", "os_exit"):
            raise AssertionError(f"the peer failed on {command!r}: {self.process.stderr.read()[-3000:]}")
        return line

    def end(self, command="exit"):
        self.ask(command)
        assert self.process.wait(timeout=60) == 0, self.process.stderr.read()[-3000:]

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.process.poll() is None:
            self.kill()
        self.process.stdin.close()
        self.process.stdout.close()
        self.process.stderr.close()


# --------------------------------------------------------------------------
# Several processes, one region.
# --------------------------------------------------------------------------


def test_two_processes_share_the_bytes(name):
    """One process writes random bytes, the other reads them bit for bit, both ways."""
    nbytes = 3 * MIB + 5
    with Peer(name, nbytes) as first:
        assert first.started() == {"created": True, "shared": name, "pinned": ON_GPU}
        with Peer(name, nbytes) as second:
            assert second.started() == {"created": False, "shared": name, "pinned": ON_GPU}
            assert shm_size(name) == 4 * MIB          # the mapped size: nbytes rounded up to 2 MiB
            assert first.ask("write 1") == "written"
            assert second.ask("check 1") == "equal"
            assert second.ask("write 2") == "written"
            assert first.ask("check 2") == "equal"
            first.end()
            second.end()
    assert shm_size(name) is None


def test_processes_started_together_create_it_once(name):
    """Four processes asking at once: one creates it, three join it, all see one memory."""
    peers = [Peer(name, 2 * MIB) for _ in range(4)]
    try:
        created = [peer.started()["created"] for peer in peers]
        assert sorted(created) == [False, False, False, True]
        for seed, writer in enumerate(peers):
            assert writer.ask(f"write {seed}") == "written"
            assert all(peer.ask(f"check {seed}") == "equal" for peer in peers)
        for peer in peers:
            peer.end()
    finally:
        for peer in peers:
            peer.__exit__()
    assert shm_size(name) is None


def test_this_process_and_a_peer(name):
    """The calling process joins a peer's region: a NumPy view reads the peer's bytes, and
    the peer reads what torch wrote through DLPack."""
    with Peer(name, 2 * MIB) as peer:
        assert peer.started()["created"]
        assert peer.ask("write 7") == "written"
        buf = kvbm_ext.pinned_empty((2, MIB), "uint8", shared=name)
        assert (buf.shared, buf.created, buf.nbytes) == (name, False, 2 * MIB)
        assert np.array_equal(np.asarray(buf).reshape(-1), random_bytes(7, 2 * MIB))
        torch.from_dlpack(buf).view(-1).copy_(torch.from_numpy(random_bytes(8, 2 * MIB)))
        assert peer.ask("check 8") == "equal"
        buf.close()
        peer.end()
    assert shm_size(name) is None


# --------------------------------------------------------------------------
# Sizes and names.
# --------------------------------------------------------------------------


def test_a_live_region_of_another_size_is_refused(name):
    buf = kvbm_ext.pinned_empty(4 * MIB, "uint8", shared=name)
    before = maps_of(name)
    with pytest.raises(ValueError, match=rf"^shared: {name!r} is 4194304 bytes in /dev/shm; this buffer maps "
                                         r"2097152 bytes \(1048576 bytes rounded up to 2 MiB\)"):
        kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
    assert maps_of(name) == before                    # the refused call mapped nothing
    # The size compared is the mapping's: 3 MiB and 4 MiB both map 4 MiB, the same pages.
    other = kvbm_ext.pinned_empty((3, MIB), "uint8", shared=name)
    assert not other.created and other.nbytes == 3 * MIB
    np.asarray(buf)[: 3 * MIB] = random_bytes(3, 3 * MIB)
    assert np.array_equal(np.asarray(other).reshape(-1), random_bytes(3, 3 * MIB))
    assert shm_size(name) == 4 * MIB
    other.close()
    buf.close()


BAD_NAMES = [
    ("", ValueError, r"^shared: '' is empty"),
    ("a/b", ValueError, r"^shared: 'a/b' holds a '/'"),
    ("/kvbm", ValueError, r"^shared: '/kvbm' holds a '/'"),
    (".", ValueError, r"^shared: '\.' is not a name"),
    ("..", ValueError, r"^shared: '\.\.' is not a name"),
    ("x" * 256, ValueError, r"^shared: 'xxx.*' is 256 bytes \(UTF-8\); at most 255 \(NAME_MAX\)"),
    ("\u00e9" * 128, ValueError, r"^shared: .* is 256 bytes \(UTF-8\); at most 255"),
    ("a\0b", ValueError, r"^shared: 'a\\x00b' holds a NUL"),
    ("\ud800", ValueError, r"^shared: '\\ud800' is not valid UTF-8"),
    (5, TypeError, r"^shared: expected None or a str, got int"),
    (b"kvbm", TypeError, r"^shared: expected None or a str, got bytes"),
]


@pytest.mark.parametrize("bad,exc,message", BAD_NAMES, ids=[str(i) for i in range(len(BAD_NAMES))])
def test_bad_names_are_refused_before_anything_is_made(bad, exc, message):
    before = sorted(os.listdir(SHM))
    with pytest.raises(exc, match=message):
        kvbm_ext.pinned_empty(MIB, "uint8", shared=bad)
    with pytest.raises(exc, match=message.replace("shared", "name", 1).replace("None or a str", "a str")):
        kvbm_ext.unlink_shared(bad)
    assert sorted(os.listdir(SHM)) == before


def test_the_longest_name():
    longest = (PREFIX + "x" * 255)[:255]
    buf = kvbm_ext.pinned_empty(MIB, "uint8", shared=longest)
    assert buf.shared == longest and shm_size(longest) == 2 * MIB
    buf.close()
    assert shm_size(longest) is None


def test_explicit_huge_pages_cannot_be_shared(name):
    with pytest.raises(ValueError, match=r"^huge_pages: 'explicit' cannot be shared \(shared="):
        kvbm_ext.pinned_empty(MIB, "uint8", shared=name, huge_pages="explicit")
    assert shm_size(name) is None


@pytest.mark.parametrize("huge_pages", ["transparent", "none"])
def test_huge_pages_follow_shmem_enabled(name, huge_pages):
    """Shared memory takes transparent huge pages as shmem_enabled says; the mapping is
    aligned to 2 MiB either way."""
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        setting = f.read().split("[")[1].split("]")[0]
    buf = kvbm_ext.pinned_empty(MIB, "uint8", shared=name, huge_pages=huge_pages)
    gives = setting in ("always", "within_size", "advise", "force")
    assert buf.huge_pages == ("transparent" if huge_pages == "transparent" and gives else "none")
    assert np.asarray(buf).ctypes.data % (2 * MIB) == 0
    buf.close()


# --------------------------------------------------------------------------
# Attributes.
# --------------------------------------------------------------------------


def test_attributes_of_shared_and_private_buffers(name):
    private = kvbm_ext.pinned_empty(MIB, "uint8")
    assert (private.shared, private.created) == (None, True)
    assert "shared" not in repr(private)
    buf = kvbm_ext.pinned_empty((4, 8), torch.bfloat16, shared=name)
    assert (buf.shared, buf.created) == (name, True)
    assert repr(buf).endswith(f", shared={name!r})")
    assert not np.asarray(buf).any()                  # created: it reads as zeros
    buf.close()
    assert (buf.shared, buf.created, buf.closed) == (name, True, True)


def test_the_debug_line_says_shared(name, monkeypatch):
    monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
    lines = []
    import logging
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("kvbm_ext").addHandler(handler)
    try:
        first = kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
        second = kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
    finally:
        logging.getLogger("kvbm_ext").removeHandler(handler)
    assert lines[0].endswith(f", shared {name!r} (created)"), lines[0]
    assert lines[1].endswith(f", shared {name!r} (joined)"), lines[1]
    second.close()
    first.close()


# --------------------------------------------------------------------------
# Lifetime: the name lives while some process maps it.
# --------------------------------------------------------------------------


def test_the_last_to_let_go_unlinks_it(name):
    """Each pinned_empty is a holder of its own (as another process would be): the name
    stays while one maps it, so a late joiner finds the bytes; the last close unlinks it."""
    first = kvbm_ext.pinned_empty(2 * MIB, "uint8", shared=name)
    second = kvbm_ext.pinned_empty(2 * MIB, "uint8", shared=name)
    np.asarray(first)[:] = random_bytes(1, 2 * MIB)
    first.close()
    assert shm_size(name) == 2 * MIB                  # the creator left; second still maps it
    late = kvbm_ext.pinned_empty(2 * MIB, "uint8", shared=name)
    assert not late.created
    assert np.array_equal(np.asarray(late), random_bytes(1, 2 * MIB))
    second.close()
    assert shm_size(name) == 2 * MIB
    late.close()
    assert shm_size(name) is None


def test_an_export_holds_the_name_until_released(name):
    buf = kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
    tensor = torch.from_dlpack(buf)
    buf.close()
    assert shm_size(name) == 2 * MIB
    tensor.fill_(3)
    del tensor
    assert shm_size(name) is None


def test_a_name_nobody_maps_is_made_anew(name):
    """After every holder let go, the next pinned_empty of the name creates a new region:
    it reads as zeros."""
    with Peer(name, MIB) as peer:
        peer.ask("write 5")
        assert peer.ask("close") == "closed"
        assert shm_size(name) is None                 # at close(), before the process ends
        peer.end()
    assert shm_size(name) is None
    buf = kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
    assert buf.created and not np.asarray(buf).any()
    buf.close()


def test_unlink_shared_takes_the_name_not_the_memory(name):
    """unlink_shared removes the name at once: a process that maps it keeps its memory,
    and the next pinned_empty of the name makes another region."""
    buf = kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
    np.asarray(buf)[:] = 9
    assert kvbm_ext.unlink_shared(name) is True
    assert shm_size(name) is None
    assert kvbm_ext.unlink_shared(name) is False      # nothing of that name
    assert kvbm_ext.unlink_shared(name=name) is False
    assert (np.asarray(buf) == 9).all()
    other = kvbm_ext.pinned_empty(MIB, "uint8", shared=name)
    assert other.created and not np.asarray(other).any()
    buf.close()                                       # the unlinked one: the new name stays
    assert shm_size(name) == 2 * MIB
    other.close()
    assert shm_size(name) is None


@pytest.mark.parametrize("how", ["kill", "os_exit"])
def test_a_region_left_by_a_process_that_ended_without_letting_go(name, how):
    """A process killed (SIGKILL) or ended by os._exit unlinks nothing: its region stays in
    /dev/shm, mapped by nobody.  The next pinned_empty of the name replaces it (a new region,
    whatever the old one's size); unlink_shared removes it."""
    for size, then in ((MIB, "replace"), (4 * MIB, "replace"), (MIB, "unlink")):
        with Peer(name, MIB) as peer:
            assert peer.started()["created"]
            peer.ask("write 4")
            if how == "kill":
                peer.kill()
            else:
                peer.end("os_exit")
        assert shm_size(name) == 2 * MIB              # left behind
        if then == "unlink":
            assert kvbm_ext.unlink_shared(name) is True
            continue
        buf = kvbm_ext.pinned_empty(size, "uint8", shared=name)
        assert buf.created and not np.asarray(buf).any()
        assert shm_size(name) == max(size, 2 * MIB)
        buf.close()
        assert shm_size(name) is None


def test_a_normal_exit_without_close_unlinks_it(name):
    """A process that exits normally with its buffer never released (a reference leaked)
    still unlinks the name when it was the last to map it (at interpreter exit)."""
    with Peer(name, MIB) as peer:
        assert peer.started()["created"]
        with Peer(name, MIB) as other:
            assert not other.started()["created"]
            assert peer.ask("leak") == "leaked"
            peer.end("exit")
            assert shm_size(name) == 2 * MIB          # the other still maps it
            assert other.ask("leak") == "leaked"
            other.end("exit")
    assert shm_size(name) is None


# --------------------------------------------------------------------------
# GPU: two processes on one GPU, one region pinned in both.
# --------------------------------------------------------------------------

GPU_PEER = textwrap.dedent(r"""
    import sys
    import torch
    import kvbm_ext

    name, nbytes = sys.argv[1], int(sys.argv[2])
    torch.cuda.init()       # torch's is_pinned() says False for any memory before torch has initialized CUDA
    buf = kvbm_ext.pinned_empty(nbytes, "uint8", shared=name, device=0)
    host = torch.from_dlpack(buf)
    assert buf.pinned and host.is_pinned(), (buf.pinned, host.is_pinned())
    assert kvbm_ext.HostBuffer._pointer_kind(host.data_ptr()) == "pinned"
    print('{"created": %s, "shared": "%s", "pinned": true}' % (str(buf.created).lower(), name), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(11)
    for line in sys.stdin:
        command = line.split()[0]
        if command == "store":      # a CUDA tensor into the shared pinned memory
            source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
            host.copy_(source, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            print("stored", flush=True)
        elif command == "load":     # the other process's bytes onto this GPU
            expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
            loaded = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            loaded.copy_(host, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            print("equal" if torch.equal(loaded, expected) else "differ", flush=True)
        elif command == "exit":
            del host
            buf.close()
            sys.exit(0)
""")


@pytest.mark.gpu
@pytest.mark.skipif(kvbm_ext.is_using_stubs(), reason="needs a CUDA build of kvbm_ext")
def test_two_processes_on_one_gpu_share_pinned_memory(name):
    nbytes = 64 * MIB
    with Peer(name, nbytes, GPU_PEER) as storer:
        assert storer.started()["created"] and storer.started()["pinned"]
        with Peer(name, nbytes, GPU_PEER) as loader:
            assert not loader.started()["created"] and loader.started()["pinned"]
            assert storer.ask("store") == "stored"
            assert loader.ask("load") == "equal"
            storer.end()
            loader.end()
    assert shm_size(name) is None
