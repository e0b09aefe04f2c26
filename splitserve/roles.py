"""One rank of a SplitServe run: process groups, then the target or the trainer role.

Every rank joins the world (``env://``: the ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` that ``draftforge train`` or torchrun set), then creates, in the same order on every rank:

- the ack group: every rank, always gloo, for the small trainer -> producer
  messages (resume state, credits, stop), and first for the check that every rank
  resolved the same ``split`` and ``draft`` (``same_recipe``). Samples travel on the
  world group (gloo on CPU, NCCL on GPU);
- the target group (``split.target_ranks``) and the trainer group
  (``split.trainer_ranks``; the draft's FSDP2/DeepSpeed collectives run there).

Target ranks build the target engine and run the producer; trainer ranks
receive the frozen embedding and lm_head from their first producer, build the
:class:`~draftforge.train.trainer.Trainer`, resume, tell the producers what was
already consumed, and train on the stream. A peer that dies ends the rank with a
message naming it (exit status 3) instead of a hang; rerunning the same command
resumes from the newest checkpoint.
"""

from __future__ import annotations

import datetime
import errno
import os
import signal
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from draftforge.config import RecipeConfig, RecipeError
from draftforge.errors import InputError
from draftforge.splitserve import borrowed_tokenizer
from draftforge.splitserve import transport as T
from draftforge.splitserve.producer import Topology, build_topology
from draftforge.splitserve.same_recipe import check_same_recipe
from draftforge.train import distributed as D

EXIT_PEER_DIED = 3
EXIT_BAD_INPUT = 2
MEMBER_WAIT = datetime.timedelta(days=30)  # a tensor-parallel member's wait for its leader


def recipe_split_problems(cfg: RecipeConfig) -> list[str]:
    """What stops this recipe's split from running on any machine (``draftforge config show``
    says them too; :func:`split_problems` adds the machine's)."""
    split, train = cfg.split, cfg.train
    problems = []
    trainers = split.trainer_ranks or []
    if split.restart_target and train.resume != "auto":
        problems.append(
            f"split.restart_target: a restarted job continues from the newest checkpoint, which "
            f"needs train.resume: auto (it is {train.resume!r}); set train.resume: auto or "
            "split.restart_target: false"
        )
    if train.strategy == "single" and len(trainers) != 1:
        problems.append(
            f"split.trainer_ranks: train.strategy 'single' trains in one process but the split has "
            f"{len(trainers)} trainer ranks {trainers}; use train.strategy fsdp2 or deepspeed, or "
            "list one trainer rank"
        )
    if cfg.target.backend == "sglang" and cfg.target.model == "random":
        problems.append(
            "target.backend: sglang loads the target's weights from a folder, and target.model "
            "'random' is built in memory with none; use target.backend: hf for a random target"
        )
    if cfg.target.backend == "sglang":
        from draftforge.splitserve.sglang_backend import RUNNER_TOKENS

        if split.feature_batch_size * cfg.data.max_length > RUNNER_TOKENS:
            problems.append(
                f"split.feature_batch_size: {split.feature_batch_size} rows of up to "
                f"data.max_length {cfg.data.max_length} tokens exceed the SGLang feature "
                f"runner's KV pool of {RUNNER_TOKENS} tokens; lower one of them"
            )
    if split.comm_backend == "nccl" and train.device == "cpu":
        problems.append(
            "split.comm_backend: nccl moves samples between GPUs but train.device is cpu; use "
            "comm_backend gloo (or auto) for CPU trainers"
        )
    both = sorted(set(split.target_devices or []) & set(split.trainer_devices or []))
    if both:
        problems.append(
            f"split.trainer_devices: GPUs {both} are in both target_devices and trainer_devices "
            "(two ranks on one GPU, which NCCL refuses); give each group its own GPUs"
        )
    if split.target_tensor_parallel > 1 and cfg.target.backend == "hf":
        problems.append(
            f"split.target_tensor_parallel: {split.target_tensor_parallel} needs a tensor-parallel "
            "target engine; the hf backend runs one target per rank (set it to 1)"
        )
    if cfg.target.model == "random" and cfg.target.shape is not None:
        if not borrowed_tokenizer.has_tokenizer(cfg.target.shape.vocab_size):
            problems.append(
                f"target.shape.vocab_size: a random target of vocabulary {cfg.target.shape.vocab_size} "
                f"has no tokenizer, and target ranks tokenise conversations; declare "
                f"{borrowed_tokenizer.MIN_VOCAB} <= vocab_size <= {borrowed_tokenizer.FULL_VOCAB} "
                "(SmolLM2's tokenizer cut to that size is borrowed) or use a real target"
            )
    topology = build_topology(split)
    feeding = max(len(topology.sources(r)) for r in topology.trainers)
    if split.max_in_flight < feeding:
        groups = (f" (one per {split.target_tensor_parallel} tensor-parallel target ranks)"
                  if split.target_tensor_parallel > 1 else "")
        problems.append(
            f"split.max_in_flight: {split.max_in_flight} is less than the {feeding} target "
            f"{'groups' if groups else 'ranks'}{groups} feeding one trainer; every link needs at "
            f"least one credit: set it to at least {feeding}"
        )
    return problems


