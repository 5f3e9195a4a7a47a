"""NIXL 1.5.1 POSIX backend: DRAM <-> FILE (disk tier), one process, loopback.

  PYTHONPATH=/work/nixl-site python3 nixl_posix_file.py [AIO|URING|POSIXAIO] [dir] [GiB]
  (env PROBE_POSIX_PARAMS='{"kernel_queue_size": "1024"}' adds POSIX backend params)

FILE descriptors: register (offset, len, fd, "") / xfer (offset, len, fd); the transfer's
"remote" agent is the agent's own name. WRITE = DRAM -> FILE, READ = FILE -> DRAM.
Measures 1 GiB (default) in 1 MiB and 64 KiB descriptors, O_DIRECT and buffered
(page cache dropped before reads when /proc/sys/vm/drop_caches is writable), then checks
O_DIRECT misalignment behaviour and data at offsets.
"""
import ctypes
import mmap
import os
import sys
import time

import numpy as np

from nixl_cu13._api import nixl_agent, nixl_agent_config

MiB = 1 << 20


def aligned(nbytes):
    m = mmap.mmap(-1, nbytes)  # page aligned
    a = np.frombuffer(m, dtype=np.uint8)
    return m, a, a.ctypes.data


def drop_caches(path):
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        return "fadvise"


def run(ag, op, dl, fl, name):
    t0 = time.perf_counter()
    h = ag.initialize_xfer(op, dl, fl, name)
    t1 = time.perf_counter()
    s = ag.transfer(h)
    t2 = time.perf_counter()
    polls = 0
    while s == "PROC":
        s = ag.check_xfer_state(h)
        polls += 1
    t3 = time.perf_counter()
    ag.release_xfer_handle(h)
    return s, t1 - t0, t2 - t1, t3 - t0, polls


