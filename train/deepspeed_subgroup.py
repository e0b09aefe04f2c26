"""DeepSpeed ZeRO-3 on a trainer group that is a subgroup of the world.

ZeRO-3 runs some collectives on DeepSpeed's default group (``group=None``): a barrier
while it builds its optimizer, and every step broadcasts from rank 0 that check the
parameter order on every rank. Under a split the world also holds target ranks, which
never join them, so the trainers would wait forever.

DeepSpeed sends every collective through one backend object, ``deepspeed.comm.comm.cdb``
(none of ZeRO-3 calls ``torch.distributed`` itself). While a ZeRO-3 engine on a subgroup
lives, trainer ranks swap it for :class:`SubgroupBackend`, which makes the trainer group
DeepSpeed's world: its ranks are trainer-group ranks everywhere (``get_rank``,
``get_world_size``, ``get_world_group``, ``get_global_rank``, ``src``/``dst`` and
``new_group`` ranks), and ``group=None`` means the trainer group. Target ranks never
install it; ZeRO-2 and FSDP2 never install it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

# Backend methods that run a collective, which ``deepspeed.comm`` calls with keyword
# arguments; the all-reduces, called with positional ones, are written out below.
COLLECTIVES = (
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced",
    "all_gather_object", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
    "gather", "scatter", "barrier", "monitored_barrier",
)


class SubgroupBackend:
    """DeepSpeed's ``TorchBackend`` with the world narrowed to ``trainers``; the rest is delegated."""

    def __init__(self, inner, trainers) -> None:
        self.inner = inner
        self.trainers = trainers
        for name in COLLECTIVES:
            setattr(self, name, self._collective(getattr(inner, name)))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _group(self, group):
        return self.trainers if group is None or group is dist.group.WORLD else group

    def _global(self, rank: int | None) -> int | None:
        return None if rank is None else dist.get_global_rank(self.trainers, rank)

    def _collective(self, method: Callable) -> Callable:
        def call(*args, group=None, **kwargs):
            for peer in ("src", "dst"):
                if peer in kwargs:
                    kwargs[peer] = self._global(kwargs[peer])
            return method(*args, group=self._group(group), **kwargs)

        return call

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return self.inner.all_reduce(tensor, op, self._group(group), async_op)

    def all_reduce_coalesced(self, tensors, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return self.inner.all_reduce_coalesced(tensors, op, self._group(group), async_op)

    def inference_all_reduce(self, tensor, op, group=None):
        return self.inner.inference_all_reduce(tensor, op, self._group(group))

    def get_rank(self, group=None) -> int:
        return dist.get_rank(group=self._group(group))

    def get_world_size(self, group=None) -> int:
        return dist.get_world_size(group=self._group(group))

    def get_world_group(self):
        return self.trainers

    def get_global_rank(self, group, group_rank: int) -> int:
        """The DeepSpeed-world (trainer-group) rank of ``group``'s rank ``group_rank``."""
        return dist.get_group_rank(self.trainers, dist.get_global_rank(self._group(group), group_rank))

    def new_group(self, ranks):
        # Only trainer ranks call this: local synchronisation, and a name (a hash of the
        # ranks) that no group the target ranks create by themselves can take.
        return dist.new_group([self._global(r) for r in ranks], use_local_synchronization=True)


_active: SubgroupBackend | None = None
_users = 0


def install(trainers) -> Callable[[], None]:
    """Make ``trainers`` DeepSpeed's world on this rank; returns the function that undoes it.

    Call it on trainer ranks only, before ``deepspeed.initialize``; undo it once the engine is gone
    (installs nest: the last undo restores DeepSpeed's own backend).
    """
    global _active, _users
    from deepspeed.comm import comm

    if _active is None:
        if comm.cdb is None:
            comm.init_distributed(dist_init_required=False, verbose=False)
        _active = SubgroupBackend(comm.cdb, trainers)
        comm.cdb = _active
    elif _active.trainers is not trainers:
        raise RuntimeError("internal error: ZeRO-3 engines on two different trainer groups in one process")
    _users += 1

    def undo() -> None:
        global _active, _users
        _users -= 1
        if _users == 0 and _active is not None:
            comm.cdb = _active.inner
            _active = None

    return undo