def split_problems(
    cfg: RecipeConfig, *, world_size: int | None = None, cuda_devices: int | None = None,
    ranks: Iterable[int] | None = None,
) -> list[str]:
    """What stops this recipe's split from running, beyond what ``load_recipe`` checks: those
    of :func:`recipe_split_problems` and those of this machine.

    ``world_size``: the process count actually started (torchrun's); ``cuda_devices``:
    the GPUs visible (default: ask torch); ``ranks``: the ranks this machine runs (default:
    all), so that under split.comm_backend gloo a node of target ranks alone (which run on
    the CPU) is not refused for what only a trainer needs (a GPU for train.device cuda). Under
    auto it still is: that node would pick gloo where the trainers' nodes pick NCCL.
    """
    split, train = cfg.split, cfg.train
    problems = recipe_split_problems(cfg)
    trainers = split.trainer_ranks or []
    trains_here = ranks is None or split.comm_backend != "gloo" or bool(set(ranks) & set(trainers))
    if world_size is not None and world_size != split.world_size:
        problems.append(
            f"split.world_size: the recipe's split has {split.world_size} ranks "
            f"(target {split.target_ranks}, trainer {trainers}) but {world_size} processes were "
            f"started; start {split.world_size} ({''.join(torchrun_hint(split))}) or change the split"
        )
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wants_gpu = (
        split.comm_backend == "nccl"
        or split.target_devices is not None
        or split.trainer_devices is not None
    )
    if wants_gpu and cuda_devices == 0:
        # named by the key that asks for GPUs, so that the message points where it was set
        asking = [key for key, asks in (("split.comm_backend", split.comm_backend == "nccl"),
                                        ("split.target_devices", split.target_devices is not None),
                                        ("split.trainer_devices", split.trainer_devices is not None)) if asks]
        named = " / ".join("comm_backend nccl" if k == "split.comm_backend" else k.removeprefix("split.")
                           for k in asking)
        problems.append(
            f"{asking[0]}: {named} {'needs' if len(asking) == 1 else 'need'} CUDA GPUs and none is "
            f"visible; remove {'it' if len(asking) == 1 else 'them'} to run on CPU (gloo)"
        )
    if train.device == "cuda" and cuda_devices == 0 and trains_here:
        problems.append(
            "train.device: cuda, but no CUDA GPU is visible on this machine; use train.device=cpu "
            "(or auto, which takes a GPU when there is one)"
        )
    if cfg.draft.attention_backend == "flex" and train.device == "auto" and cuda_devices == 0 and trains_here:
        # the recipe check refuses flex with train.device cpu; auto resolves to the CPU here,
        # and the trainer's first step would fail after the target had loaded and answered
        problems.append(
            "draft.attention_backend: flex cannot train on the CPU (torch's flex attention has no "
            "backward there), and train.device auto trains on the CPU on this machine, where no "
            "GPU is visible; use draft.attention_backend: sdpa here, or train on a GPU"
        )
    nccl = comm_backend(cfg, gpus_visible=cuda_devices > 0) == "nccl"
    per_node = (world_size or split.world_size) // split.num_nodes
    if nccl and cuda_devices and split.target_devices is None and split.trainer_devices is None \
            and per_node > cuda_devices:
        fewer = ("fewer ranks in split.world_size, or a machine with more GPUs" if split.num_nodes == 1
                 else "a larger split.num_nodes, or fewer ranks in split.world_size")
        problems.append(
            f"split: {per_node} ranks on this node would each take their own GPU (LOCAL_RANK) for "
            f"NCCL (comm_backend {split.comm_backend}), but {cuda_devices} GPU(s) are visible and "
            "NCCL refuses two ranks on one GPU (no device list can avoid it: every rank needs a "
            f"GPU of its own); run at most {cuda_devices} ranks on a node ({fewer}), or set "
            "split.comm_backend=gloo, where the target ranks run on the CPU and each trainer on a "
            "GPU of its own (train.device=cpu: on the CPU too)"
        )
    for key in ("target_devices", "trainer_devices"):
        devices = getattr(split, key) or []
        bad = [d for d in devices if cuda_devices and d >= cuda_devices]  # ids are >= 0 (GpuId)
        if bad and cuda_devices:
            problems.append(f"split.{key}: devices {bad} do not exist ({cuda_devices} "
                            f"GPU{'' if cuda_devices == 1 else 's'} visible on this machine)")
    named = split.target_devices is not None or split.trainer_devices is not None
    if named and not nccl and cuda_devices:
        problems.append(
            f"split.target_devices / split.trainer_devices place ranks on GPUs for NCCL, but samples "
            f"go over gloo here (comm_backend {split.comm_backend}, train.device {train.device}), where "
            "target ranks run on the CPU and each trainer on its own GPU in its node's order: remove them, or set "
            "split.comm_backend=nccl"
        )
    if named and nccl and cuda_devices:
        problems += _shared_gpu_problems(split, per_node, cuda_devices)
    if not nccl and cuda_devices and train.device != "cpu":
        problems += _gloo_gpu_problems(split, cuda_devices, ranks)
    problems += tensor_parallel_problems(split, per_node=per_node, on_gpus=nccl)
    return problems


def torchrun_hint(split, command: str = "") -> tuple[str, str]:
    """The torchrun command that starts ``split``'s ranks (its options, then ``command``) and,
    on several nodes, where it runs (`` on each of its N nodes``; else ``""``):
    ``--nproc_per_node`` counts one node's processes, ``world_size / num_nodes``."""
    per_node = split.world_size // split.num_nodes
    if split.num_nodes == 1:
        return f"torchrun --nproc_per_node={per_node}{command}", ""
    return (f"torchrun --nnodes={split.num_nodes} --nproc_per_node={per_node}{command}",
            f" on each of its {split.num_nodes} nodes")


def tensor_parallel_groups(split) -> list[list[int]]:
    """The target ranks in tensor-parallel groups of ``split.target_tensor_parallel``,
    in order; each group's first rank leads it (the producer, see ``build_topology``)."""
    tp = split.target_tensor_parallel
    ranks = list(split.target_ranks)
    return [ranks[i:i + tp] for i in range(0, len(ranks), tp)]


