"""Host cost per transfer and throughput, two processes, UCX, DRAM->DRAM (NIXL 1.5.1).

  PYTHONPATH=/work/nixl-site python3 nixl_xfer_costs.py [reps]        # UCX picks cma + tcp
  UCX_TLS=tcp PYTHONPATH=/work/nixl-site python3 nixl_xfer_costs.py   # TCP only

Paths timed (A = initiator, B = passive target, one-sided):
  init   : initialize_xfer + transfer + spin check_xfer_state to DONE + release_xfer_handle
  prepped: (prep_xfer_dlist once per side) make_prepped_xfer([i],[i]) + transfer + spin + release
  repost : handle made once; transfer(h) + spin to DONE, repeated on the same handle
PROBE_PROG=0 turns A's progress thread off (B keeps its own).
Throughput: 64 MiB as 1 descriptor vs 1024 x 64 KiB descriptors, re-posted handle.
"""
import sys
import time

import numpy as np

from nixl_common import buf, make_agent, med_us, spawn_child, store_client, store_host

TOTAL = 64 << 20


def target(port):
    st = store_client(port)
    # the passive target needs its progress thread: with it off (and B never calling
    # get_new_notifs) A's first transfer never completes (connection wireup needs B)
    b = make_agent("B", enable_prog_thread=True)
    t, addr = buf(TOTAL, fill=0)
    reg = b.register_memory([(addr, TOTAL, 0, "")], "DRAM")
    st.set("md/B", b.get_agent_metadata())
    st.set("addr/B", str(addr))
    st.wait(["A/done"], __import__("datetime").timedelta(seconds=600))
    b.deregister_memory(reg)


def spin(a, h):
    while True:
        s = a.check_xfer_state(h)
        if s == "DONE":
            return
        if s == "ERR":
            raise RuntimeError("ERR")



def time_path(a, make, reps, n, first):
    """Host time of each stage of `reps` transfers, handle i % n made by make(i): make (or
    initialize), post, wait until DONE, release, and their total."""
    ph = {first: [], "post": [], "wait": [], "rel": [], "tot": []}
    for r in range(reps):
        c0 = time.perf_counter()
        h = make(r % n)
        c1 = time.perf_counter(); a.transfer(h)
        c2 = time.perf_counter(); spin(a, h)
        c3 = time.perf_counter(); a.release_xfer_handle(h)
        c4 = time.perf_counter()
        for k, v in zip(ph, (c1 - c0, c2 - c1, c3 - c2, c4 - c3, c4 - c0)):
            ph[k].append(v)
    return ph

