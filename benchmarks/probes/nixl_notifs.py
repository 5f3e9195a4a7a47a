"""Notifications (NIXL 1.5.1, UCX, two processes, DRAM).

  PYTHONPATH=/work/nixl-site python3 nixl_notifs.py            # UCX default (cma data, tcp AM)
  UCX_TLS=tcp PYTHONPATH=/work/nixl-site python3 nixl_notifs.py

1. data-before-notif: 300 WRITEs (4 MiB, 16 x 256 KiB descs) of value k into slot k%8 with
   notif b"k"; B checks the whole slot on each notif. A waits for DONE per WRITE (the notif
   only leaves on DONE), window of 8 then waits for B's ack (B -> A send_notif).
2. initiator that does not poll: WRITE 64 MiB + notif, A sleeps 3 s without check_xfer_state.
3. send_notif sizes; transfer-attached notif size; order of 1000 standalone notifs.
4. re-post: which notif does transfer(h) / transfer(h, b"x") send.
5. B.send_notif("A") before B loaded A's metadata.
"""
import sys
import time

import numpy as np
import torch

from nixl_common import buf, make_agent, spawn_child, store_client, store_host

SLOT = 4 << 20
NSLOT = 8
BIG = 64 << 20


def drain(b, into):
    n = b.get_new_notifs()
    for k, v in n.items():
        into.extend(v)
    return n


def target(port):
    st = store_client(port)
    b = make_agent("B")
    t, addr = buf(NSLOT * SLOT + BIG, fill=0)
    reg = b.register_memory([(addr, t.numel(), 0, "")], "DRAM")
    st.set("md/B", b.get_agent_metadata())
    st.set("addr/B", str(addr))
    # 5: B has not loaded A's metadata
    st.wait(["A/connected"])
    try:
        b.send_notif("A", b"x")
        print("[B] send_notif(A) without A's metadata: OK")
    except Exception as e:
        print(f"[B] send_notif(A) without A's metadata: {type(e).__name__}: {e}")
    b.add_remote_agent(st.get("md/A"))
    st.set("B/ready", b"1")
    # 1: ordering
    bad = 0
    got = 0
    while got < 300:
        for m in b.get_new_notifs().get("A", []):
            k = int(m)
            s = t[(k % NSLOT) * SLOT:(k % NSLOT + 1) * SLOT]
            v = k % 251 + 1
            if not bool((s == v).all()):
                bad += 1
            got += 1
            if got % NSLOT == 0:
                b.send_notif("A", b"ack")
    print(f"[B] 1. ordering: {got} notifs, slots not fully written at notif time: {bad}", flush=True)
    # 2: non-polling initiator
    msgs = []
    t0 = time.time()
    while time.time() - t0 < 3.0:
        drain(b, msgs)
    tail = t[NSLOT * SLOT:]
    print(f"[B] 2. during A's 3 s without polling: notifs {msgs}, big region value "
          f"min {int(tail.min())} max {int(tail.max())}", flush=True)
    st.set("B/2a", b"1")
    st.wait(["A/2b"])
    t0 = time.time()
    while time.time() - t0 < 1.0:
        drain(b, msgs)
    print(f"[B] 2. after A polled: notifs {msgs}, big region all 42: {bool((tail == 42).all())}",
          flush=True)
    # 3: sizes + order
    msgs = []
    st.set("B/3", b"1")
    t0 = time.time()
    while not st.check(["A/3done"]) or time.time() - t0 < 0.5:
        drain(b, msgs)
        if st.check(["A/3done"]) and t0 == 0:
            t0 = time.time()
    for _ in range(200):
        drain(b, msgs)
        time.sleep(0.005)
    sizes = [len(m) for m in msgs if not m.startswith(b"seq")]
    seq = [int(m[3:]) for m in msgs if m.startswith(b"seq")]
    print(f"[B] 3. received sizes {sizes}", flush=True)
    print(f"[B] 3. {len(seq)} seq notifs, in order: {seq == sorted(seq)}", flush=True)
    # 4: repost
    msgs = []
    st.set("B/4", b"1")
    st.wait(["A/4done"])
    for _ in range(200):
        drain(b, msgs)
        time.sleep(0.005)
    print(f"[B] 4. re-post notifs in arrival order: {msgs}", flush=True)
    st.set("B/done", b"1")
    b.deregister_memory(reg)


