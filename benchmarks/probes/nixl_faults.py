"""Peer death and restart (NIXL 1.5.1, UCX, two processes, DRAM).

  PYTHONPATH=/work/nixl-site python3 nixl_faults.py [kill|kill_idle|stop]   # UCX default (cma data, tcp AM)
  UCX_TLS=tcp PYTHONPATH=/work/nixl-site python3 nixl_faults.py [kill|kill_idle|stop]
kill: SIGKILL with a WRITE in flight; kill_idle: SIGKILL between transfers, next WRITE posted
at once; stop: SIGSTOP (frozen peer, socket stays open), poll 30 s, release the PROC handle,\nthen SIGKILL.

1. B (target) is killed with SIGKILL while A's 64 MiB WRITE is in flight (posted as 64
   re-posts of 1 MiB descriptors: 64 descs/transfer), then A: check_xfer_state on the
   in-flight handle, a new transfer, get_new_notifs, send_notif, check_remote_metadata,
   release of the failed handle.
2. A new B process with the same agent name: add_remote_agent(new md) without removal,
   then remove_remote_agent + add_remote_agent, WRITE+notif, READ back.
"""
import os
import signal
import sys
import time

import numpy as np

from nixl_common import buf, make_agent, spawn_child, store_client, store_host

TOTAL = 64 << 20
NDESC = 64


def target(port, inc):
    st = store_client(port)
    b = make_agent("B")
    t, addr = buf(TOTAL, fill=0)
    reg = b.register_memory([(addr, TOTAL, 0, "")], "DRAM")
    st.set(f"md/B/{inc}", b.get_agent_metadata())
    st.set(f"addr/B/{inc}", str(addr))
    got = []
    while not st.check([f"A/done/{inc}"]):
        n = b.get_new_notifs()
        got += n.get("A", []) + n.get(b"A", [])
        time.sleep(0.001)
    print(f"[B{inc}] notifs {got}, buf all 5: {bool((t == 5).all())}", flush=True)
    b.deregister_memory(reg)


def timed(label, fn):
    t0 = time.perf_counter()
    try:
        r = fn()
        print(f"  {label}: -> {r!r} in {1e3*(time.perf_counter()-t0):.2f} ms", flush=True)
        return r
    except Exception as e:
        print(f"  {label}: RAISED {type(e).__name__}: {e} after "
              f"{1e3*(time.perf_counter()-t0):.2f} ms", flush=True)
        return e


def poll_until(a, h, timeout):
    t0 = time.perf_counter()
    seen = []
    while time.perf_counter() - t0 < timeout:
        try:
            s = a.check_xfer_state(h)
        except Exception as e:
            return f"RAISED {type(e).__name__}: {e}", time.perf_counter() - t0, seen
        if not seen or seen[-1] != s:
            seen.append(s)
        if s != "PROC":
            return s, time.perf_counter() - t0, seen
    return "STILL PROC (timeout)", time.perf_counter() - t0, seen


def connect(a, st, inc):
    st.wait([f"md/B/{inc}", f"addr/B/{inc}"])
    return st.get(f"md/B/{inc}"), int(st.get(f"addr/B/{inc}"))


