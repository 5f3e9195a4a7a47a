"""pinned_empty's first-touch rate against its threads, on memory a freshly started machine
has not used ("cold": every 4 GiB buffer is kept, so the next one gets memory not used
before), then the same sequence again after they are freed ("warm").  Run it first on a
machine.  Results: results/host_pools-probe-*.log."""
import time, numpy as np
print(open("/proc/meminfo").read())
import kvbm_ext
GiB = 1 << 30
for rnd in ("cold", "warm"):
    keep = []
    for threads, huge in ((1, "transparent"), (2, "transparent"), (4, "transparent"), (8, "transparent"), (16, "transparent"), (32, "transparent"), (64, "transparent"), (16, "none")):
        t = time.perf_counter()
        b = kvbm_ext.pinned_empty(4 * GiB, np.uint8, threads=threads, huge_pages=huge)
        dt = time.perf_counter() - t
        keep.append(b)
        print(f"{rnd} 4 GiB threads={threads:2d} huge={huge:11s}: {dt:.3f} s = {4/dt:.2f} GiB/s (buffer says {b.seconds:.3f} s, huge {b.huge_pages})", flush=True)
    t = time.perf_counter(); del keep; print(f"free {time.perf_counter()-t:.3f} s")