def spin(a, h):
    while (s := a.check_xfer_state(h)) == "PROC":
        pass
    return s


def main():
    st = store_host()
    child = spawn_child(__file__, st.port)
    a = make_agent("A")
    t, la = buf(NSLOT * SLOT + BIG, fill=0)
    a.register_memory([(la, t.numel(), 0, "")], "DRAM")
    st.set("md/A", a.get_agent_metadata())
    st.wait(["md/B", "addr/B"])
    a.add_remote_agent(st.get("md/B"))
    ra = int(st.get("addr/B"))
    st.set("A/connected", b"1")
    st.wait(["B/ready"])
    # 1
    nd = 16
    d = SLOT // nd
    lrows = [(la + i * d, d, 0) for i in range(NSLOT * nd)]
    rrows = [(ra + i * d, d, 0) for i in range(NSLOT * nd)]
    lh = a.prep_xfer_dlist("", lrows, "DRAM")
    rh = a.prep_xfer_dlist("B", rrows, "DRAM")
    acks = 0
    t0 = time.perf_counter()
    for k in range(300):
        j = k % NSLOT
        t[j * SLOT:(j + 1) * SLOT].fill_(k % 251 + 1)
        idx = list(range(j * nd, (j + 1) * nd))
        h = a.make_prepped_xfer("WRITE", lh, idx, rh, idx, str(k).encode())
        a.transfer(h)
        assert spin(a, h) == "DONE"
        a.release_xfer_handle(h)
        if k % NSLOT == NSLOT - 1:
            while acks < (k + 1) // NSLOT:
                acks += len(a.get_new_notifs().get("B", []))
    print(f"[A] 1. 300 WRITE+notif done in {time.perf_counter()-t0:.2f} s")
    # 2
    t[NSLOT * SLOT:].fill_(42)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(la + NSLOT * SLOT, BIG, 0)], "DRAM"),
                          a.get_xfer_descs([(ra + NSLOT * SLOT, BIG, 0)], "DRAM"), "B", b"big")
    s = a.transfer(h)
    print(f"[A] 2. transfer(64 MiB + notif) returned {s}; sleeping 3 s without polling")
    st.wait(["B/2a"])
    print(f"[A] 2. now polling: {spin(a, h)}")
    st.set("A/2b", b"1")
    # 3
    st.wait(["B/3"])
    for n in (1, 1024, 8192, 65536, 1 << 20, 16 << 20, 64 << 20):
        try:
            a.send_notif("B", b"z" * n)
        except Exception as e:
            print(f"[A] 3. send_notif {n} B: {type(e).__name__}: {e}")
    # transfer-attached notif of 1 MiB
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([lrows[0]], "DRAM"),
                          a.get_xfer_descs([rrows[0]], "DRAM"), "B", b"y" * (1 << 20))
    a.transfer(h)
    print(f"[A] 3. WRITE with 1 MiB notif: {spin(a, h)}")
    t0 = time.perf_counter()
    for i in range(1000):
        a.send_notif("B", b"seq%d" % i)
    print(f"[A] 3. 1000 send_notif: {(time.perf_counter()-t0)*1e3:.1f} ms")
    st.set("A/3done", b"1")
    # 4
    st.wait(["B/4"])
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0], b"created-with")
    for arg in (None, b"override", None, b""):
        a.transfer(h) if arg is None else a.transfer(h, arg)
        spin(a, h)
        time.sleep(0.05)
    # re-post while in flight
    h2 = a.initialize_xfer("WRITE", a.get_xfer_descs([(la + NSLOT * SLOT, BIG, 0)], "DRAM"),
                           a.get_xfer_descs([(ra + NSLOT * SLOT, BIG, 0)], "DRAM"), "B")
    r = a.transfer(h2)
    try:
        r2 = a.transfer(h2)
        print(f"[A] 4. transfer(h) while its previous post is {r}: returned {r2}")
    except Exception as e:
        print(f"[A] 4. transfer(h) while its previous post is {r}: {type(e).__name__}: {e}")
    spin(a, h2)
    st.set("A/4done", b"1")
    st.wait(["B/done"])
    child.wait()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "B":
        target(sys.argv[2])
    else:
        main()
