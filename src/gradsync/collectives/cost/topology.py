"""Ranks on hosts: the shape of a simulated (or real) group.

>>> Topology.uniform(2, 4).host_of()
[0, 0, 0, 0, 1, 1, 1, 1]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Ranks on hosts: ``host_sizes[h]`` ranks on host h, placed host by host (ranks 0..L-1 on host 0).

    Raises:
        ValueError: no host, or a host without ranks.
    """

    host_sizes: tuple[int, ...]

    def __post_init__(self):
        if not self.host_sizes or min(self.host_sizes) < 1:
            raise ValueError(f"every host needs at least one rank, got host sizes {self.host_sizes}")

    @classmethod
    def uniform(cls, hosts: int, ranks_per_host: int) -> "Topology":
        return cls((ranks_per_host,) * hosts)

    @property
    def world_size(self) -> int:
        return sum(self.host_sizes)

    @property
    def hosts(self) -> int:
        return len(self.host_sizes)

    def host_of(self) -> list[int]:
        """``host_of()[rank]``: the host of every rank."""
        return [host for host, size in enumerate(self.host_sizes) for _ in range(size)]

    def describe(self) -> str:
        sizes = set(self.host_sizes)
        if len(sizes) == 1:
            return f"{self.hosts} host{'s' if self.hosts > 1 else ''} x {self.host_sizes[0]} ranks"
        return f"hosts of {', '.join(map(str, self.host_sizes))} ranks"
