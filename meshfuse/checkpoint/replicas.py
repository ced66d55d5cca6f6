"""Tensors every rank of a host holds whole (replicated: norms, biases, AdamW's steps) are
read from storage once per host: each is assigned to one rank of the host (round robin, by
name), which reads it; the others receive it from that rank by a broadcast in the host's
group after the read. Without torch.distributed, or alone on its host, a rank reads all.
"""

from __future__ import annotations

import functools
import socket

import torch.distributed as dist

from meshfuse.checkpoint.chunks import ShardedValue


@functools.cache
def host_group() -> tuple[object, tuple[int, ...]] | None:
    """This rank's host: a gloo group of its ranks and their global ranks (every rank makes
    every host's group, in the same order); None without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    mine = None
    for host in sorted(set(hosts)):
        ranks = tuple(r for r, h in enumerate(hosts) if h == host)
        group = dist.new_group(list(ranks), backend="gloo")
        if host == hosts[dist.get_rank()]:
            mine = (group, ranks)
    return mine


def _whole(value) -> bool:
    return isinstance(value, ShardedValue) and len(value.chunks) == 1 and \
        value.chunks[0].sizes == tuple(value.shape) and not value.flat  # flat: another shape


def shared_reads(staged: dict[str, object]) -> list[tuple[str, int]]:
    """The tensors every rank of this host holds whole, each with the global rank that
    reads it for the host (collective over the host's ranks)."""
    host = host_group()
    if host is None or len(host[1]) == 1:
        return []
    group, ranks = host
    whole = sorted(name for name, value in staged.items() if _whole(value))
    lists = [None] * len(ranks)
    dist.all_gather_object(lists, whole, group=group)
    common = sorted(set.intersection(*(set(names) for names in lists)))
    return [(name, ranks[i % len(ranks)]) for i, name in enumerate(common)]


def share(staged: dict[str, object], shared: list[tuple[str, int]]) -> None:
    """Sends each shared tensor from its reader to the other ranks of the host (through host
    memory: the host group is gloo's)."""
    if not shared:
        return
    group, _ = host_group()
    for name, reader in shared:
        local = staged[name].local
        buffer = local.cpu().contiguous()
        dist.broadcast(buffer, src=reader, group=group)
        if dist.get_rank() != reader:
            local.copy_(buffer)
