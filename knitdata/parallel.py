"""Which data-parallel rank and which replica a process is, from a ``torch.distributed`` DeviceMesh or process groups.

knitdata's consumers are data-parallel ranks. The ranks of one tensor/pipeline-parallel group (the peers that hold
shards of one model replica) must all receive the same micro-batches: they are the *replicas* of one data-parallel
rank. :func:`replica_layout` reads this process's place from a ``DeviceMesh`` (its data-parallel dimensions give
the rank, the other dimensions the replica), :func:`from_process_groups` from a data-parallel group and the
tensor/pipeline-parallel groups; either :class:`ReplicaLayout` goes to
:meth:`Pipeline.dataset <knitdata.pipeline.Pipeline.dataset>`::

    layout = knitdata.replica_layout(mesh)             # mesh dims e.g. ("dp", "tp") or ("pp", "dp", "tp")
    ds = pipe.dataset(**layout.dataset_kwargs())       # rank=dp rank, replica=..., num_replicas=tp * pp

The pipeline's number of consumers is the data-parallel size (:attr:`ReplicaLayout.num_ranks`).

Example (no process group: a layout given by hand):
    >>> ReplicaLayout(rank=1, num_ranks=2, replica=0, num_replicas=2).dataset_kwargs()
    {'rank': 1, 'replica': 0, 'num_replicas': 2}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from knitdata.errors import ConfigError

__all__ = ["ReplicaLayout", "replica_layout", "from_process_groups"]


@dataclass(frozen=True)
class ReplicaLayout:
    """This process's place among the consumers: its data-parallel rank and its replica of that rank.

    Attributes:
        rank: The data-parallel rank (the pipeline's consumer).
        num_ranks: The data-parallel size (the pipeline's ``num_consumers``).
        replica: This process's replica of ``rank`` (its index in the tensor/pipeline-parallel group).
        num_replicas: Replicas per data-parallel rank (the tensor x pipeline-parallel size).
    """

    rank: int
    num_ranks: int
    replica: int
    num_replicas: int

    def __post_init__(self) -> None:
        for name in ("rank", "num_ranks", "replica", "num_replicas"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"ReplicaLayout.{name} must be a non-negative int, got {v!r}")
        if not (self.rank < self.num_ranks and self.replica < self.num_replicas):
            raise ConfigError(f"ReplicaLayout: need rank < num_ranks and replica < num_replicas, got {self}")

    def dataset_kwargs(self) -> dict[str, int]:
        """``{"rank", "replica", "num_replicas"}``: the arguments of ``Pipeline.dataset`` for this process."""
        return {"rank": self.rank, "replica": self.replica, "num_replicas": self.num_replicas}


def _flat(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """The row-major index of ``coords`` in a grid of ``sizes``."""
    out = 0
    for c, n in zip(coords, sizes):
        out = out * n + c
    return out


def replica_layout(mesh: Any, dp_dims: str | Sequence[str] = "dp") -> ReplicaLayout:
    """This process's data-parallel rank and replica, from a ``torch.distributed.device_mesh.DeviceMesh``.

    The data-parallel dimensions (``dp_dims``, several ones such as ``("dp_replicate", "dp_shard")`` are flattened
    in mesh order) give the rank; every other dimension (tensor, pipeline, context parallel...) the replica, in
    mesh order.

    Args:
        mesh: The DeviceMesh (with ``mesh_dim_names``) that this process belongs to.
        dp_dims: The name(s) of its data-parallel dimension(s).

    Returns:
        The :class:`ReplicaLayout` of this process.

    Raises:
        ConfigError: The mesh has no dimension names, or no dimension named as ``dp_dims`` says, or this process is
            not in the mesh.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names:
        raise ConfigError("replica_layout needs a DeviceMesh with mesh_dim_names (init_device_mesh(..., "
                          "mesh_dim_names=('dp', 'tp')))")
    dps = (dp_dims,) if isinstance(dp_dims, str) else tuple(dp_dims)
    missing = [d for d in dps if d not in names]
    if missing or not dps:
        raise ConfigError(f"replica_layout: the mesh's dimensions are {names}, with no data-parallel dimension "
                          f"{missing or dps} (pass dp_dims=...)")
    coords = mesh.get_coordinate()
    if coords is None:
        raise ConfigError("replica_layout: this process is not part of the mesh")
    sizes = tuple(int(n) for n in mesh.mesh.shape)
    dp = [i for i, n in enumerate(names) if n in dps]
    rest = [i for i, n in enumerate(names) if n not in dps]
    return ReplicaLayout(
        rank=_flat([coords[i] for i in dp], [sizes[i] for i in dp]), num_ranks=math.prod(sizes[i] for i in dp),
        replica=_flat([coords[i] for i in rest], [sizes[i] for i in rest]),
        num_replicas=math.prod(sizes[i] for i in rest))


def from_process_groups(dp_group: Any, *replica_groups: Any) -> ReplicaLayout:
    """This process's data-parallel rank and replica, from its process groups.

    Args:
        dp_group: Its data-parallel group (the processes holding the same model shard; its rank there is the
            data-parallel rank).
        *replica_groups: Its tensor/pipeline-parallel groups (the processes of one model replica), outermost first
            (e.g. ``pp_group, tp_group``): the replica is the row-major index over them.

    Returns:
        The :class:`ReplicaLayout` of this process.

    Raises:
        ConfigError: ``torch.distributed`` is not initialized, or this process is not in one of the groups.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("from_process_groups needs an initialized torch.distributed process group")
    ranks, sizes = [], []
    for k, g in enumerate((dp_group, *replica_groups)):
        r = dist.get_rank(g)
        if r < 0:
            raise ConfigError(f"from_process_groups: this process (global rank {dist.get_rank()}) is not in group "
                              f"{k} of the ones given")
        ranks.append(r)
        sizes.append(dist.get_world_size(g))
    return ReplicaLayout(rank=ranks[0], num_ranks=sizes[0], replica=_flat(ranks[1:], sizes[1:]),
                         num_replicas=math.prod(sizes[1:]))
