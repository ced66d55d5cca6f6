"""GPU reproduction of the copy-engine ring's stop at s=32768 (issue 14), in two parts.

    torchrun --nproc-per-node 2 -m benchmarks.cp_copy_engine_repro OUT raw_unsynced
    torchrun --nproc-per-node 2 -m benchmarks.cp_copy_engine_repro OUT raw_synced
    torchrun --nproc-per-node 2 -m benchmarks.cp_copy_engine_repro OUT ring [--seq 32768]

**The suspected cause.** A symmetric allocation of torch 2.11 zeroes its signal pad with a
``cudaMemset`` that the host does not wait for: it runs when this rank's queued kernels
have run. The rendezvous then hands the allocation to the peers, and a peer that is ahead
may put its barrier signal into the pad *before* the zeroing lands: the zeroing erases it,
and the barrier waits for a signal that never comes. In the benchmark the slots of the
backward are made while the forward's kernels (milliseconds at s=32768) are still queued;
in the small CUDA tests the queue is nearly empty, so the signal came after the zeroing.

``raw_unsynced`` / ``raw_synced`` test that with torch's API alone: rank 1 queues a
sleep kernel (``--delay-ms``), both ranks allocate, rendezvous and run one barrier on a side
stream that waits for the current stream (as ``meshfuse.runtime.comm.peer_copy`` does), with a
barrier limit of ``--barrier-ms``. Unsynced, if the cause is right, rank 1's barrier times
out (a device error: the process ends); ``raw_synced`` synchronizes the device between the
allocation and the rendezvous (the fix in ``peer_copy``) and passes.

``ring`` runs the benchmark's attention (causal bf16 forward+backward, b=1, h=32, head dim
128, zig-zag split) with ``MESHFUSE_CP_TRANSPORT=copy_engine``, its barriers limited to
``--barrier-ms``: the first call (the slots are made in it) compared with the NCCL ring's
result, then ``--calls`` calls back to back against as many of the NCCL ring, timed with
CUDA events. Each rank logs every shift as the host launches it (``ring_rank<r>.log``,
flushed, so a stop shows how far the host got) and writes ``ring_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

import meshfuse
from benchmarks import context
from benchmarks.cases.context_parallel import SIZES, CausalAttention, global_inputs
from meshfuse.runtime.comm import peer_copy

SLEEP_CYCLES_PER_MS = 2_000_000  # an H200's SM clock is below 2 GHz: at least a millisecond


def _write(out: str, name: str, payload: dict) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(payload, f, indent=1)


def raw(ctx, out: str, synced: bool, delay_ms: int, barrier_ms: int) -> dict:
    """One allocation, rendezvous and barrier, rank 1's device busy for ``delay_ms``."""
    group = dist.group.WORLD
    side = torch.cuda.Stream()
    ctx.barrier()
    if ctx.rank == 1:
        torch.cuda._sleep(delay_ms * SLEEP_CYCLES_PER_MS)
    start = time.perf_counter()
    buffer = symm_mem.empty(1 << 20, dtype=torch.uint8, device=ctx.device)
    if synced:
        torch.cuda.synchronize(ctx.device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        handle.barrier(channel=0, timeout_ms=barrier_ms)
        handle.barrier(channel=0, timeout_ms=barrier_ms)  # a second one, as a shift makes
    result = {"rank": ctx.rank, "synced": synced, "delay_ms": delay_ms}
    try:
        torch.cuda.synchronize(ctx.device)
        result.update(ok=True, seconds=round(time.perf_counter() - start, 3))
    except RuntimeError as error:  # a barrier that timed out traps: the context is gone
        result.update(ok=False, error=str(error)[:500],
                      seconds=round(time.perf_counter() - start, 3))
    _write(out, f"raw_{'synced' if synced else 'unsynced'}_rank{ctx.rank}.json", result)
    print(json.dumps(result), flush=True)
    if not result["ok"]:
        os._exit(3)  # no collective can run on a failed context
    return result


def _logged_shifts(log):
    """Wraps peer_copy.shift to log each launch (host side, no synchronization)."""
    shift = peer_copy.shift

    def logged(tensors, process_group, after, name, into=None):
        log.write(f"{time.perf_counter():.6f} shift {name} "
                  f"{[tuple(t.shape) for t in tensors]}\n")
        log.flush()
        return shift(tensors, process_group, after, name, into)

    peer_copy.shift = logged


def _program(ctx, s: int, transport: str):
    os.environ["MESHFUSE_CP_TRANSPORT"] = transport  # read when the program is built
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    fd = CausalAttention(SIZES, s, True, mesh, True, "ring")
    fd.define()
    full = global_inputs(ctx, SIZES, s)
    local = [meshfuse.shard_tensor(t, tv) for t, tv in zip(full, fd.tensors[:4])]
    return fd, local


def _compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _timed(ctx, fd, local, calls: int) -> list[float]:
    ctx.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for i in range(calls):
        fd.execute(local)
        events[i + 1].record()
    torch.cuda.synchronize(ctx.device)
    return [round(a.elapsed_time(b), 3) for a, b in itertools.pairwise(events)]


def ring(ctx, out: str, s: int, calls: int, barrier_ms: int) -> dict:
    """The copy-engine ring at ``s`` rows against the NCCL ring (see the module doc)."""
    peer_copy.BARRIER_TIMEOUT_MS = barrier_ms
    with open(os.path.join(out, f"ring_rank{ctx.rank}.log"), "w") as log:
        _logged_shifts(log)
        return _ring(ctx, out, s, calls, log)


def _ring(ctx, out: str, s: int, calls: int, log) -> dict:
    result = {"rank": ctx.rank, "seq": s}
    nccl, local = _program(ctx, s, "nccl")
    want = nccl.execute(local)
    ctx.barrier()
    copy, _ = _program(ctx, s, "copy_engine")
    log.write("first copy-engine call\n")
    log.flush()
    start = time.perf_counter()
    got = copy.execute(local)
    torch.cuda.synchronize(ctx.device)
    result["first_call_s"] = round(time.perf_counter() - start, 3)
    log.write("first copy-engine call done\n")
    log.flush()
    result["max_rel_err"] = max(
        ((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want))
    result["bitwise"] = all(torch.equal(g, w) for g, w in zip(got, want))
    del got, want
    result["graphs_compiled_by_first_calls"] = _compiled_graphs()
    for name, fd in (("nccl", nccl), ("copy_engine", copy), ("nccl_again", nccl),
                     ("copy_engine_again", copy)):
        times = _timed(ctx, fd, local, calls)
        result[f"{name}_ms"] = times
        result[f"{name}_median_ms"] = sorted(times)[len(times) // 2]
        log.write(f"{name} timed\n")
        log.flush()
    result["graphs_compiled_after_timed_calls"] = _compiled_graphs()  # equal: no recompile
    _write(out, f"ring_rank{ctx.rank}.json", result)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("mode", choices=("raw_unsynced", "raw_synced", "ring"))
    parser.add_argument("--delay-ms", type=int, default=300)
    parser.add_argument("--barrier-ms", type=int, default=10_000)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    ctx = context.setup(False)
    os.makedirs(args.out, exist_ok=True)
    if not ctx.cuda or ctx.world < 2:
        raise SystemExit("the copy-engine reproduction needs 2 CUDA ranks")
    try:
        if args.mode == "ring":
            ring(ctx, args.out, args.seq, args.calls, args.barrier_ms)
        else:
            raw(ctx, args.out, args.mode == "raw_synced", args.delay_ms, args.barrier_ms)
    finally:
        context.teardown()


if __name__ == "__main__":
    main()