def tensor_parallel_problems(split, *, per_node: int, on_gpus: bool = True) -> list[str]:
    """Groups SGLang cannot place: its tensor-parallel ranks run on GPUs ``base_gpu_id``,
    ``base_gpu_id + 1``, ... of one machine, so a group's ranks must sit on one node and
    their GPUs (``target_devices``, or the node-local rank) must follow each other.
    ``on_gpus``: whether the target ranks run on GPUs (NCCL); over gloo they run on the
    CPU, where only the one-node rule holds (the group's ranks meet on a loopback port)."""
    if split.target_tensor_parallel == 1:
        return []
    problems = []
    for group in tensor_parallel_groups(split):
        nodes = sorted({rank // per_node for rank in group})
        if len(nodes) > 1:
            problems.append(
                f"split.target_tensor_parallel: the tensor-parallel group of target ranks {group} "
                f"spans nodes {nodes}; SGLang runs a group on one machine, so list target ranks "
                "so that each group of target_tensor_parallel lies on one node"
            )
            continue
        if not on_gpus:
            continue
        if split.target_devices is not None:
            gpus = [split.target_devices[split.target_ranks.index(rank)] for rank in group]
            where = "split.target_devices gives them GPUs"
        else:
            gpus = [rank % per_node for rank in group]
            where = "they take their node-local GPUs"
        if gpus != list(range(gpus[0], gpus[0] + len(gpus))):
            problems.append(
                f"split.target_tensor_parallel: target ranks {group} form one tensor-parallel "
                f"group and {where} {gpus}, but SGLang places a group on consecutive GPUs from "
                f"its first ({list(range(gpus[0], gpus[0] + len(gpus)))}); reorder "
                "split.target_devices or split.target_ranks"
            )
    return problems


def check_split(cfg: RecipeConfig, **kwargs) -> None:
    """Raise :class:`RecipeError` listing :func:`split_problems`, each led by the recipe line
    (or override) that set its key."""
    problems = split_problems(cfg, **kwargs)
    if problems:
        raise RecipeError([cfg.locate(problem) for problem in problems])


def check_local_world(cfg: RecipeConfig, local_world: str | None) -> None:
    """Refuse a node started with another process count than the split's ``world_size /
    num_nodes`` (torchrun's ``--nproc_per_node``, ``LOCAL_WORLD_SIZE``): ranks would take the
    wrong GPUs and the nodes the wrong ranks. ``draftforge train`` checks it before starting;
    a hand-started torchrun is checked here."""
    per_node = cfg.split.world_size // cfg.split.num_nodes
    if local_world is not None and local_world.strip() and int(local_world) != per_node:
        raise InputError(
            f"this node runs {local_world} processes (torchrun --nproc_per_node), but the split "
            f"runs {per_node} on each of its {cfg.split.num_nodes} node(s) (split.world_size "
            f"{cfg.split.world_size} / split.num_nodes {cfg.split.num_nodes}); start it with "
            f"--nproc_per_node={per_node}, or use 'draftforge train RECIPE'"
        )


def comm_backend(cfg: RecipeConfig, *, gpus_visible: bool) -> str:
    """The transport ``split.comm_backend`` means: ``auto`` is nccl when GPUs are visible and
    ``train.device`` is not cpu, else gloo. Dry runs plan with ``gpus_visible=True``."""
    choice = cfg.split.comm_backend
    if choice == "auto":
        return "nccl" if gpus_visible and cfg.train.device != "cpu" else "gloo"
    return choice


def _shared_gpu_problems(split, per_node: int, cuda_devices: int) -> list[str]:
    """Each rank's GPU as :func:`_device` picks it (the group's list, else LOCAL_RANK): two
    ranks of one node on one GPU, or a LOCAL_RANK GPU that does not exist."""
    problems, on_gpu = [], {}
    for key, ranks, devices in (("target_devices", split.target_ranks, split.target_devices),
                                ("trainer_devices", split.trainer_ranks, split.trainer_devices)):  # fmt: skip
        for index, rank in enumerate(ranks):
            if devices is not None and index >= len(devices):
                continue  # the list's length is refused elsewhere
            gpu = devices[index] if devices is not None else rank % per_node
            if devices is None and gpu >= cuda_devices:
                problems.append(f"split: rank {rank} has no GPU named and would take GPU {gpu} "
                                f"(LOCAL_RANK), which does not exist ({cuda_devices} visible)")
            # the list that named the GPU, or None: the rank's LOCAL_RANK
            on_gpu.setdefault((rank // per_node, gpu), []).append((rank, key if devices is not None else None))
    for (node, gpu), placed in sorted(on_gpu.items()):
        if len(placed) < 2:
            continue
        ranks = [rank for rank, _ in placed]
        lists = list(dict.fromkeys(key for _, key in placed if key is not None))
        local = [rank for rank, key in placed if key is None]
        if not local and len(lists) > 1:
            continue  # one GPU in both lists: split_problems names it once, at trainer_devices
        where = f" on node {node}" if split.num_nodes > 1 else ""
        why = [f"split.{key} names GPU {gpu} for ranks {[r for r, k in placed if k == key]}"
               for key in lists]
        if local:
            why.append(f"{'rank' if len(local) == 1 else 'ranks'} {', '.join(map(str, local))} "
                       f"{'has' if len(local) == 1 else 'have'} no device list and "
                       f"{'takes' if len(local) == 1 else 'take'} GPU LOCAL_RANK {gpu}")
            lead, fix = "split", ("name each rank's GPU in split.target_devices and "
                                  "split.trainer_devices")
        else:  # one list names a GPU twice: lead with that list, so its line is shown
            lead, fix = f"split.{lists[0]}", f"list each GPU once in split.{lists[0]}"
        problems.append(
            f"{lead}: ranks {ranks} would share GPU {gpu}{where} ({'; '.join(why)}); NCCL refuses "
            f"two ranks on one GPU: {fix}"
        )
    return problems


def trainers_by_node(split) -> list[list[int]]:
    """The trainer ranks of each node, node by node, in the split's order."""
    per_node = split.world_size // split.num_nodes
    return [[r for r in split.trainer_ranks if r // per_node == node] for node in range(split.num_nodes)]


def gloo_trainer_gpu(split, rank: int) -> int:
    """The GPU a trainer rank of ``train.device`` cuda takes when samples go over gloo: its
    place among its node's trainer ranks (the first trainer of a node on GPU 0, the next on
    GPU 1, ...), since the target ranks run on the CPU there."""
    return next(here for here in trainers_by_node(split) if rank in here).index(rank)


def _gloo_gpu_problems(split, cuda_devices: int, ranks: Iterable[int] | None = None) -> list[str]:
    """Over gloo each trainer of train.device cuda takes its own GPU (:func:`gloo_trainer_gpu`):
    a node with more trainer ranks than visible GPUs would put two on one. ``ranks``: those
    this machine runs (default: all); another node's trainers are not counted against its GPUs."""
    problems = []
    mine = None if ranks is None else set(ranks)
    for node, here in enumerate(trainers_by_node(split)):
        if mine is not None and not mine & set(here):
            continue
        if len(here) > cuda_devices:
            where = f" on node {node}" if split.num_nodes > 1 else ""
            problems.append(
                f"split: {len(here)} trainer ranks {here}{where} would each take their own GPU "
                f"(train.device cuda; over gloo the first trainer of a node takes GPU 0, the next "
                f"GPU 1, ...), but {cuda_devices} GPU(s) are visible; use fewer trainer ranks "
                "per node, or train.device=cpu"
            )
    return problems


def _device(cfg: RecipeConfig, rank: int, backend: str) -> torch.device:
    """This rank's transport device, which is also its compute device, except for a trainer of
    train.device cuda over gloo: its samples arrive on the CPU, and its current GPU is set
    here (:func:`gloo_trainer_gpu`) for the trainer to train on."""
    split = cfg.split
    if backend != "nccl":
        if rank in split.trainer_ranks and cfg.train.device != "cpu" and torch.cuda.is_available():
            torch.cuda.set_device(gloo_trainer_gpu(split, rank))
        return torch.device("cpu")
    if rank in split.target_ranks:
        devices, index = split.target_devices, split.target_ranks.index(rank)
    else:
        devices, index = split.trainer_devices, split.trainer_ranks.index(rank)
    gpu = devices[index] if devices is not None else int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _say(rank: int, role: str):
    from draftforge.train.metrics import say

    def log(text: str) -> None:
        say(f"[rank {rank} {role}] {text}")  # never on the end of a progress bar's line

    return log


class RankContext:
    """Everything a role needs: the config, this rank, the groups and the device."""

    def __init__(self, cfg: RecipeConfig, rank: int, world: int, *, mode: str = "train"):
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.mode = mode
        self.backend = comm_backend(cfg, gpus_visible=torch.cuda.is_available())
        self.device = _device(cfg, rank, self.backend)
        self.topology: Topology = build_topology(cfg.split)
        self.role = "target" if rank in cfg.split.target_ranks else "trainer"
        self.log = _say(rank, self.role)
        timeout = datetime.timedelta(seconds=cfg.split.peer_timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, rank=rank, world_size=world, timeout=timeout)
        # the ack group first: it does not depend on the split, which every rank must share
        # before the groups that do are made (a node given other overrides is refused here)
        self.ack_group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
        check_same_recipe(cfg, world, self.ack_group)
        self.data_group = dist.group.WORLD
        self.target_group = dist.new_group(list(cfg.split.target_ranks), timeout=timeout)
        self.trainer_group = dist.new_group(list(cfg.split.trainer_ranks), timeout=timeout)
        # A tensor-parallel target group's members wait on their leader for the whole run: a
        # gloo group of their own whose timeout no run reaches (a leader that dies closes it).
        self.tp_group, self.tp_leader = None, None
        if cfg.split.target_tensor_parallel > 1:
            for group in tensor_parallel_groups(cfg.split):
                handle = dist.new_group(group, backend="gloo", timeout=MEMBER_WAIT)
                if rank in group:
                    self.tp_group, self.tp_leader = handle, group[0]


def run_rank(cfg: RecipeConfig, *, mode: str = "train", bench: dict | None = None) -> int:
    """Run this process's rank of the recipe (env:// rendezvous); returns the exit status."""
    rank = int(os.environ.get("RANK", "-1"))
    world = int(os.environ.get("WORLD_SIZE", "-1"))
    if rank < 0 or world < 0:
        command, where = torchrun_hint(cfg.split, " -m draftforge.train RECIPE")
        raise InputError(  # a launch mistake, not the recipe's
            "no RANK and WORLD_SIZE in the environment: draftforge.train runs one rank of a split "
            f"job; start it with 'draftforge train RECIPE' or '{command}'{where}"
        )
    check_split(cfg, world_size=world, ranks=[rank])
    check_local_world(cfg, os.environ.get("LOCAL_WORLD_SIZE"))
    interrupt_once()
    ctx = RankContext(cfg, rank, world, mode=mode)
    restarts = int(os.environ.get("DRAFTFORGE_RESTART", "0") or 0)
    if restarts:
        ctx.log(f"restart {restarts} of the job: a rank had failed; the launcher's line above "
                "says whether it continues from a checkpoint")
    try:
        if ctx.role == "target":
            _run_target(ctx, bench)
        else:
            _run_trainer(ctx, bench)
    except InputError as exc:  # a file or setting the user can fix: the message, no traceback
        ctx.log(f"error: {exc}")
        sys.stderr.flush()
        note_input_error(exc)
        os._exit(EXIT_BAD_INPUT)
    except T.PeerDied as exc:
        ctx.log(f"stopping: {exc}")
        _say_how_to_resume(ctx, bench)
        sys.stdout.flush()
        os._exit(EXIT_PEER_DIED)
    except KeyboardInterrupt as stop:  # the launcher says how to continue; no traceback per rank
        if isinstance(stop, Terminated):
            ctx.log("stopped on SIGTERM")
            die_of_sigterm()
        ctx.log("interrupted")
        sys.stdout.flush()
        os._exit(130)
    except RuntimeError as exc:
        if ctx.role == "trainer" and D.lost_peer(exc):  # a trainer-group collective lost a rank
            ctx.log(f"stopping: {T.PeerDied(-1, 'trainer', _trainer_group_doing(ctx), exc)}")
            _say_how_to_resume(ctx, bench)
            sys.stdout.flush()
            os._exit(EXIT_PEER_DIED)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    except OSError as exc:
        if exc.errno not in _FULL_DISK:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        ctx.log(f"error: {_full_disk_message(exc, ctx.cfg.train.output_dir)}")
        sys.stderr.flush()
        note_input_error(exc)  # a restart (--max-restarts) would fail the same way
        os._exit(EXIT_BAD_INPUT)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    _finish(ctx)
    return 0


# A write that fails for want of space (or a read-only file system): no restart helps.
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _full_disk_message(exc: OSError, output_dir) -> str:
    """One line for a write that failed with one of :data:`_FULL_DISK`: the file (where the
    error names it), the errno, what to do."""
    what = f"{exc.strerror or os.strerror(exc.errno)} (errno {exc.errno}, {errno.errorcode[exc.errno]})"
    where = (f"writing {exc.filename}" if exc.filename is not None
             else f"writing a file (train.output_dir is {output_dir})")
    return (f"{what} {where}; free space there (or fix the quota or a read-only mount) and rerun the "
            "same command; a restart would fail the same way, so none is made")


def _trainers_on_this_node(ctx: RankContext) -> bool:
    """Whether rank ``ctx.rank``'s node runs a trainer rank, and so holds the run's checkpoints
    (always on one node; on several, only the trainers' nodes do, as the launcher's advice says)."""
    split = getattr(ctx.cfg, "split", None)
    if split is None or split.num_nodes == 1:
        return True
    from draftforge.splitserve.launch import _runs_trainers
    from draftforge.splitserve.multinode import node_layout

    layout = node_layout(ctx.cfg)
    return _runs_trainers(ctx.cfg, layout, ctx.rank // layout.nproc_per_node)


def _say_how_to_resume(ctx: RankContext, bench: dict | None) -> None:
    """After a peer died: how to continue. Nothing for a benchmark (its run lives in a scratch
    folder, deleted at its end) or a run that never resumes (a rerun starts over); a rerun
    starts over too where this node runs a trainer rank and ``train.output_dir`` holds no
    checkpoint yet."""
    if bench is not None or ctx.cfg.train.resume == "never":
        return
    from draftforge.splitserve.launch import _not_auto_advice
    from draftforge.train import checkpoint as ckpt

    advice = _not_auto_advice(ctx.cfg)  # train.resume=PATH: the same command resumes from it again
    if advice is not None:
        ctx.log(advice)
        return
    from draftforge.splitserve.launch import INPUT_ERROR_ENV, RESTARTS_LEFT_ENV

    left = os.environ.get(RESTARTS_LEFT_ENV, "0")
    marker = os.environ.get(INPUT_ERROR_ENV)
    if marker and Path(marker).exists():  # a rank refused its input: the launcher restarts nothing
        ctx.log("a rank refused its input (its message says why), so no restart is made: fix it first")
    elif left.isdigit() and int(left) > 0:  # draftforge train restarts the job itself: no "rerun"
        ctx.log(f"the launcher restarts the job ({left} restart(s) left), continuing from the "
                f"newest checkpoint in {ctx.cfg.train.output_dir} where there is one")
        return
    run_dir = Path(ctx.cfg.train.output_dir)
    # the folder is not here, or this node runs no trainer (a target node's folder may hold
    # regenerated.jsonl, never a checkpoint): the trainers' node has it, and may have checkpoints
    try:  # a trainer on this node and no run folder (it died before making one): no checkpoint
        none = _trainers_on_this_node(ctx) and (not run_dir.is_dir() or not ckpt.complete_checkpoints(run_dir))
    except OSError:  # a folder this rank cannot list: no guess
        none = False
    if none:
        ctx.log(f"no checkpoint was written in {run_dir} yet: rerun the same command to start over")
        return
    ctx.log(
        f"the run can be resumed: rerun the same command (train.resume={ctx.cfg.train.resume}) "
        f"to continue from the newest checkpoint in {ctx.cfg.train.output_dir}"
    )


def note_input_error(exc: BaseException) -> None:
    """Before this rank exits with status 2 (:data:`EXIT_BAD_INPUT`), tell the node's
    ``draftforge train`` that it refused its input, so it makes no restart: torchrun exits 1
    whatever its ranks' statuses. The launcher names the file in
    ``DRAFTFORGE_INPUT_ERROR_FILE``; nothing to do without it (torchrun started by hand)."""
    from draftforge.files import write_atomic
    from draftforge.splitserve.launch import INPUT_ERROR_ENV

    path = os.environ.get(INPUT_ERROR_ENV)
    if not path:
        return
    try:
        write_atomic(Path(path), f"rank {os.environ.get('RANK', '?')}: {exc}\n")
    except OSError as err:  # the status still says it where nothing stands between
        print(f"draftforge train: cannot leave the input-error marker {path}: {err}", file=sys.stderr,
              flush=True)


def _trainer_group_doing(ctx: RankContext) -> str:
    """What a trainer whose trainer-group collective lost a rank was doing, naming the other
    trainer ranks (gloo and NCCL name the lost peer by address only): with two trainers, the
    one that died or hung."""
    others = [rank for rank in ctx.cfg.split.trainer_ranks if rank != ctx.rank]
    if not others:
        return "in a collective of the trainer group"
    which = f"trainer rank {others[0]}" if len(others) == 1 else f"trainer ranks {others}"
    return f"in a collective of the trainer group with {which}"


def _rotation_start(sources: list[int], info) -> int:
    """Where a trainer's receive rotation over its ``sources`` starts: after the source of the
    last sample its checkpoint consumed. Sources that have ended since end again at once on
    resume and drop out of the rotation where the interrupted run dropped them."""
    if info is None:
        return 0
    last = info.extra.get("last_source")
    if last in sources:
        return (sources.index(last) + 1) % len(sources)
    return len(info.consumed_ids) % len(sources)  # a checkpoint without it: strict rotation


class Terminated(KeyboardInterrupt):
    """SIGTERM to a rank (the launcher stopping the job after a failure or after Ctrl-C,
    torchrun, a scheduler's stop): unwound as Ctrl-C is, so that a target rank's ``finally``
    closes its target, then ended by SIGTERM (:func:`die_of_sigterm`). An SGLang engine
    installs a SIGTERM handler of its own at its first request; the SGLang backend puts
    this one back after each generation call
    (:func:`~draftforge.splitserve.sglang_backend.sigterm_kept`)."""


def die_of_sigterm() -> None:
    """End the process by SIGTERM's default action, once a :class:`Terminated` has unwound it:
    its status says it was killed by SIGTERM, as before the rank handled it (the launcher
    takes a rank killed by a signal for a failure's cause before those that exited)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # not reached where the signal is delivered


# a second SIGTERM this soon after the first is the same stop delivered twice (interrupt_once)
DUPLICATE_SIGTERM_S = 1.0


def interrupt_once() -> None:
    """Make the first SIGINT a KeyboardInterrupt and the first SIGTERM a :class:`Terminated`;
    after either, SIGINT is ignored and SIGTERM kills at once (its default action), except a
    SIGTERM within DUPLICATE_SIGTERM_S of a first SIGTERM, which is ignored.

    A rank often gets two SIGINTs: a group-wide one (``kill -INT -PGID``, a scheduler) reaches
    it directly and again through the launcher, which cannot tell it from one sent to itself
    alone. A second KeyboardInterrupt landing in the first one's handler printed a traceback
    instead of 'interrupted'. Whoever sent the first signal follows with SIGTERM and SIGKILL
    (the launcher, torchrun, a scheduler), and the launcher's death SIGKILLs its ranks
    (:func:`~draftforge.splitserve.supervisor.die_with`): a rank held in a collective, which
    handles no signal until the collective returns, never outlives its job.
    No-op outside the main thread, where signals cannot be handled.
    """
    from draftforge.signals import outside_finalizers

    @outside_finalizers  # raised in a __del__, the interrupt would be printed and lost
    def first(signum, _frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if signum != signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise KeyboardInterrupt
        # a scheduler's group-wide SIGTERM reaches a rank twice too, directly and through the
        # launcher, milliseconds apart: that copy is ignored (it killed ranks writing their
        # interrupted summary); one later than DUPLICATE_SIGTERM_S kills, as before
        first_at = time.monotonic()

        def again(_signum, _frame):
            if time.monotonic() - first_at < DUPLICATE_SIGTERM_S:
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        again.after_stop = True  # the rank's own, which sglang_backend.sigterm_kept leaves in place
        signal.signal(signal.SIGTERM, again)
        raise Terminated

    try:
        signal.signal(signal.SIGINT, first)
        signal.signal(signal.SIGTERM, first)
    except ValueError:
        pass


def _finish(ctx: RankContext) -> None:
    try:
        dist.barrier(group=ctx.ack_group)
        dist.destroy_process_group()
    except RuntimeError as exc:  # a peer already gone at the very end: nothing left to do
        ctx.log(f"note: teardown: {str(exc).splitlines()[0]}")


# --------------------------------------------------------------------------- target


def build_engine(ctx: RankContext):
    from draftforge.splitserve.target import build_target

    cfg = ctx.cfg
    if ctx.device.type == "cpu":
        torch.set_num_threads(cfg.target.num_threads)
    # an auto dtype was resolved for CUDA where there is one; a target rank placed on the CPU
    # (gloo, train.device cpu) takes the CPU's rule instead of an emulated bf16
    target = cfg.target.model_copy(update={"dtype": cfg.target.dtype_on(ctx.device.type)})
    from draftforge.splitserve.target import check_mask_token_in_folder

    checked = check_mask_token_in_folder(target, cfg.draft.mask_token_id)  # before minutes of loading
    if checked is not None:
        ctx.log(checked)
    ctx.log(f"loading target {target.model!r} ({target.dtype}) on {ctx.device}")
    begin = time.perf_counter()
    engine = build_target(target, cfg.draft.target_layer_ids, device=ctx.device,
                          tensor_parallel=cfg.split.target_tensor_parallel)
    ctx.log(f"target ready in {time.perf_counter() - begin:.1f} s")
    # a random target's ids are all equally unused (and it may lack a tokenizer)
    if engine.trained and checked is None:
        from draftforge.splitserve.target import check_mask_token

        try:
            ctx.log(check_mask_token(engine.tokenizer, cfg.draft.mask_token_id,
                                     vocab_size=engine.vocab_size, eos_ids=engine.eos_token_ids(),
                                     chat_template=cfg.target.generation.chat_template,
                                     enable_thinking=cfg.target.generation.enable_thinking))
        except BaseException:
            close_after_failure(engine, ctx.log)
            raise
    return engine


def _run_target(ctx: RankContext, bench: dict | None) -> None:
    from draftforge.splitserve.producer import embedding_dests, run_producer, send_embeddings

    if ctx.rank not in ctx.topology.producers:
        wait_for_leader(ctx)
        return
    # While the target loads, the trainers it sends the embeddings wait for them: beat to them.
    pulse = T.Pulse(every_s=ctx.cfg.split.peer_timeout_s / 4, group=ctx.data_group,
                    device=ctx.device)
    pulse.expect(embedding_dests(ctx.topology, ctx.rank))
    # listen for the trainers' heartbeats and resume states (a benchmark's trainers: that
    # they are ready for a phase) from now on, while the target loads
    hellos = T.AckListener(ctx.topology.dests(ctx.rank), group=ctx.ack_group)
    engine = build_engine(ctx)
    try:
        send_embeddings(engine, ctx.topology, ctx.rank, data_group=ctx.data_group, device=ctx.device,
                        pulse=pulse)
        if bench is not None:
            from draftforge.splitserve.bench_split import bench_target_rank

            bench_target_rank(ctx, engine, bench, pulse=pulse, hellos=hellos)
        else:
            summary = run_producer(
                ctx.cfg, engine, ctx.topology, ctx.rank, data_group=ctx.data_group,
                ack_group=ctx.ack_group, device=ctx.device, log=ctx.log, pulse=pulse, hellos=hellos,
            )
            ctx.log(done_line(summary))
    except BaseException:
        close_after_failure(engine, ctx.log)
        raise
    release_members(ctx, engine)


def close_after_failure(engine, log: Callable[[str], None]) -> None:
    """Stop a failed target rank's SGLang instances before the error propagates: left to the
    exit, SGLang's own handler SIGKILLs every child of the process, the feature runner's with
    them, which then leaves its shared memory behind. A failure to close is said, not raised
    over the error that got here."""
    close = getattr(engine, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        log(f"closing the target after the failure failed too: {type(exc).__name__}: {exc}")


def done_line(summary: dict) -> str:
    """A target rank's last line: its whole serving, from the start to its trainers' stop. The
    trainers' ``split accounting`` block has a producer's figures only as of the last sample
    they took (the stats its header carried at its send): without the samples made after it
    (in transit, dropped, or waiting here) and the wait for the trainers' stop, so the two
    differ (more idle here when the trainers' last steps and checkpoint took long), and each
    line says its window."""
    return (
        f"done (serving, to the trainers' stop): busy {summary['busy_share']:.1%} "
        f"idle {summary['idle_share']:.1%} "
        f"{summary['tokens']} tokens {summary['rate_tok_s']:.0f} tok/s; at most "
        f"{summary['max_outstanding']} samples in flight per trainer (credits {summary['credits']}) "
        f"and {summary['max_pending_tokens']} tokens waiting here for one trainer"
    )


def wait_for_leader(ctx: RankContext) -> None:
    """A tensor-parallel member: its GPU serves the group through the leader's SGLang
    instances, so this rank only waits until the leader is done (or dies)."""
    where = f"GPU {ctx.device.index}" if ctx.device.type == "cuda" else "share of the CPU"
    ctx.log(f"tensor-parallel member of target rank {ctx.tp_leader}'s group: its SGLang engine "
            f"and feature runner run on this rank's {where} too; waiting for it to finish")
    done = torch.zeros(1)
    try:
        dist.recv(done, src=ctx.tp_leader, group=ctx.tp_group)
    except RuntimeError as exc:
        raise T.PeerDied(ctx.tp_leader, "target", "serving this tensor-parallel group", exc) from None
    ctx.log("the group's leader is done")


def release_members(ctx: RankContext, engine) -> None:
    """The target is done: its SGLang instances stop (they would otherwise be killed at exit,
    leaving their shared memory behind), then a tensor-parallel leader tells its members."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    if ctx.tp_group is None:
        return
    for member in tensor_parallel_groups(ctx.cfg.split)[ctx.topology.producers.index(ctx.rank)][1:]:
        dist.send(torch.ones(1), dst=member, group=ctx.tp_group)


# --------------------------------------------------------------------------- trainer


def build_trainer(ctx: RankContext, embeddings):
    """The Trainer of this rank (the trainer group when there are several trainer ranks)."""
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train import checkpoint as ckpt
    from draftforge.train.config import build_dspark_config
    from draftforge.train.trainer import Trainer

    cfg = ctx.cfg
    shape = resolve_target_shape(cfg.target)
    vocab = int(embeddings[0].shape[0])
    if shape is None:
        from draftforge.splitserve.config import TargetShape

        shape = TargetShape(num_hidden_layers=max(cfg.draft.target_layer_ids) + 2,
                            hidden_size=int(embeddings[0].shape[1]), vocab_size=vocab)
    model_config = build_dspark_config(cfg.draft, shape, vocab_size=vocab)
    # every parallel strategy runs on the trainer group, even of one rank (never the world)
    group = ctx.trainer_group if cfg.train.strategy != "single" else None
    init_draft = None
    resuming = ckpt.find_resume(Path(cfg.train.output_dir), cfg.train.resume) is not None
    if cfg.train.markov_init == "bigram" and not resuming:  # a resume loads its weights
        from draftforge.splitserve.producer import markov_init_samples
        from draftforge.train.markov_init import init_markov_bigram

        def init_draft(model):
            return init_markov_bigram(model, *markov_init_samples(cfg))
    elif cfg.train.init_from is not None and not resuming:  # (the recipe checks refuse both)
        from draftforge.train.init_from import init_from_export

        def init_draft(model):
            return init_from_export(model, cfg.train.init_from)

    return Trainer(
        model_config=model_config, train=cfg.train, embeddings=embeddings,
        run_dir=Path(cfg.train.output_dir), group=group, recipe_yaml=cfg.to_yaml(),
        init_draft=init_draft, run_details=_answers_details(cfg),
    )


def _answers_details(cfg: RecipeConfig) -> dict:
    """run.json's record of the answers this segment trains on, where its launch decided it
    (``draftforge train`` on one node): "inline" (the target answers during training) or the
    file's path; a later segment that finds the other is told (``launch.answers_note``)."""
    from draftforge.data.loading import regenerated_path
    from draftforge.splitserve.producer import launch_pin

    pin = launch_pin()
    if pin is None:
        return {}
    return {"answers": "inline" if pin == "inline" else str(regenerated_path(cfg.data, cfg.train.output_dir))}


def _provenance(cfg: RecipeConfig) -> dict:
    """What every streamed sample records about where it came from."""
    out = {"target": cfg.target.model, "target_dtype": cfg.target.dtype,
           "regenerated": cfg.data.regenerate}
    if cfg.data.regenerate:
        out["generation"] = cfg.target.generation.model_dump(mode="json")
    return out


def _run_trainer(ctx: RankContext, bench: dict | None) -> None:
    from draftforge.splitserve.accounting import ConsumerAccounting
    from draftforge.splitserve.consumer import ConsumerStream, stream_pack
    from draftforge.splitserve.registry import rope_theta_problem
    from draftforge.train.config import ignored_zero_stage_note
    from draftforge.train.metrics import write_line

    cfg = ctx.cfg
    if (problem := rope_theta_problem(cfg)) is not None:  # torchrun started it directly
        raise InputError(problem)
    sources = ctx.topology.sources(ctx.rank)
    # every producer listens from its start: beat to them all until the stop
    acks = T.AckLink(sources, group=ctx.ack_group, every_s=cfg.split.peer_timeout_s / 4)
    embed = T.recv_tensor(sources[0], group=ctx.data_group, device=ctx.device)
    head = T.recv_tensor(sources[0], group=ctx.data_group, device=ctx.device)
    trainer = build_trainer(ctx, (embed, head))
    del embed, head
    if bench is not None:
        from draftforge.splitserve.bench_split import bench_trainer_rank

        bench_trainer_rank(ctx, trainer, bench, acks=acks)
        return
    if ctx.rank == cfg.split.trainer_ranks[0] and (note := ignored_zero_stage_note(cfg.train)):
        ctx.log(f"note: {note}")
    info = trainer.resume()
    consumed = info.all_consumed if info is not None else {}
    mine = len(info.consumed_ids) if info is not None else 0
    if info is not None:
        ctx.log(f"resumed from {info.path} at step {info.step} ({mine} samples consumed here)")
        if info.schedule_change and ctx.rank == cfg.split.trainer_ranks[0]:  # the same on every rank: said once
            ctx.log(f"note: {info.schedule_change}")
    acks.hello(consumed)
    credits = max(1, cfg.split.max_in_flight // len(sources))
    is_main = ctx.rank == cfg.split.trainer_ranks[0]
    accounting = ConsumerAccounting(
        world=ctx.world, num_target=len(cfg.split.target_ranks),
        tensor_parallel=cfg.split.target_tensor_parallel,
        credits=credits * len(sources), num_sources=len(sources),  # the queue's bound: every link's credits
        path=Path(cfg.train.output_dir) / "accounting.jsonl" if is_main else None,
    )
    accounting.begin(info.step if info is not None else 0)
    receiver = T.SampleReceiver(sources, credits=credits, group=ctx.data_group,
                                device=ctx.device, start=_rotation_start(sources, info))
    stream = ConsumerStream(receiver, ack_group=ctx.ack_group, accounting=accounting,
                            provenance=_provenance(cfg), acks=acks, log=ctx.log)
    # sample id -> the target rank that sent it, for the samples taken lately: the packer
    # holds at most a few batches beyond the last trained step, so the newest ids suffice
    source_of: OrderedDict[str, int] = OrderedDict()

    def tracked(samples):
        for sample in samples:
            source_of[sample.sample_id] = sample.provenance["target_rank"]
            if len(source_of) > 65536:
                source_of.popitem(last=False)
            yield sample

    def rotation_state() -> dict:
        # where the receive rotation stands in consumption order: after the last consumed
        # sample's source (a resume cannot assume strict rotation: a source may have ended)
        last = trainer.consumed_ids[-1] if trainer.consumed_ids else None
        earlier = info.extra.get("last_source") if info is not None else None  # nothing new yet
        return {"last_source": source_of.get(last, earlier)} if last is not None else {}

    batches = stream_pack(tracked(stream.samples()), cfg.split.token_budget)

    def on_step(record: dict) -> None:
        accounting.on_step(record)
        if is_main and record["step"] % cfg.train.log_interval == 0:
            ctx.log(accounting.line())
            accounting.write("interval", record["step"])

    def on_end(result) -> None:
        if is_main:  # under the run folder's lock, as summary.json
            accounting.write("summary", result.step)

    def on_interrupt(step: int) -> None:  # rank 0: an interrupted segment's accounting too
        accounting.write("summary", step)
        write_line(accounting.summary_text(), sys.stderr)

    result = trainer.fit(batches, on_step=on_step, extra_state=rotation_state, on_end=on_end,
                         on_interrupt=on_interrupt)
    dropped = stream.stop(timeout_s=cfg.split.peer_timeout_s)
    if is_main:
        ctx.log(
            f"finished at step {result.step} ({result.stopped_reason}); checkpoint "
            f"{result.checkpoint}; {dropped} samples in transit dropped (not consumed)"
            + (f", {result.untrained} taken for a last step no trainer rank could fill not "
               "trained (nor consumed: a rerun with a higher split.max_epochs trains them)" if result.untrained else "")
        )
        write_line(accounting.summary_text(), sys.stderr)  # one write: the target's last line comes now too
