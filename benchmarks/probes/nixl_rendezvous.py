"""Metadata rendezvous between two processes that share no process group (NIXL 1.5.1, UCX).

  PYTHONPATH=/work/nixl-site python3 nixl_rendezvous.py [bytes|nixl_tcpstore|p2p|partial]

bytes:         caller moves get_agent_metadata() bytes through a torch TCPStore; add_remote_agent.
nixl_tcpstore: NIXL's own TCPStore metadata client (env NIXL_TCPSTORE_ENDPOINT=host:port, set
               before the agent is created): send_local_metadata() / fetch_remote_metadata(name)
               / poll check_remote_metadata(name).
p2p:           NIXL's listener thread (enable_listen_thread=True, listen_port=P):
               fetch_remote_metadata(name, ip, port) (peer sends its metadata back).
partial:       connection info first (get_partial_agent_metadata(empty, inc_conn_info=True)),
               buffers registered later, sent as partial metadata without conn info.
Each mode ends with a WRITE A->B with notification and a READ B->A, both verified.
Only A loads B's metadata (one direction) in bytes/partial; B never loads A's.
"""
import os
import sys
import time

from nixl_common import (buf, make_agent, spawn_child, store_client, store_host,
                         wait_done, wait_notif)
from nixl_cu13._bindings import nixlRegDList, DRAM_SEG

N = 1 << 20
P2P_PORT_B = 23456


def agent_for(role, mode):
    if mode == "p2p":
        return make_agent(role, enable_listen_thread=True,
                          listen_port=P2P_PORT_B if role == "B" else P2P_PORT_B + 1)
    return make_agent(role)


def target(port, mode):
    st = store_client(port)
    b = agent_for("B", mode)
    st.set("B/up", b"1")
    t, addr = buf(N, fill=0)
    if mode == "partial":
        empty = nixlRegDList(DRAM_SEG)
        st.set("conn/B", b.get_partial_agent_metadata(empty, inc_conn_info=True, backends=["UCX"]))
        st.wait(["A/connected"])
    reg = b.register_memory([(addr, N, 0, "")], "DRAM")
    if mode == "bytes":
        st.set("md/B", b.get_agent_metadata())
    elif mode == "nixl_tcpstore":
        b.send_local_metadata()
        time.sleep(0.2)  # publish runs on NIXL's worker thread
    elif mode == "partial":
        st.set("md/B", b.get_partial_agent_metadata(reg, inc_conn_info=False, backends=["UCX"]))
    # the remote side's xfer descriptors, as pickled nixlXferDList bytes
    st.set("descs/B", b.get_serialized_descs(b.get_xfer_descs([(addr, N, 0)], "DRAM")))
    msgs = wait_notif(b, "A", timeout=20)
    ok = bool((t == 7).all())
    print(f"[B] notif {msgs} data_ok={ok}", flush=True)
    t.fill_(9)  # for A's READ
    st.set("B/ready_for_read", b"1")
    st.wait(["A/done"])
    # invalidate_local_metadata: store mode deletes B's published keys; p2p mode tells A's
    # listener; with neither it has nowhere to send
    try:
        if mode == "p2p":
            b.invalidate_local_metadata("127.0.0.1", P2P_PORT_B + 1)
        else:
            b.invalidate_local_metadata()
        r = "ok"
    except Exception as e:
        r = f"{type(e).__name__}: {e}"
    print(f"[B] invalidate_local_metadata(): {r}", flush=True)
    time.sleep(0.5)
    st.set("B/invalidated", b"1")
    st.wait(["A/checked"])
    b.deregister_memory(reg)


def initiator(mode):
    st = store_host()
    env = {}
    if mode == "nixl_tcpstore":
        env["NIXL_TCPSTORE_ENDPOINT"] = f"127.0.0.1:{st.port}"
        os.environ["NIXL_TCPSTORE_ENDPOINT"] = env["NIXL_TCPSTORE_ENDPOINT"]
    child = spawn_child(__file__, st.port, mode, env=env)
    a = agent_for("A", mode)
    t, addr = buf(N, fill=7)
    reg = a.register_memory([(addr, N, 0, "")], "DRAM")
    st.wait(["B/up"])
    if mode != "partial":
        st.wait(["descs/B"])  # B has registered and published
    t0 = time.perf_counter()
    if mode == "bytes":
        st.wait(["md/B"])
        name = a.add_remote_agent(st.get("md/B"))
    elif mode == "nixl_tcpstore":
        a.fetch_remote_metadata("B")
        while not a.check_remote_metadata("B"):
            time.sleep(0.001)
        name = "B"
    elif mode == "p2p":
        # B's listener must be up: a fetch to a closed port logs "connection refused"
        # and is not retried (check_remote_metadata stays False forever)
        a.fetch_remote_metadata("B", "127.0.0.1", P2P_PORT_B)
        while not a.check_remote_metadata("B"):
            time.sleep(0.001)
        name = "B"
        a.send_local_metadata("127.0.0.1", P2P_PORT_B)  # lets B talk back, unused here
    elif mode == "partial":
        st.wait(["conn/B"])
        name = a.add_remote_agent(st.get("conn/B"))
        a.make_connection("B")
        st.set("A/connected", b"1")
        st.wait(["md/B"])
        a.add_remote_agent(st.get("md/B"))
    t_md = time.perf_counter() - t0
    st.wait(["descs/B"])
    rdescs = a.deserialize_descs(st.get("descs/B"))
    ldescs = a.get_xfer_descs([(addr, N, 0)], "DRAM")
    print(f"[A] mode={mode} remote={name!r} md_bytes={len(a.get_agent_metadata())} "
          f"rendezvous {t_md*1e3:.1f} ms, check_remote_metadata(B)={a.check_remote_metadata('B')}",
          flush=True)
    h = a.initialize_xfer("WRITE", ldescs, rdescs, "B", b"write-done")
    s0 = a.transfer(h)
    s, dt = wait_done(a, h)
    print(f"[A] WRITE transfer()={s0} -> {s} in {dt*1e3:.2f} ms", flush=True)
    a.release_xfer_handle(h)
    st.wait(["B/ready_for_read"])
    h = a.initialize_xfer("READ", ldescs, rdescs, "B")
    a.transfer(h)
    s, dt = wait_done(a, h)
    print(f"[A] READ -> {s} data_ok={bool((t == 9).all())}", flush=True)
    a.release_xfer_handle(h)
    if mode == "nixl_tcpstore":
        print("[A] store keys:", sorted(st.list_keys()))
    st.set("A/done", b"1")
    st.wait(["B/invalidated"])
    print(f"[A] after B's invalidate_local_metadata: check_remote_metadata(B)="
          f"{a.check_remote_metadata('B')}", flush=True)
    if mode == "nixl_tcpstore":
        print("[A] store keys:", sorted(st.list_keys()))
    h = a.initialize_xfer("READ", ldescs, rdescs, "B") if a.check_remote_metadata("B") else None
    if h is not None:
        a.transfer(h)
        print(f"[A] READ after invalidate: {wait_done(a, h)[0]}")
    st.set("A/checked", b"1")
    child.wait()
    print(f"[A] child rc={child.returncode}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "B":
        target(sys.argv[2], sys.argv[3])
    else:
        initiator(sys.argv[1] if len(sys.argv) > 1 else "bytes")