def main(reps):
    st = store_host()
    child = spawn_child(__file__, st.port)
    a = make_agent("A")
    t, la = buf(TOTAL, fill=3)
    reg = a.register_memory([(la, TOTAL, 0, "")], "DRAM")
    st.wait(["md/B", "addr/B"])
    md = st.get("md/B")
    ra = int(st.get("addr/B"))
    t0 = time.perf_counter(); a.add_remote_agent(md); t1 = time.perf_counter()
    a.make_connection("B"); t2 = time.perf_counter()
    print(f"add_remote_agent {1e3*(t1-t0):.2f} ms, make_connection {1e3*(t2-t1):.2f} ms")
    # first transfer after connect
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(la, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(ra, 4096, 0)], "DRAM"), "B")
    t0 = time.perf_counter(); a.transfer(h); spin(a, h); t1 = time.perf_counter()
    print(f"first 4 KiB WRITE {1e3*(t1-t0):.2f} ms; backend={a.query_xfer_backend(h)}")
    a.release_xfer_handle(h)

    for size in (64 << 10, 4 << 20):
        n = TOTAL // size
        lrows = [(la + i * size, size, 0) for i in range(n)]
        rrows = [(ra + i * size, size, 0) for i in range(n)]
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM")
        rh = a.prep_xfer_dlist("B", rrows, "DRAM")
        for op in ("WRITE", "READ"):
            # init path, then prepped path
            paths = (("init   ", "init", lambda i: a.initialize_xfer(op, a.get_xfer_descs([lrows[i]], "DRAM"),
                                                                      a.get_xfer_descs([rrows[i]], "DRAM"), "B")),
                     ("prepped", "make", lambda i: a.make_prepped_xfer(op, lh, [i], rh, [i])))
            for label, first, make in paths:
                ph = time_path(a, make, reps, n, first)
                print(f"{op} {size>>10:5d} KiB {label}: " +
                      " ".join(f"{k}={med_us(v):7.1f}" for k, v in ph.items()) + " us (median)")
            # repost path: one handle per block, made once, cycled (same memory as above)
            hs = [a.make_prepped_xfer(op, lh, [i], rh, [i]) for i in range(n)]
            for notif in (b"", b"n"):
                ph = {"post": [], "wait": [], "tot": []}
                rets = {}
                for r in range(reps):
                    h = hs[r % n]
                    c1 = time.perf_counter(); ret = a.transfer(h, notif)
                    c2 = time.perf_counter(); spin(a, h)
                    c3 = time.perf_counter()
                    rets[ret] = rets.get(ret, 0) + 1
                    for k, v in zip(ph, (c2 - c1, c3 - c2, c3 - c1)):
                        ph[k].append(v)
                tag = "repost " if not notif else "rp+notif"
                print(f"{op} {size>>10:5d} KiB {tag}: " +
                      " ".join(f"{k}={med_us(v):7.1f}" for k, v in ph.items()) + " us (median)"
                      f"  -> {size/med_us(ph['tot'])/1e3:.2f} GB/s; transfer() returned {rets}")
            for h in hs:
                a.release_xfer_handle(h)
        a.release_dlist_handle(lh); a.release_dlist_handle(rh)

    # throughput 64 MiB: 1 descriptor vs 1024 x 64 KiB
    for ndesc in (1, 1024):
        size = TOTAL // ndesc
        lh = a.prep_xfer_dlist("", [(la + i * size, size, 0) for i in range(ndesc)], "DRAM")
        rh = a.prep_xfer_dlist("B", [(ra + i * size, size, 0) for i in range(ndesc)], "DRAM")
        for op in ("WRITE", "READ"):
            idx = np.arange(ndesc, dtype=np.int32)
            c0 = time.perf_counter()
            h = a.make_prepped_xfer(op, lh, idx, rh, idx)
            mk = time.perf_counter() - c0
            tel = None
            ts = []
            for r in range(20):
                c1 = time.perf_counter(); a.transfer(h); spin(a, h); ts.append(time.perf_counter() - c1)
            print(f"64 MiB {op} as {ndesc:4d} desc: make {mk*1e6:.0f} us, median {np.median(ts)*1e3:.2f} ms "
                  f"= {TOTAL/np.median(ts)/1e9:.2f} GB/s (min {min(ts)*1e3:.2f} ms)")
            a.release_xfer_handle(h)
        lh.release(); rh.release()
    # descriptor-list build costs (host), median of 200
    import pickle
    def tm(fn, k=200):
        ts = []
        for _ in range(k):
            c = time.perf_counter(); r = fn(); ts.append(time.perf_counter() - c)
        return r, np.median(ts) * 1e6
    for n in (16, 1024):
        size = TOTAL // n
        tup = [(la + i * size, size, 0) for i in range(n)]
        arr = np.array(tup, dtype=np.uint64)
        _, t_tup = tm(lambda: a.get_xfer_descs(tup, "DRAM"))
        _, t_arr = tm(lambda: a.get_xfer_descs(arr, "DRAM"))
        rdl = a.get_xfer_descs([(ra + i * size, size, 0) for i in range(n)], "DRAM")
        blob, t_ser = tm(lambda: a.get_serialized_descs(rdl))
        _, t_de = tm(lambda: a.deserialize_descs(blob))
        lh, t_pl = tm(lambda: a.prep_xfer_dlist("", arr, "DRAM"), 20)
        rh, t_pr = tm(lambda: a.prep_xfer_dlist("B", rdl), 20)
        idx_l = list(range(n)); idx_a = np.arange(n, dtype=np.int32)
        h, t_ml = tm(lambda: a.make_prepped_xfer("WRITE", lh, idx_l, rh, idx_l), 50)
        h2, t_ma = tm(lambda: a.make_prepped_xfer("WRITE", lh, idx_a, rh, idx_a), 50)
        print(f"{n:5d} descs: get_xfer_descs tuples {t_tup:.1f} us, Nx3 array {t_arr:.1f} us; "
              f"pickle {len(blob)} B {t_ser:.1f} us, unpickle {t_de:.1f} us; prep local {t_pl:.1f} us,"
              f" prep remote {t_pr:.1f} us; make_prepped list idx {t_ml:.1f} us, int32 idx {t_ma:.1f} us")
    # strided Nx5 (address, len, dev, stride, count): 8 blocks of 64 KiB every 1 MiB, as 1 row
    t[:] = 3
    st_l = np.array([[la, 64 << 10, 0, 1 << 20, 8]], dtype=np.uint64)
    st_r = np.array([[ra, 64 << 10, 0, 1 << 20, 8]], dtype=np.uint64)
    try:
        lh = a.prep_xfer_dlist("", st_l, "DRAM"); rh = a.prep_xfer_dlist("B", st_r, "DRAM")
        h = a.make_prepped_xfer("READ", lh, np.arange(8, dtype=np.int32), rh, np.arange(8, dtype=np.int32))
        t[:] = 0
        a.transfer(h); spin(a, h)
        got = [int(t[i << 20]) for i in range(8)] + [int(t[(1 << 20) - 1]), int(t[64 << 10])]
        print(f"strided Nx5 prep (1 row -> 8 descs) READ: DONE; block starts {got[:8]} (expect 3s), "
              f"byte 1MiB-1={got[8]} and 64KiB={got[9]} (expect 0: untouched gaps)")
    except Exception as e:
        print(f"strided Nx5 prep: {type(e).__name__}: {e}")
    t[:] = 3
    # data check: last READ brought B's zeros? B's buffer got our 3s from WRITEs
    print("data check (A buf == 3 after READ back of B):", bool((t == 3).all()))
    st.set("A/done", b"1")
    child.wait()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "B":
        target(sys.argv[2])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
