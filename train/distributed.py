"""All of the trainer's parallelism: small keyword-only functions over the trainer group.

The trainer group may be a subgroup of the world (target ranks live beside
it), so every collective here takes ``group`` explicitly and ranks are group
ranks, never global ranks. ``group=None`` means "no collectives": one process.

Strategies: ``single`` (one process), ``fsdp2`` (``fully_shard`` per draft
layer then the root; bf16 parameters, fp32 reduction, fp32 sharded master
weights; the frozen embedding and lm_head whole on every rank) and ``deepspeed`` (ZeRO-2 / ZeRO-3; fp32 gradient reduction and accumulation).

Loss scaling: the model's loss on a rank is its local weighted sum divided by
the weight sum over *all* ranks (``reduce_sum``), so the sum of the per-rank
losses is the global objective and the sum of the per-rank gradients its
gradient. FSDP and DeepSpeed *average* gradients over ranks; multiplying the
loss by the group size (:func:`loss_scale`) turns that average back into the
sum, so a 2-rank step equals a 1-process step on the union of the data.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

MESH_DIM = "dp_shard"


def group_rank(*, group) -> int:
    """This process's rank inside ``group`` (0 without a group)."""
    return 0 if group is None else dist.get_rank(group)


def group_size(*, group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def job_ranks(*, group) -> list[int]:
    """The job ranks of ``group``'s members in group-rank order: the names the launcher and the
    log prefixes ("[rank 1 trainer]") use. Without a group, this process's job rank (0 outside
    torch.distributed)."""
    if group is not None:
        return list(dist.get_process_group_ranks(group))
    return [dist.get_rank() if dist.is_initialized() else 0]


def loss_scale(*, group) -> float:
    """Factor on the backward loss that undoes the gradient averaging of FSDP/DeepSpeed."""
    return float(group_size(group=group))


def barrier(*, group) -> None:
    if group is not None:
        dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, *, group, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) over ``group``; identity without a group."""
    if group is not None:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor


def reduce_sum_fn(*, group) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The ``reduce_sum`` the objective uses for its global weight denominator."""
    if group is None:
        return None

    def reduce_sum(value: torch.Tensor) -> torch.Tensor:
        # gloo cannot reduce bf16 everywhere; the denominator is fp32 anyway.
        out = value.float().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out.to(value.dtype)

    return reduce_sum


# What gloo and NCCL say when a collective loses a rank (it exited, was killed, or hung).
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out",
              "application timeout caused pair closure", "communicator was aborted",
              "remote process exited")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank of its group went away."""
    text = str(exc).lower()
    return any(marker in text for marker in _LOST_PEER)


def all_gather_strings(values: Iterable[str], *, group, device: torch.device) -> list[list[str]]:
    """Every rank's list of strings, in group-rank order, moved as uint8 tensors (nothing pickled)."""
    payload = json.dumps(list(values)).encode()
    if group is None:
        return [json.loads(payload)]
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(group_size(group=group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    local = torch.zeros(longest, dtype=torch.uint8, device=device)
    local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = [torch.zeros_like(local) for _ in sizes]
    dist.all_gather(gathered, local, group=group)
    return [
        # numpy's bytes, not a list of ints: every checkpoint gathers all consumed ids (tens of MB late
        # in a long run), which .tolist() decoded at about 1 s per 50 MB
        json.loads(t[: int(s.item())].cpu().numpy().tobytes().decode()) for t, s in zip(gathered, sizes, strict=True)
    ]


def broadcast_string(value: str | None, *, group, device: torch.device, src_group_rank: int = 0) -> str:
    """``value`` of group rank ``src_group_rank`` on every rank of ``group``."""
    if group is None:
        return value or ""
    payload = (value or "").encode()
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    src = dist.get_global_rank(group, src_group_rank)
    dist.broadcast(size, src=src, group=group)
    data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if group_rank(group=group) == src_group_rank and payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if data.numel():
        dist.broadcast(data, src=src, group=group)
    return data.cpu().numpy().tobytes().decode()


def device_mesh(*, group, device_type: str):
    """A 1-D mesh (axis ``dp_shard``) over the trainer group, which may be a subgroup."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is dist.group.WORLD or group_size(group=group) == dist.get_world_size():
        return init_device_mesh(device_type, (group_size(group=group),), mesh_dim_names=(MESH_DIM,))
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(MESH_DIM,))


def shard_fsdp2(*, model: nn.Module, mesh, param_dtype: torch.dtype) -> nn.Module:
    """``fully_shard`` each draft layer, then the root (fc, norms, heads).

    Parameters are gathered in ``param_dtype``, gradients reduced in fp32; the
    sharded master weights stay fp32. The frozen parameters (the target's embedding
    and lm_head) are left out (``ignored_params``): every rank holds them whole, as
    the caller placed them (bf16 under bf16), where sharding them kept an fp32 shard
    that was all-gathered again at every micro-batch's forward. The root does not
    cast its forward inputs: FSDP2 would round every floating argument to
    ``param_dtype``, the trainer's fp32 loss denominator too (up to 0.4 % on the loss
    and gradient in bf16); the draft casts its features itself (``aux`` to ``fc``'s
    dtype, ``final`` to ``lm_head``'s).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def frozen(module: nn.Module) -> set[nn.Parameter] | None:
        return {p for p in module.parameters() if not p.requires_grad} or None

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=frozen(layer))
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                       cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, ignored_params=frozen(model))
    return model