def main(queue, d, gib):
    params = {"use_aio": "false", "use_uring": "false", "use_posix_aio": "false"}
    params[{"AIO": "use_aio", "URING": "use_uring", "POSIXAIO": "use_posix_aio"}[queue]] = "true"
    # extra backend params, e.g. PROBE_POSIX_PARAMS='{"kernel_queue_size": "1024"}'
    params.update(__import__("json").loads(os.environ.get("PROBE_POSIX_PARAMS", "{}")))
    ag = nixl_agent("F", nixl_agent_config(backends=[]))
    ag.create_backend("POSIX", params)
    print(f"POSIX params {ag.get_backend_params('POSIX')} mems {ag.get_backend_mem_types('POSIX')}")
    total = gib << 30
    m, buf, addr = aligned(total)
    buf[:] = 7
    ag.register_memory([(addr, total, 0, "")], "DRAM", backends=["POSIX"])
    for direct in (True, False):
        path = os.path.join(d, f"nixl_posix_{'direct' if direct else 'buffered'}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
        os.posix_fallocate(fd, 0, total)
        freg = ag.register_memory([(0, total, fd, "")], "FILE", backends=["POSIX"])
        for dsz in (MiB, 64 << 10):
            n = total // dsz
            dl = ag.get_xfer_descs([(addr + i * dsz, dsz, 0) for i in range(n)], "DRAM")
            fl = ag.get_xfer_descs([(i * dsz, dsz, fd) for i in range(n)], "FILE")
            for op in ("WRITE", "READ"):
                how = ""
                if op == "READ":
                    if not direct:
                        os.fsync(fd)
                    how = drop_caches(path)
                    buf[:] = 0
                s, ti, tp, tt, polls = run(ag, op, dl, fl, "F")
                extra = ""
                if op == "WRITE" and not direct:
                    t0 = time.perf_counter(); os.fsync(fd); extra = f", +fsync {time.perf_counter()-t0:.2f} s"
                ok = bool((buf[:: 4099] == 7).all()) if op == "READ" else ""
                print(f"{'O_DIRECT' if direct else 'buffered'} {queue} {op:5s} {gib} GiB as {n:5d} x "
                      f"{dsz>>10:4d} KiB: {s} {total/tt/1e9:.2f} GB/s ({tt:.2f} s; init {ti*1e3:.1f} ms,"
                      f" transfer() {tp*1e3:.1f} ms, {polls} polls{extra}) {how} {ok}", flush=True)
        if direct:
            # misalignment: buffer / file offset / length off by 1 and 512 bytes
            fd2 = fd
            for label, (bo, fo, ln) in {"buf+512": (512, 0, 4096), "buf+1": (1, 0, 4096),
                                        "off+512": (0, 512, 4096), "off+1": (0, 1, 4096),
                                        "len 4096+512": (0, 0, 4608), "len 1000": (0, 0, 1000),
                                        "aligned 4096": (0, 0, 4096)}.items():
                for op in ("WRITE", "READ"):
                    try:
                        dl = ag.get_xfer_descs([(addr + bo, ln, 0)], "DRAM")
                        fl = ag.get_xfer_descs([(fo, ln, fd2)], "FILE")
                        s, *_ = run(ag, op, dl, fl, "F")
                    except Exception as e:
                        s = f"RAISED {type(e).__name__}: {e}"
                    print(f"  O_DIRECT {label:13s} {op:5s}: {s}", flush=True)
        ag.deregister_memory(freg, backends=["POSIX"])
        os.close(fd)
        os.unlink(path)
    # offsets: scatter 4 KiB pieces to scattered file offsets and read them back elsewhere
    path = os.path.join(d, "nixl_posix_offsets.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, 64 * MiB)
    freg = ag.register_memory([(0, 64 * MiB, fd, "")], "FILE", backends=["POSIX"])
    rng = np.random.default_rng(0)
    offs = rng.choice(64 * MiB // 4096, size=256, replace=False) * 4096
    for i in range(256):
        buf[i * 4096:(i + 1) * 4096] = i % 251
    dl = ag.get_xfer_descs([(addr + i * 4096, 4096, 0) for i in range(256)], "DRAM")
    fl = ag.get_xfer_descs([(int(o), 4096, fd) for o in offs], "FILE")
    s1 = run(ag, "WRITE", dl, fl, "F")[0]
    buf[: 2 * MiB] = 255
    base = MiB  # read back into a different DRAM region
    dl2 = ag.get_xfer_descs([(addr + base + i * 4096, 4096, 0) for i in range(256)], "DRAM")
    s2 = run(ag, "READ", dl2, fl, "F")[0]
    ok = all(bool((buf[base + i * 4096: base + (i + 1) * 4096] == i % 251).all()) for i in range(256))
    print(f"256 x 4 KiB to random file offsets: WRITE {s1}, READ {s2}, data ok {ok}")
    ag.deregister_memory(freg, backends=["POSIX"])
    os.close(fd)
    os.unlink(path)
    # path-mode registration: metaInfo "<modes>:<path>", the backend opens/closes the file;
    # devId is then a caller-chosen key (unique per path-mode registration) used in xfer descs
    path = os.path.join(d, "nixl_posix_pathmode.bin")
    key = 100001
    try:
        preg = ag.register_memory([(0, 64 * MiB, key, f"rw,create,direct:{path}")], "FILE",
                                  backends=["POSIX"])
        buf[:4 * MiB] = 9
        dl = ag.get_xfer_descs([(addr, 4 * MiB, 0)], "DRAM")
        fl = ag.get_xfer_descs([(8 * MiB, 4 * MiB, key)], "FILE")
        s1 = run(ag, "WRITE", dl, fl, "F")[0]
        buf[:4 * MiB] = 0
        s2 = run(ag, "READ", dl, fl, "F")[0]
        print(f"path-mode FILE (rw,create,direct): WRITE {s1}, READ {s2}, data ok "
              f"{bool((buf[:4 * MiB] == 9).all())}, file size {os.path.getsize(path)}")
        ag.deregister_memory(preg, backends=["POSIX"])
    except Exception as e:
        print(f"path-mode FILE: {type(e).__name__}: {e}")
    if os.path.exists(path):
        os.unlink(path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "AIO",
         sys.argv[2] if len(sys.argv) > 2 else "/tmp",
         int(sys.argv[3]) if len(sys.argv) > 3 else 1)
