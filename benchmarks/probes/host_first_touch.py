"""Where the seconds of a large pinned_empty go, on a freshly started machine.

Prints the transparent-huge-page settings, /proc/meminfo and /proc/buddyinfo, then times
kvbm_ext.pinned_empty(32 GiB) twice and 8 GiB once (the kernel's THP and compaction
counters around each), then the same steps by hand through ctypes: anonymous mmap +
MADV_HUGEPAGE + a memset per thread ("touch") or MADV_POPULATE_WRITE per thread
("populate"), then cudaHostRegister in 1, 4 or 16 pieces from 1, 4 or 16 threads.
Run it first on a machine: its first allocation is the one that meets memory the
machine has not used since it started.  Results: results/host_pools-probe-*.log.
"""
import ctypes, glob, os, threading, time

GiB = 1 << 30
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
import torch
rt = None
for cand in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")) + ["libcudart.so"]:
    try:
        rt = ctypes.CDLL(cand); break
    except OSError:
        pass
rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
torch.zeros(1, device="cuda")

def vm():
    d = {}
    for line in open("/proc/vmstat"):
        k, v = line.split(); d[k] = int(v)
    return d

def meminfo():
    return {l.split(":")[0]: l.split(":")[1].strip() for l in open("/proc/meminfo")}

def delta(a, b, keys=("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_fail", "compact_success", "pgfault", "thp_split_page")):
    return " ".join(f"{k}={b.get(k,0)-a.get(k,0)}" for k in keys)

def run_threads(n, fn):
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    [t.start() for t in ts]; [t.join() for t in ts]

def probe(size, threads=16, how="touch", reg_pieces=1, reg_threads=1):
    t0 = time.perf_counter(); v0 = vm()
    p = libc.mmap(None, size, 3, 0x22, -1, 0)
    assert p not in (None, ctypes.c_void_p(-1).value)
    libc.madvise(p, size, 14)  # MADV_HUGEPAGE
    share = size // threads
    def touch(i):
        a = p + i * share
        if how == "populate":
            r = libc.madvise(a, share, 23)  # MADV_POPULATE_WRITE
            if r: print("populate errno", ctypes.get_errno())
        else:
            libc.memset(a, 0, share)
    run_threads(threads, touch)
    t1 = time.perf_counter(); v1 = vm()
    piece = size // reg_pieces
    errs = []
    def reg(i):
        for j in range(i, reg_pieces, reg_threads):
            e = rt.cudaHostRegister(p + j * piece, piece, 1)
            if e: errs.append(e)
    run_threads(reg_threads, reg)
    t2 = time.perf_counter()
    for j in range(reg_pieces):
        rt.cudaHostUnregister(p + j * piece)
    libc.munmap(p, size)
    t3 = time.perf_counter()
    print(f"{size/GiB:5.0f} GiB {how:9s} thr={threads:2d} pieces={reg_pieces} regthr={reg_threads}: map+touch {t1-t0:.3f} s, register {t2-t1:.3f} s, total {t2-t0:.3f} s, free {t3-t2:.3f} s, errs {errs} | {delta(v0, v1)}", flush=True)

def kvbm(size):
    import kvbm_ext
    v0 = vm(); t0 = time.perf_counter()
    b = kvbm_ext.pinned_empty(size, "uint8")
    t1 = time.perf_counter(); v1 = vm()
    del b
    print(f"{size/GiB:5.0f} GiB kvbm pinned_empty: {t1-t0:.3f} s | {delta(v0, v1)}", flush=True)

if __name__ == "__main__":
    os.environ["KVBM_EXT_DEBUG"] = "1"
    print(os.uname().release)
    for f in ["enabled", "defrag", "khugepaged/defrag", "khugepaged/max_ptes_none", "shmem_enabled", "use_zero_page"]:
        try: print(f, open("/sys/kernel/mm/transparent_hugepage/" + f).read().strip())
        except OSError as e: print(f, e)
    m = meminfo(); print({k: m[k] for k in ["MemTotal", "MemFree", "MemAvailable", "Cached", "AnonHugePages", "HugePages_Total", "Hugepagesize"]})
    print(open("/proc/buddyinfo").read())
    kvbm(32 * GiB)
    kvbm(32 * GiB)
    kvbm(8 * GiB)
    for how in ("touch", "populate"):
        probe(8 * GiB, how=how)
        probe(32 * GiB, how=how)
    probe(32 * GiB, how="populate", reg_pieces=4, reg_threads=4)
    probe(32 * GiB, how="populate", reg_pieces=16, reg_threads=16)
    probe(32 * GiB, how="populate", reg_pieces=16, reg_threads=1)
    probe(32 * GiB, how="populate", threads=32)
    m = meminfo(); print({k: m[k] for k in ["MemFree", "MemAvailable", "Cached", "AnonHugePages"]})
    print(open("/proc/buddyinfo").read())