def full_state_fsdp2(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The unsharded state of an FSDP2 module, on CPU (collective over its mesh: every rank
    walks the same names in the same order). One tensor is gathered at a time and, on a
    rank with ``keep=False``, dropped at once; torch's ``get_model_state_dict`` with
    ``full_state_dict=True`` holds every gathered tensor on the device until the end (and
    with ``cpu_offload`` keeps them on global rank 0 only, which may be a target rank)."""
    from torch.distributed.tensor import DTensor

    state: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        gathered = isinstance(value, DTensor)
        full = value.full_tensor() if gathered else value.detach()
        if keep:
            copy = full.cpu()
            live = value.to_local() if gathered else value
            if copy.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
                # a one-rank mesh's full tensor is its local shard, and .cpu() of a CPU tensor
                # the tensor itself: the live weights, which the next step would change
                copy = copy.clone()
            state[name] = copy
        del full
    return state


def clip_grad_norm(*, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm`` and return the total (global) norm as a plain fp32 scalar.

    With FSDP2 the gradients are DTensors and the norm comes back as one; its
    full value is the global norm over every shard.
    """
    total = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total.detach().float()


class _GroupMPU:
    """The minimal model-parallel unit DeepSpeed asks for: data parallel over ``group``, no model parallel."""

    def __init__(self, group) -> None:
        self.group = group
        # each trainer names a different one-rank list, which new_group allows only with local
        # synchronisation (the target ranks never make this call)
        self.model_group = (dist.new_group([dist.get_rank()], use_local_synchronization=True)
                            if group is not None else None)

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return group_size(group=self.group)

    def get_data_parallel_rank(self) -> int:
        return group_rank(group=self.group)

    def get_model_parallel_group(self):
        return self.model_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


def deepspeed_config(*, zero_stage: int, bf16: bool, max_grad_norm: float, micro_batch: int = 1) -> dict:
    """DeepSpeed's config: our AdamW and schedule, its ZeRO stage, clipping and bf16.

    Accumulation is driven by the trainer (it marks the boundary micro-batch).
    Gradients are reduced and accumulated in fp32 as under fsdp2 (DeepSpeed's bf16
    defaults would do both in bf16 and round every micro-batch's contribution).
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(max_grad_norm),
        # said, not left to the default: the trainer drops a step by making its gradients NaN,
        # which bf16 ZeRO-2 skips only with this check, off by default before DeepSpeed 0.19
        # (a release without the key refuses the config instead of applying a NaN update)
        "bf16": {"enabled": bool(bf16), "check_grad_overflow": True},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {
            "stage": int(zero_stage),
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
        },
        "zero_allow_untested_optimizer": True,
        # The tag check all-reduces over the whole world, which under a split
        # includes target ranks that never join; our tag is a constant anyway.
        "checkpoint": {"tag_validation": "Ignore"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class TupleOutput(nn.Module):
    """The draft with its ObjectiveOutput flattened to a tuple of tensors.

    DeepSpeed hooks module outputs only when they are tensors or tuples; a
    dataclass output would hide the backward from ZeRO-3's parameter gathering.
    """

    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, *args, **kwargs):
        out = self.draft(*args, **kwargs)
        return tuple(getattr(out, f.name) for f in dataclasses.fields(out))


def as_objective_output(out):
    """Undo :class:`TupleOutput` (identity on an ObjectiveOutput)."""
    from draftforge.train.objective import ObjectiveOutput

    return ObjectiveOutput(*out) if isinstance(out, tuple) else out


def _weights_only_checkpoint_engine(original):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True``.

    DeepSpeed unpickles its checkpoints with ``weights_only=False``; only the
    few plain DeepSpeed classes its optimizer states hold are allow-listed here.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    if type(original) is not TorchCheckpointEngine:
        return original
    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    engine = WeightsOnlyCheckpointEngine.__new__(WeightsOnlyCheckpointEngine)
    engine.__dict__.update(original.__dict__)
    return engine


def _skip_jit_shm_comm() -> None:
    """Never JIT-compile DeepSpeed's shared-memory all-reduce for CPU ranks.

    DeepSpeed builds it with a C++ toolchain on first use (40-60 s); a build
    killed midway leaves torch's extension lock file behind, and every later
    run then waits on that lock forever. Without it CPU collectives go through
    gloo; GPU ranks use NCCL either way.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def set_deepspeed_masters(model: nn.Module, values: dict[int, torch.Tensor]) -> None:
    """Write ``values`` (full fp32 tensors, by ``id`` of each trainable parameter) into the
    fp32 master weights DeepSpeed's ZeRO optimizer holds for ``model``'s parameters.

    Under ZeRO-3 each rank writes its own partition, zero-padded: DeepSpeed's full-tensor
    setter slices it out of the unpadded tensor and fails on a rank whose partition is padding
    (a parameter with fewer elements than, or not divisible by, the trainers)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    for param in model.parameters():
        if id(param) not in values:
            continue
        value = values[id(param)]
        partition = getattr(param, "ds_tensor", None)  # ZeRO-3
        if partition is None:
            safe_set_full_fp32_param(param, value.to(param.device))
            continue
        size = partition.numel()
        start = param._z3_optimizer._get_param_partition_rank(param) * size  # as DeepSpeed's setter
        local = torch.zeros(size, dtype=torch.float32)
        piece = value.flatten()[start : start + size]
        local[: piece.numel()] = piece
        safe_set_local_fp32_param(param, local.to(partition.device))


def init_deepspeed(*, model: nn.Module, optimizer: torch.optim.Optimizer, group, config: dict):
    """Wrap ``model``/``optimizer`` in a DeepSpeed engine data-parallel over ``group``.

    ZeRO-3 runs collectives on DeepSpeed's world (a barrier while it builds its optimizer,
    parameter-order checks by broadcast every step); when ``group`` is a subgroup of the
    world (target ranks beside the trainers, which never join them), DeepSpeed's world is
    narrowed to ``group`` for the engine's lifetime (:mod:`draftforge.train.deepspeed_subgroup`).
    """
    try:
        import deepspeed
    except ImportError as exc:
        raise RuntimeError(
            "train.strategy 'deepspeed' needs the deepspeed package: "
            "DS_BUILD_OPS=0 .venv/bin/pip install --no-deps deepspeed==0.19.8 hjson ninja py-cpuinfo "
            "msgpack (or pip install 'draftforge[deepspeed]')"
        ) from exc
    _skip_jit_shm_comm()
    wrapper = TupleOutput(model)
    undo = None
    if (config["zero_optimization"]["stage"] == 3 and group is not None
            and group_size(group=group) != dist.get_world_size()):
        from draftforge.train import deepspeed_subgroup

        undo = deepspeed_subgroup.install(group)
    try:
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=wrapper, optimizer=optimizer, config=config, mpu=_GroupMPU(group),
            dist_init_required=False,
        )
    except BaseException:
        if undo is not None:
            undo()
        raise
    if undo is not None:
        weakref.finalize(engine, undo)
    engine.checkpoint_engine = _weights_only_checkpoint_engine(engine.checkpoint_engine)
    if config["zero_optimization"]["stage"] == 3:
        # The objective reads these weights directly rather than through their
        # modules' forward, so ZeRO-3 must gather them with the wrapper (whose
        # tuple output gets DeepSpeed's backward hooks) for forward and backward.
        for param in (model.lm_head.weight, *(
            [model.markov_head.markov_w2.weight] if model.markov_head is not None else []
        )):
            deepspeed.zero.register_external_parameter(wrapper, param)
    return engine, ds_optimizer
