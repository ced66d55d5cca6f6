"""The exchange of token rows between the ranks of an expert-parallel group.

The experts are split over the group in blocks, as the weights' outer split cuts them:
``ceil(E / n)`` experts per rank, the last ranks holding fewer (or none). A rank's token
slots, sorted by expert, are also sorted by the rank that holds their expert, so the rows for
rank ``c`` are one block of the send buffer. :meth:`ExpertExchange.plan` exchanges the split
sizes (one small all-to-all of the slots per expert); ``dispatch`` and ``combine`` are one
ragged all-to-all each (``combine`` the transpose of ``dispatch``: the splits swapped).
"""

from __future__ import annotations

import torch

from meshfuse.ops.moe.kernels import Route
from meshfuse.runtime.comm.collectives import Group, exchange_split_sizes, ragged_all_to_all


def experts_per_rank(num_experts: int, size: int) -> int:
    return -(-num_experts // size)


class ExpertExchange:
    """The exchange of one rank of an expert-parallel group (see the module doc)."""

    def __init__(self, group: Group, num_experts: int):
        self.group, self.num_experts = group, num_experts
        self.per_rank = experts_per_rank(num_experts, group.size)
        self.first_expert = min(group.coordinate * self.per_rank, num_experts)
        self.local_experts = min(self.per_rank, num_experts - self.first_expert)

    def plan(self, send_counts: torch.Tensor) -> Route:
        """The route of this rank's slots, from ``send_counts`` (slots per expert, ``[E]``):
        one exchange of split sizes over the group."""
        n, per = self.group.size, self.per_rank
        padded = send_counts.new_zeros(n * per)
        padded[:self.num_experts] = send_counts
        by_rank = padded.reshape(n, per)
        received = exchange_split_sizes(by_rank, self.group)[:, :self.local_experts]
        local = torch.arange(self.local_experts, device=send_counts.device)
        experts = torch.repeat_interleave(local.repeat(n), received.reshape(-1))
        return Route(tuple(by_rank.sum(1).tolist()), tuple(received.sum(1).tolist()),
                     received.sum(0), torch.argsort(experts, stable=True))

    def dispatch(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        return ragged_all_to_all(rows, route.send_splits, route.recv_splits, self.group)

    def combine(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        return ragged_all_to_all(rows, route.recv_splits, route.send_splits, self.group)

