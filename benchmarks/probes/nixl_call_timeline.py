"""Where one Resharder call over NIXL spends its time: benchmarks/reshard.py's ranks and caches
(Llama-3.1-70B blocks on two GPUs, kvbm_ext.nixl.NixlTransport, UCX), one direction and nb,
check=False.  After warm-up calls, each rank makes one call from an idle device, noting the
host's time (CLOCK_MONOTONIC, one clock for both processes of the host) at each step of the
call's protocol: the call, the packs enqueued, each notification sent and taken in (READY,
DATA), each WRITE posted and seen DONE, each unpack enqueued, the job's end, the call's
return; and the driver's steps (how many, how long).  Rank 0 prints both ranks' points in
one list, in microseconds from rank 0's call.  --rounds calls, one after another.

    python3 benchmarks/probes/nixl_call_timeline.py [--direction 1to2] [--nb 64] [--rounds 3] [--steps] [--device cpu]
"""
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reshard as bench  # noqa: E402


class Points:
    def __init__(self):
        self.points, self.active, self.steps, self.step_s = [], False, 0, 0.0
        self.done = set()       # the WRITE handles seen DONE in this call (they are reused across calls)

    def note(self, what):
        if self.active:
            self.points.append((time.monotonic(), what))


def instrument(points, transport):
    """Wraps the agent's notification, WRITE and state calls, the inbox, the exchange's
    unpacks and the driver's steps of every NixlCall."""
    from kvbm_ext import _nixl_call, _nixl_wire, _pieces

    agent = transport._agent
    send_notif, transfer, state = agent.send_notif, agent.transfer, agent.check_xfer_state

    def kind(message):
        try:
            return _nixl_wire.KINDS.get(_nixl_wire.decode(message).kind, "?")
        except Exception:  # noqa: BLE001 - a probe: name what it cannot read
            return "?"

    def timed_send_notif(name, message):
        points.note(f"notif out {kind(message)}")
        return send_notif(name, message)

    def timed_transfer(handle, message=b""):
        points.note(f"WRITE posted ({kind(message)} attached)")
        return transfer(handle, message)

    def timed_state(handle):
        out = state(handle)
        if out == "DONE" and points.active and id(handle) not in points.done:
            points.done.add(id(handle))
            points.note("WRITE seen DONE")
        return out

    agent.send_notif, agent.transfer, agent.check_xfer_state = timed_send_notif, timed_transfer, timed_state
    route = transport._route

    def timed_route(note):
        points.note(f"notif in {_nixl_wire.KINDS.get(note.kind, '?')}")
        return route(note)

    transport._route = timed_route
    made = _pieces.Exchange.__init__

    def timed_init(self, **kwargs):
        unpack = kwargs["unpack"]

        def timed_unpack(j, p, on):
            unpack(j, p, on)
            points.note(f"unpack {p} enqueued")

        kwargs["unpack"] = timed_unpack
        made(self, **kwargs)

    _pieces.Exchange.__init__ = timed_init
    init, step, finish = _nixl_call.NixlCall.__init__, _nixl_call.NixlCall.step, _nixl_call.NixlCall._finish

    def timed_call_init(self, *args):
        init(self, *args)
        points.note("packs enqueued, job made")

    def timed_step(self):
        t0 = time.monotonic()
        try:
            return step(self)
        finally:
            if points.active:
                points.steps += 1
                points.step_s += time.monotonic() - t0

    def timed_finish(self):
        points.note("job finishes")
        finish(self)

    _nixl_call.NixlCall.__init__, _nixl_call.NixlCall.step = timed_call_init, timed_step
    _nixl_call.NixlCall._finish = timed_finish


def instrument_call(points):
    """Notes the end of each step of Resharder._call before the job is made."""
    from kvbm_ext import _reshard

    for name in ("_finish_previous", "_describe", "_device", "_stream", "_check_destination", "_check_source",
                 "_prepare", "_exchange"):
        def timed(self, *args, _method=getattr(_reshard.Resharder, name), _name=name):
            out = _method(self, *args)
            points.note(f"  {_name} done")
            return out

        setattr(_reshard.Resharder, name, timed)
    on_stream = _reshard._on_stream

    def timed_on_stream(device, stream):
        context = on_stream(device, stream)
        enter = context.__enter__

        class Noted:
            def __enter__(self):
                out = enter()
                points.note("  _on_stream entered")
                return out

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Noted()

    _reshard._on_stream = timed_on_stream


def child(rank, mine, args, folder):
    points = Points()
    me = bench.Rank(rank, args, folder)
    instrument(points, me.nixl)
    if mine.steps:
        instrument_call(points)
    src, dst = bench.DIRECTIONS[mine.direction]
    resharder = bench.kvbm_ext.Resharder(bench.NH, args.layers, src, dst, transport=me.nixl)
    call = bench.probe_call(me, resharder, (src, dst), mine.nb)
    for _ in range(mine.rounds):
        me.sync()
        dist.barrier()
        points.active = True
        points.note("call")
        call()
        points.note("returned")
        points.active = False
        mine_now = (points.points, points.steps, points.step_s)
        points.points, points.steps, points.step_s, points.done = [], 0, 0.0, set()
        gathered = [None] * bench.WORLD
        dist.all_gather_object(gathered, mine_now)
        if rank == 0:
            t0 = gathered[0][0][0][0]
            merged = sorted((t, r, what) for r, (pts, _, _) in enumerate(gathered) for t, what in pts)
            lines = [f"{mine.direction} nb={mine.nb}: host us from rank 0's call"]
            lines += [f"  {(t - t0) * 1e6:8.1f}  rank {r}  {what}" for t, r, what in merged]
            lines += [f"  rank {r}: {steps} driver steps, {step_s * 1e6:.0f} us in them"
                      for r, (_, steps, step_s) in enumerate(gathered)]
            print("\n".join(lines), flush=True)
    me.nixl.close()
    dist.destroy_process_group()


def main():
    bench.timeline_probe(__doc__, child, "nixl", extra=(
        (("--steps",), {"action": "store_true", "help": "also note the end of each step of the call's setup"}),
        (("--device",), {"default": "cuda", "choices": ("cuda", "cpu"), "help": "cpu: host caches, to check it runs"})))


if __name__ == "__main__":
    main()
