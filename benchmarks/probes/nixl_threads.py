"""Thread use of one agent (NIXL 1.5.1, UCX, two processes, DRAM).

  PYTHONPATH=/work/nixl-site python3 nixl_threads.py [NONE|STRICT|RW] [num_threads]

Main thread: make_prepped_xfer + transfer (64 KiB WRITE, 16 handles in flight at most);
background thread: check_xfer_state on the posted handles, release_xfer_handle when DONE,
and get_new_notifs. 20000 transfers. Also: does a NIXL call release the GIL (a counter
thread runs while transfer() moves 64 MiB inside the call)?
The default sync_mode of nixl_agent_config is NONE unless enable_listen_thread=True.
"""
import queue
import sys
import threading
import time

from nixl_common import buf, make_agent, spawn_child, store_client, store_host
from nixl_cu13._api import nixl_thread_sync_t

TOTAL = 64 << 20
N = 20000


def target(port):
    st = store_client(port)
    b = make_agent("B")
    t, addr = buf(TOTAL, fill=0)
    b.register_memory([(addr, TOTAL, 0, "")], "DRAM")
    st.set("md/B", b.get_agent_metadata())
    st.set("addr/B", str(addr))
    st.wait(["A/done"], __import__("datetime").timedelta(seconds=600))


def main(mode, nthreads):
    st = store_host()
    child = spawn_child(__file__, st.port)
    sync = None if mode == "default" else getattr(nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{mode}")
    a = make_agent("A", sync_mode=sync, num_threads=nthreads)
    t, la = buf(TOTAL, fill=1)
    a.register_memory([(la, TOTAL, 0, "")], "DRAM")
    st.wait(["md/B", "addr/B"])
    a.add_remote_agent(st.get("md/B"))
    ra = int(st.get("addr/B"))
    sz = 64 << 10
    n = TOTAL // sz
    lh = a.prep_xfer_dlist("", [(la + i * sz, sz, 0) for i in range(n)], "DRAM")
    rh = a.prep_xfer_dlist("B", [(ra + i * sz, sz, 0) for i in range(n)], "DRAM")

    # GIL: count Python iterations in a thread while transfer() of 64 MiB runs in another
    whole_l = a.get_xfer_descs([(la, TOTAL, 0)], "DRAM")
    whole_r = a.get_xfer_descs([(ra, TOTAL, 0)], "DRAM")
    hb = a.initialize_xfer("WRITE", whole_l, whole_r, "B")
    cnt = [0]
    stop = [False]

    def counter():
        while not stop[0]:
            cnt[0] += 1
    a.transfer(hb)
    while a.check_xfer_state(hb) == "PROC":
        pass
    th = threading.Thread(target=counter)
    th.start()
    time.sleep(0.05)
    c0 = cnt[0]; t0 = time.perf_counter()
    r = a.transfer(hb)
    t1 = time.perf_counter(); c1 = cnt[0]
    time.sleep(t1 - t0)
    c2 = cnt[0]
    stop[0] = True; th.join()
    while a.check_xfer_state(hb) == "PROC":
        pass
    print(f"[{mode}] GIL: during transfer() of 64 MiB ({(t1-t0)*1e3:.1f} ms, returned {r}) the "
          f"counter thread ran {c1-c0} iterations vs {c2-c1} in the same time after it")

    q = queue.Queue(maxsize=16)
    errs = []
    done = [0]

    def poller():
        pending = []
        while done[0] < N:
            try:
                while True:
                    pending.append(q.get_nowait())
            except queue.Empty:
                pass
            keep = []
            for h in pending:
                try:
                    s = a.check_xfer_state(h)
                except Exception as e:
                    errs.append(repr(e)); s = "ERR"
                if s == "PROC":
                    keep.append(h)
                else:
                    if s != "DONE":
                        errs.append(s)
                    a.release_xfer_handle(h)
                    done[0] += 1
            pending = keep
            a.get_new_notifs()

    th = threading.Thread(target=poller)
    th.start()
    t0 = time.perf_counter()
    for k in range(N):
        i = k % n
        try:
            h = a.make_prepped_xfer("WRITE", lh, [i], rh, [i])
            a.transfer(h)
        except Exception as e:
            errs.append(repr(e)); done[0] += 1
            continue
        q.put(h)
    th.join()
    dt = time.perf_counter() - t0
    print(f"[{mode}] num_threads={nthreads}: {N} transfers posted on main, polled+released on "
          f"a 2nd thread: {dt:.2f} s ({dt/N*1e6:.1f} us each), errors {len(errs)} {errs[:3]}")
    st.set("A/done", b"1")
    child.wait()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "B":
        target(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "default",
             int(sys.argv[2]) if len(sys.argv) > 2 else 0)