def main(mode):
    st = store_host()
    child = spawn_child(__file__, st.port, 1)
    a = make_agent("A")
    t, la = buf(TOTAL, fill=5)
    a.register_memory([(la, TOTAL, 0, "")], "DRAM")
    md, ra = connect(a, st, 1)
    a.add_remote_agent(md)
    sz = TOTAL // NDESC
    ld = a.get_xfer_descs([(la + i * sz, sz, 0) for i in range(NDESC)], "DRAM")
    rd = a.get_xfer_descs([(ra + i * sz, sz, 0) for i in range(NDESC)], "DRAM")
    h = a.initialize_xfer("WRITE", ld, rd, "B", b"hello-1")
    a.transfer(h)
    print("warm-up WRITE:", poll_until(a, h, 30)[:2])
    print("check_remote_metadata(B) while alive:", a.check_remote_metadata("B"))

    print(f"== 1. {mode}: B with a WRITE in flight")
    if mode == "kill_idle":
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        s0 = timed("transfer() right after SIGKILL", lambda: a.transfer(h))
    else:
        s0 = a.transfer(h)
        os.kill(child.pid, signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
    tk = time.perf_counter()
    print(f"  transfer() returned {s0} (kill/stop right after it, unless kill_idle)")
    r, dt, seen = poll_until(a, h, 30 if mode == "stop" else 120)
    print(f"  in-flight handle: {r} after {dt*1e3:.1f} ms (states seen {seen})")
    if mode == "stop" and r.startswith("STILL"):
        # release of a handle still in PROC: cancels? raises?
        timed("release_xfer_handle(PROC handle) while peer frozen", lambda: a.release_xfer_handle(h))
        h = a.initialize_xfer("WRITE", ld, rd, "B")
    if mode == "stop":
        timed("get_new_notifs() while peer frozen", a.get_new_notifs)
        timed("send_notif(B) while peer frozen", lambda: a.send_notif("B", b"frozen?"))
        os.kill(child.pid, signal.SIGKILL)
        r, dt, seen = poll_until(a, h, 120)
        print(f"  after SIGKILL of the frozen peer: {r} after {dt*1e3:.1f} ms")
    child.wait()
    time.sleep(0.5)
    print("  --- after the peer is gone (0.5 s later):")
    timed("check_remote_metadata(B)", lambda: a.check_remote_metadata("B"))
    timed("get_new_notifs()", a.get_new_notifs)
    timed("send_notif(B)", lambda: a.send_notif("B", b"anyone?"))
    timed("transfer(old handle) re-post", lambda: a.transfer(h))
    timed("check_xfer_state(old handle)", lambda: a.check_xfer_state(h))
    h2 = timed("initialize_xfer(new)", lambda: a.initialize_xfer("WRITE", ld, rd, "B"))
    if not isinstance(h2, Exception):
        s = timed("transfer(new)", lambda: a.transfer(h2))
        r, dt, seen = poll_until(a, h2, 60)
        print(f"  new handle: {r} after {dt*1e3:.1f} ms (states seen {seen})")
        timed("release_xfer_handle(new)", lambda: a.release_xfer_handle(h2))
    timed("release_xfer_handle(failed)", lambda: a.release_xfer_handle(h))
    timed("make_connection(B)", lambda: a.make_connection("B"))
    print(f"  (total since kill {time.perf_counter()-tk:.2f} s)")

    print("== 2. restart: new process, same name B")
    child = spawn_child(__file__, st.port, 2)
    md2, ra2 = connect(a, st, 2)
    timed("add_remote_agent(new md) without remove", lambda: a.add_remote_agent(md2))
    timed("remove_remote_agent(B)", lambda: a.remove_remote_agent("B"))
    timed("check_remote_metadata(B) after remove", lambda: a.check_remote_metadata("B"))
    timed("add_remote_agent(new md)", lambda: a.add_remote_agent(md2))
    rd2 = a.get_xfer_descs([(ra2 + i * sz, sz, 0) for i in range(NDESC)], "DRAM")
    h3 = timed("initialize_xfer(new peer)", lambda: a.initialize_xfer("WRITE", ld, rd2, "B", b"hello-2"))
    timed("transfer", lambda: a.transfer(h3))
    r, dt, seen = poll_until(a, h3, 60)
    print(f"  WRITE to restarted B: {r} after {dt*1e3:.1f} ms")
    t.fill_(0)
    h4 = a.initialize_xfer("READ", ld, rd2, "B")
    a.transfer(h4)
    r, dt, seen = poll_until(a, h4, 60)
    print(f"  READ back: {r}, data ok {bool((t == 5).all())}")
    time.sleep(0.2)
    st.set("A/done/2", b"1")
    child.wait()
    print("== 3. remove_remote_agent on a live peer then transfer with old descs")
    # (B2 has exited now; this shows what a removed name gives)
    timed("remove_remote_agent(B)", lambda: a.remove_remote_agent("B"))
    timed("initialize_xfer to removed B", lambda: a.initialize_xfer("WRITE", ld, rd2, "B"))
    timed("remove_remote_agent(B) twice", lambda: a.remove_remote_agent("B"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "B":
        target(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "kill")
