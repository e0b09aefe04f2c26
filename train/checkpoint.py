"""Atomic training checkpoints: model, optimizer, schedule, RNG states and the data cursor.

Layout of ``run_dir/checkpoints/step_XXXXXXXX``::

    trainer_state.json    step, skipped steps, strategy, seed, schedule (the next
                          step, its learning rate, the settings it depends on),
                          consumed sample ids per trainer rank and the tokens
                          of each of those samples (a resumed producer replays
                          its assignment to trainers from them), the ids of
                          conversations dropped as too short (recorded per trainer
                          rank with the sample that told of them), the caller's
                          extra state per trainer rank; fsdp2: whether the optimizer
                          had taken a step (``optimizer_stepped``; if not, the moments
                          in ``dcp/`` are only the filler DCP needs and are not loaded)
    draft_config.json     the draft's DSparkConfig (resume and export check it)
    recipe.yaml           the resolved recipe of the run segment that wrote it (the model
                          card's, where the run folder's config.yaml is a later rerun's)
    rng/rank_R.safetensors  torch RNG state of trainer rank R
    model.safetensors     the full model state, unsharded (fsdp2 and deepspeed gather it
                          onto trainer rank 0 too): what export and evaluation read
    optimizer.safetensors single: AdamW moments (+ optimizer.json, its param groups)
    dcp/                  fsdp2: model + optimizer through torch.distributed.checkpoint
    deepspeed/            deepspeed: the engine's own checkpoint
    COMPLETE              written last

Every rank writes into ``step_XXXXXXXX.tmp``; trainer rank 0 writes the state, gives every
file and folder the mode ``open``/``mkdir`` would (safetensors makes its files private) and
writes the ``COMPLETE`` marker, then renames the folder: a checkpoint without its
marker (or a ``.tmp`` folder) is never picked by resume. A failure on any rank
while writing (a full disk, an exception) removes the ``.tmp`` folder and raises
:class:`CheckpointError` on every rank, naming the failing ranks and their errors,
leaving the older checkpoints as they were. Pruning to ``keep_last`` renames a
folder to a hidden name before deleting it, and clears leftovers of crashed saves.
Loading checks every file first (an fsdp2 ``dcp/`` folder's data files against the
sizes its metadata lists, every trainer rank's DeepSpeed files) and names the one that is
missing, corrupt or truncated; a checkpoint of another draft shape, trainer count, strategy
or (deepspeed) ZeRO stage or precision is refused.
Trainer rank 0 holds a lock on the run directory (:func:`claim_run_dir`) from its resume
until its training ends: a second run into the same ``train.output_dir`` is refused.
DeepSpeed's engine is saved and loaded with its world-wide barriers narrowed to
the trainer group (target ranks never join them). Nothing is unpickled except
DeepSpeed's own files, read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftforge.errors import InputError
from draftforge.files import (
    NO_FLOCK,
    Locked,
    exclusive_lock,
    fsync_tree,
    put_back_aside,
    replace_dir,
    shareable,
    write_atomic,
)
from draftforge.train import distributed as D

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
DRAFT_CONFIG_FILE = "draft_config.json"  # the draft's DSparkConfig; export reads it too
RECIPE_FILE = "recipe.yaml"  # the recipe that trained it, for export's model card
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_STALE_TMP = re.compile(r"^step_\d{8}\.tmp$")
_RETIRED = re.compile(r"^\.step_(\d{8})\.old-")  # files.replace_dir's moved-aside copy
RUN_LOCK = ".train.lock"  # in the run directory: held by the trainer rank 0 training there
_claimed: dict[Path, contextlib.ExitStack] = {}  # run directories whose lock this process holds


CHECKPOINTS_DIR = "checkpoints"  # a run folder's checkpoints, one step_N folder each


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def checkpoints_holding(path: Path) -> Path | None:
    """The ``checkpoints/`` folder of a training run that ``path`` is or lies inside, or None.
    A run's folder holds its ``config.yaml`` beside ``checkpoints/``, and ``run.json`` or a
    complete checkpoint (a run of an earlier draftforge); a folder that is merely named so is
    not one. Output written there is not the run's own: pruning (``train.keep_last``) deletes a
    checkpoint folder whole, without a word."""
    path = Path(path).expanduser().absolute()
    for folder in (path, *path.parents):
        if folder.name != CHECKPOINTS_DIR or not (folder.parent / "config.yaml").is_file():
            continue
        if (folder.parent / "run.json").is_file() or any(is_complete(c) for c in folder.iterdir()):
            return folder
    return None


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file() and (Path(path) / STATE_FILE).is_file()


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _put_back_retired(run_dir: Path) -> list[Path]:
    """Put back each complete checkpoint a save killed between replace_dir's two renames left
    only in ``.step_N.old-*`` (:func:`put_back_aside`), so that resume sees it; the emptied
    folders go at the next prune (a copy that is no complete checkpoint stays where it is).
    Done under the run directory's lock: where another run holds it, its own save may be
    between those renames, and nothing is moved. Returns the checkpoints put back."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    steps = sorted({int(m.group(1)) for p in root.iterdir() if (m := _RETIRED.match(p.name))})
    if not steps:
        return []
    held = Path(run_dir).absolute() in _claimed
    if not held:
        try:
            claim_run_dir(run_dir)
        except CheckpointError:  # another run trains there (or the folder cannot be locked)
            return []
    try:
        return [checkpoint_path(run_dir, step) for step in steps
                if put_back_aside(checkpoint_path(run_dir, step), usable=is_complete)]
    finally:
        if not held:
            release_run_dir(run_dir)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of ``run_dir``, oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=_step_of)


def claim_run_dir(run_dir: Path) -> None:
    """Hold the lock of ``run_dir`` until :func:`release_run_dir` or the end of this process (a
    second claim by it is a no-op), or raise :class:`CheckpointError` when another process holds
    it: another run into the same ``train.output_dir``, which would resume from the same
    checkpoint, save into the same ``step_N.tmp`` folders and prune the other's checkpoints. The
    lock is a ``flock``, so a killed run holds none; where the file system has no ``flock``,
    nothing is held. A folder it cannot create or write raises :class:`CheckpointError` too, as
    the launcher checks before the target loads."""
    key = Path(run_dir).absolute()
    if key in _claimed:
        return
    stack = contextlib.ExitStack()
    try:
        key.mkdir(parents=True, exist_ok=True)
        stack.enter_context(exclusive_lock(key / RUN_LOCK))
    except Locked as busy:
        holder = f"process {busy.holder}" if busy.holder else "a process that is starting"
        raise CheckpointError(
            f"train.output_dir {run_dir} is in use by another training run ({holder} holds "
            f"{key / RUN_LOCK}): two runs in one folder would save over each other's checkpoints. "
            "Wait for it to end (or stop it), or use another train.output_dir"
        ) from None
    except OSError as err:
        if err.errno in NO_FLOCK:  # a file system without flock (some network ones): nothing is held
            return
        raise CheckpointError(  # a folder it cannot write, a lock that is not a file: said now
            f"train.output_dir {run_dir}: cannot create or lock {key / RUN_LOCK}: "
            f"{err.strerror or err}") from None
    _claimed[key] = stack


def release_run_dir(run_dir: Path) -> None:
    """Let go of the lock :func:`claim_run_dir` took on ``run_dir`` (removing its file), if held."""
    stack = _claimed.pop(Path(run_dir).absolute(), None)
    if stack is not None:
        stack.close()


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint ``train.resume`` asks for: ``auto`` (newest complete, or none), ``never``, or a path.

    Refuses (:class:`CheckpointError`) a run that would start below complete checkpoints
    already in ``run_dir``: a fresh run (``never``) there, or one resumed from an earlier
    checkpoint. Its checkpoints would sit below the abandoned ones, so ``resume: auto`` and
    ``draftforge export RUN_DIR`` would keep picking those, and pruning to ``keep_last``
    would delete its own.

    A checkpoint that a save killed between the two renames of its re-save left only in its
    moved-aside ``.step_N.old-*`` copy is put back first (:func:`_put_back_retired`).
    """
    _put_back_retired(Path(run_dir))
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    if resume == "never":
        path, start = None, -1  # any checkpoint is another run's
    else:
        path = Path(resume)
        _check_resume_path(path)
        _check_readable(path)
        start = int(_read_state(path)["step"])
    later = [p for p in complete_checkpoints(run_dir) if _step_of(p) > start]
    if later:
        what = "a fresh run (train.resume=never)" if path is None else f"a run resumed from step {start}"
        beyond = "" if path is None else f" beyond step {start}"
        raise CheckpointError(
            f"train.output_dir {run_dir} already holds checkpoints{beyond} "
            f"({', '.join(p.name for p in later)} in {checkpoints_root(run_dir)}); {what} there would save "
            "below them, and train.resume=auto and export would keep picking them. Use another "
            f"train.output_dir, or move those folders out of {checkpoints_root(run_dir)} first"
        )
    return path


_RESUME_WORDS = {"auto": ("auto", "latest", "last", "newest", "true", "yes", "on"),
                 "never": ("never", "none", "null", "no", "false", "off", "fresh")}


def _check_resume_path(path: Path) -> None:
    """Refuse a ``train.resume`` path that is not a complete checkpoint folder, saying what it
    is instead: missing, a file (in a checkpoint: name its folder), a run directory (name one
    of its checkpoints), or a folder without the ``COMPLETE`` marker."""
    if path.is_file():
        inside = f"; name its checkpoint folder, {path.parent}" if is_complete(path.parent) else ""
        raise CheckpointError(f"train.resume: {path} is a file, not a checkpoint folder{inside}")
    if not path.is_dir():
        # a word meant as a setting (None, latest, Auto) is read as a folder name
        word = str(path).strip().lower()
        meant = next((value for value, words in _RESUME_WORDS.items() if word in words), None)
        hint = f"; did you mean train.resume={meant}?" if meant else ""
        raise CheckpointError(
            f"train.resume: checkpoint folder {path} does not exist (train.resume is auto, never, "
            f"or the path of a checkpoint folder{hint})"
        )
    if is_complete(path):
        return
    if checkpoints_root(path).is_dir():
        found = complete_checkpoints(path)
        newest = f"its newest complete one is {found[-1]}" if found else "it holds no complete one"
        raise CheckpointError(
            f"train.resume: {path} is a run directory, not a checkpoint: name one of its "
            f"checkpoints ({newest}), or set train.output_dir={path} with train.resume=auto"
        )
    if (path / "config.json").is_file() and not (path / STATE_FILE).exists():
        # an export holds the weights but none of the optimiser, scheduler and data cursor
        raise CheckpointError(
            f"train.resume: {path} is an export (config.json), not a training checkpoint: an export "
            "has no optimiser, scheduler or data cursor to resume from; name a checkpoint folder "
            "(RUN/checkpoints/step_XXXXXXXX) or use train.resume=auto"
        )
    raise CheckpointError(
        f"train.resume: {path} is not a complete checkpoint (no {COMPLETE} marker); "
        "pick another one or use train.resume=auto"
    )


def _check_readable(path: Path) -> None:
    """Refuse checkpoint ``path`` where this user may not read one of its files or folders (another
    user wrote it, privately), before a check reads such a file as corrupt, or as missing (as
    safetensors reports it), and advises deleting a checkpoint that may well be whole."""

    def refuse(exc: OSError) -> None:
        if isinstance(exc, PermissionError):
            raise CheckpointError(
                f"checkpoint {path}: this user cannot read {exc.filename} ({exc.strerror}); do not "
                "delete the checkpoint for that, it may be whole: have its owner make it readable to "
                f"this user (e.g. chmod -R a+rX {path}), or run as that user"
            )

    for root, _dirs, files in os.walk(path, onerror=refuse):
        for name in files:
            try:
                with open(Path(root, name), "rb"):
                    pass
            except PermissionError as exc:
                refuse(exc)


def _read_state(path: Path) -> dict:
    """``trainer_state.json`` of checkpoint ``path``; :class:`CheckpointError` when it does not parse."""
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no integer 'step' field")
    except (OSError, ValueError) as exc:
        raise _corrupt(state_file, exc, path) from None
    return state


def _is_id_lists(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in value)


def _state_problem(state: dict) -> str:
    """What makes a parsed ``trainer_state.json`` unusable for a resume ("" if nothing): a field
    the trainer reads that is missing or of the wrong type. Fields that older checkpoints lack
    (consumed_tokens, dropped_ids, extra_per_rank, schedule) may be absent."""
    if not isinstance(state.get("skipped_steps"), int):
        return "no integer 'skipped_steps' field"
    if not isinstance(state.get("strategy"), str):
        return "no 'strategy' field"
    ranks = state.get("consumed_ids")
    if not _is_id_lists(ranks) or not ranks:
        return "'consumed_ids' is not a list of sample-id lists, one per trainer rank"
    tokens = state.get("consumed_tokens", [[None] * len(ids) for ids in ranks])
    if not (isinstance(tokens, list) and len(tokens) == len(ranks) and all(
            isinstance(counts, list) and len(counts) == len(ids)
            and all(n is None or (isinstance(n, int) and not isinstance(n, bool) and n > 0) for n in counts)
            for counts, ids in zip(tokens, ranks, strict=True))):
        return ("'consumed_tokens' is not a list of positive token counts per trainer rank, one "
                "for each of its 'consumed_ids'")
    if "dropped_ids" in state and not (_is_id_lists(state["dropped_ids"]) and len(state["dropped_ids"]) == len(ranks)):
        return f"'dropped_ids' is not a list of id lists, one per trainer rank ({len(ranks)})"
    extra = state.get("extra_per_rank", [{}] * len(ranks))
    if not (isinstance(extra, list) and len(extra) == len(ranks) and all(isinstance(e, dict) for e in extra)):
        return f"'extra_per_rank' is not a list of objects, one per trainer rank ({len(ranks)})"
    if not isinstance(state.get("schedule", {}), dict):
        return "'schedule' is not an object"
    if not isinstance(state.get("optimizer_stepped", False), bool):
        return "'optimizer_stepped' is not true or false"
    return ""


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


# -- optimizer state <-> flat tensors (single strategy) ---------------------------------


def _flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{index}.{key}"] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
        for group in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    groups = [
        {k: (tuple(v) if k == "betas" else v) for k, v in group.items()} for group in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


# -- save / load ------------------------------------------------------------------------


class CheckpointError(InputError):
    """A checkpoint cannot be written or read; the message names the file and what to do."""


@contextlib.contextmanager
def _deepspeed_barriers_on(group):
    """Within the block, DeepSpeed's group-less barriers synchronise ``group`` only.

    ``engine.save_checkpoint`` / ``load_checkpoint`` call ``deepspeed.comm.barrier()``
    on the whole world; under a split the target ranks never join it, so the
    trainer ranks would wait forever. Everything else they do is per rank or
    already on the data-parallel (trainer) group.
    """
    import deepspeed.comm as ds_comm

    original = ds_comm.barrier
    trainers = group
    if trainers is None:
        yield
        return

    def barrier(group=None, *args, **kwargs):
        return original(trainers if group is None else group, *args, **kwargs)

    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = original


def _agree_errors(error: str, *, group) -> list[str]:
    """Every trainer rank's error ("" where it had none), in rank order (a collective standing
    in for a barrier), so that each rank can raise the same error naming the failing ranks."""
    if group is None:
        return [error]
    device = torch.device("cpu")
    if torch.distributed.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return [values[0] for values in D.all_gather_strings([error], group=group, device=device)]


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _write_failed(step: int, run_dir: Path, errors: list[str], ranks: list[int] | None = None) -> CheckpointError:
    """``errors`` in group-rank order; ``ranks`` their job ranks (by default 0, 1, ...)."""
    previous = complete_checkpoints(run_dir)
    keep = (f"the previous checkpoint {previous[-1]} is intact and is what resume picks"
            if previous else "no earlier checkpoint exists")
    ranks = list(range(len(errors))) if ranks is None else ranks
    what = "; ".join(f"trainer rank {rank}: {_first_line(e)}" for rank, e in zip(ranks, errors, strict=True) if e)
    return CheckpointError(
        f"writing the checkpoint of step {step} into {checkpoints_root(run_dir)} failed ({what}); "
        f"nothing partial was kept, {keep}. "
        f"Free disk space (or fix the error) and rerun the same command to "
        f"{'resume' if previous else 'start over (there is no checkpoint to resume from)'}."
    )


def _own_dcp_failure(exc: BaseException, rank: int) -> str:
    """This rank's part of a failed ``dcp.save``, which raises on every rank with every rank's
    failure ("" when only other ranks failed: each of those reports its own)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    if rank not in failures:
        return ""
    own = failures[rank][0]
    return f"{type(own).__name__}: {own}"


@contextlib.contextmanager
def _deepspeed_writes_recorded(engine, errors: list[str]):
    """Within the block, a failing write of DeepSpeed's checkpoint is recorded in ``errors``
    instead of raised (later writes are skipped), so that this rank still reaches the
    barriers at the end of ``engine.save_checkpoint`` that the other ranks wait in; the
    caller then raises on every rank together."""
    targets = [(engine.checkpoint_engine, name) for name in ("makedirs", "create", "save", "commit")]
    targets.append((engine, "_copy_recovery_script"))  # rank 0 copies scripts with plain shutil
    saved = []
    for owner, name in targets:
        original = getattr(owner, name)

        def recorded(*args, _original=original, **kwargs):
            if errors:
                return None
            try:
                return _original(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
                errors.append(f"{type(exc).__name__}: {exc}")
                return None

        saved.append((owner, name, name in vars(owner), original))
        setattr(owner, name, recorded)
    try:
        yield
    finally:
        for owner, name, own, original in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def save_checkpoint(
    *,
    run_dir: Path,
    step: int,
    strategy: str,
    model,
    optimizer,
    engine,
    state: dict,
    group,
    keep_last: int,
    model_config: dict | None = None,
    full_state: dict[str, torch.Tensor] | None = None,
    recipe_yaml: str | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically (collective over the trainer group).

    A failure on any rank (a full disk, an exception mid-write) removes the
    temporary folder on every rank's behalf and raises :class:`CheckpointError`
    on every rank; the complete checkpoints already on disk are left alone.
    ``model_config`` (the draft's DSparkConfig as a dict) is stored as
    ``draft_config.json`` so that export and resume can check it. ``full_state``
    (fsdp2, deepspeed: the gathered, unsharded model state) is written by trainer
    rank 0 as ``model.safetensors`` beside the strategy's own files, so every
    checkpoint can be exported; resume reads the strategy's files. ``recipe_yaml`` (the run's
    resolved recipe) is stored as ``recipe.yaml``: what export's model card shows for it.
    """
    rank = D.group_rank(group=group)
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    error = ""
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    errors = _agree_errors(error, group=group)
    if any(errors):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(step, run_dir, errors, D.job_ranks(group=group))
    writing = tmp / "rng" / f"rank_{rank}.safetensors"  # the file being written, for the message
    try:
        save_file({"cpu": torch.get_rng_state()}, str(writing))
        if strategy == "single":
            model_state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            save_file(model_state, str(writing := tmp / "model.safetensors"))
            tensors, meta = _flatten_optimizer(optimizer.state_dict())
            save_file(tensors, str(writing := tmp / "optimizer.safetensors"))
            _write_json(writing := tmp / "optimizer.json", meta)
        elif full_state is not None and rank == 0:
            save_file({k: v.detach().contiguous().cpu() for k, v in full_state.items()},
                      str(writing := tmp / "model.safetensors"))
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        # safetensors' error ("I/O error: No space left on device (os error 28)") names no file
        error = f"{type(exc).__name__}: {_first_line(str(exc), 200)}"
        if str(writing) not in error:
            error += f" (writing {writing})"
    if strategy == "fsdp2":
        # collective: dcp gathers every rank's failure and raises on all of them
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # get_state_dict gives an optimizer without state one by a zero-lr AdamW step (step
        # count 1): the first real update would then use step 2's bias correction (0.744x at
        # betas 0.9/0.999). Such state is saved (DCP needs it) but taken back here and on load.
        stepped = bool(optimizer.state)
        state = {**state, "optimizer_stepped": stepped}
        try:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state},
                     checkpoint_id=str(tmp / "dcp"), process_group=group)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the latter is a BaseException
            error = error or _own_dcp_failure(exc, rank)
        finally:
            if not stepped:
                optimizer.state.clear()
    elif strategy == "deepspeed":
        written: list[str] = []
        try:
            with _deepspeed_barriers_on(group), _deepspeed_writes_recorded(engine, written):
                engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
        except Exception as exc:  # noqa: BLE001
            written.append(f"{type(exc).__name__}: {exc}")
        error = error or (written[0] if written else "")
    elif strategy != "single":
        raise ValueError(f"unknown strategy {strategy!r}")
    errors = _agree_errors(error, group=group)
    if any(errors):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(step, run_dir, errors, D.job_ranks(group=group))
    if rank == 0:
        try:
            if model_config is not None:
                _write_json(tmp / DRAFT_CONFIG_FILE, model_config)
            if recipe_yaml is not None:
                write_atomic(tmp / RECIPE_FILE, recipe_yaml)
            _write_json(tmp / STATE_FILE, state)
            shareable(tmp)  # safetensors writes its files 0600: another user could not resume or export
            fsync_tree(tmp)  # every file on disk before the marker that vouches for them
            write_atomic(tmp / COMPLETE, f"step {step}\n".encode())
            replace_dir(tmp, final)  # a re-save (after resuming further back) keeps the old one until then
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
        if not error:
            try:
                _prune(run_dir, step=step, keep_last=keep_last)
            except OSError as exc:  # housekeeping: never fails a save that is complete
                print(f"[trainer] warning: {final} is saved, but removing older checkpoints failed "
                      f"({type(exc).__name__}: {exc}); they stay until the next save prunes them",
                      file=sys.stderr, flush=True)
    errors = _agree_errors(error, group=group)
    if any(errors):
        raise _write_failed(step, run_dir, errors, D.job_ranks(group=group))
    return final


def _prune(run_dir: Path, *, step: int, keep_last: int) -> None:
    """Keep checkpoint ``step`` and the ``keep_last - 1`` complete ones before it (trainer rank 0,
    after ``step`` is in place); also clears what crashed saves and prunes left behind.

    A pruned folder is first renamed to a hidden ``.step_N.trash-*`` name, so a crash while
    deleting it never leaves a ``step_N`` folder with its marker but without its files.
    """
    root = checkpoints_root(run_dir)
    older = [p for p in complete_checkpoints(run_dir) if _step_of(p) < step]
    doomed = older[: max(0, len(older) - (keep_last - 1))]
    kept = [p for p in complete_checkpoints(run_dir) if p not in doomed]
    oldest_kept = _step_of(kept[0]) if kept else step
    for old in doomed:
        trash = root / f".{old.name}.trash-{uuid.uuid4().hex[:8]}"
        try:
            old.rename(trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    for leftover in root.iterdir():
        name = leftover.name
        if name.startswith(".step_") and ".trash-" in name:  # a prune that crashed
            shutil.rmtree(leftover, ignore_errors=True)
        elif _STALE_TMP.match(name):  # a save that crashed; this step's was renamed already
            shutil.rmtree(leftover, ignore_errors=True)
        elif (retired := _RETIRED.match(name)) is not None:
            # replace_dir's moved-aside copy: the only one if it crashed between its renames,
            # so it goes only once its step is back in place or older than every kept one
            number = int(retired.group(1))
            if is_complete(checkpoint_path(run_dir, number)) or number < oldest_kept:
                shutil.rmtree(leftover, ignore_errors=True)


def unfinished_saves(run_dir: Path) -> list[Path]:
    """The ``step_N.tmp`` folders of saves that did not finish (a kill, a crash mid-save): never
    resumed from, and removed at the next checkpoint's prune."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STALE_TMP.match(p.name))


def _after_deleting(checkpoint: Path) -> str:
    """What a rerun does once ``checkpoint`` is deleted: resume from an earlier complete one
    beside it, or, where there is none, start over (which the advice must not hide)."""
    # only step_XXXXXXXX folders: resume ignores a backup copy (step_N.bak) or a crashed save's
    # step_N.tmp, so counting one would promise a resume where the rerun starts over
    earlier = [p for p in checkpoint.parent.glob("step_*")
               if _STEP_DIR.match(p.name) and p.name < checkpoint.name and is_complete(p)]
    if earlier:
        return "to resume from the previous complete checkpoint"
    return "and rerun: the run starts over, as no earlier complete checkpoint exists"


def _corrupt(file: Path, exc: BaseException, checkpoint: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {file} is corrupt or truncated ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); delete the folder {checkpoint} "
        f"{_after_deleting(checkpoint)}, or point train.resume at another one"
    )


def _load_failed(file: Path, exc: BaseException, checkpoint: Path) -> CheckpointError:
    """:func:`_corrupt`, except for running out of memory while loading, which says nothing of
    the files: that one says to keep the checkpoint (deleting it would lose the run's progress)."""
    detail = str(exc).splitlines()[0] if str(exc) else "no detail"
    text = str(exc).lower()  # torch's CPU allocator raises a RuntimeError: "not enough memory"
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in text or "not enough memory" in text:
        return CheckpointError(
            f"loading checkpoint {file} ran out of memory ({type(exc).__name__}: {detail}); that says "
            f"nothing against {checkpoint}: keep it, free memory on the trainer's device (other "
            "processes on it) and resume again"
        )
    return _corrupt(file, exc, checkpoint)


def _check_dcp(path: Path) -> None:
    """Check checkpoint ``path``'s ``dcp/`` folder (fsdp2) without DCP unpickling anything: its
    ``.metadata`` through :mod:`draftforge.train.dcp_safe`'s allowlisting unpickler, and every
    data file it lists present and as long as its items; :class:`CheckpointError` naming the file."""
    from draftforge.train.dcp_safe import UnsafeCheckpointError, check_metadata, short_storage_file

    metadata_file = path / "dcp" / ".metadata"
    try:
        metadata = check_metadata(path / "dcp")
    except UnsafeCheckpointError as exc:
        raise CheckpointError(
            f"checkpoint file {metadata_file} is not DCP metadata: {exc}; refusing to "
            f"unpickle it (it could run code). Delete the folder {path} {_after_deleting(path)}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a missing, truncated or garbled pickle
        raise _corrupt(metadata_file, exc, path) from None
    short = short_storage_file(path / "dcp", metadata)
    if short is not None:
        file, problem = short
        raise _corrupt(file, ValueError(problem), path)


def _deepspeed_zero_stage(path: Path) -> int | None:
    """The ZeRO stage that wrote checkpoint ``path``'s ``deepspeed/`` files, read from their names
    (ZeRO-3 writes the model states per rank, ZeRO-2 one file), or None where there are none."""
    folder = path / "deepspeed" / "state"
    if any(folder.glob("*zero_pp_rank_*_model_states.pt")):
        return 3
    if any(folder.glob("mp_rank_*_model_states.pt")):
        return 2
    return None


def _deepspeed_dtype(path: Path) -> str | None:
    """``bfloat16`` or ``float32``: the precision of the engine that wrote checkpoint ``path``'s
    ``deepspeed/`` files (DeepSpeed prefixes its optimizer-state files with ``bf16_`` under
    bf16, and loads only those of its own precision), or None where there are none."""
    names = [f.name for f in (path / "deepspeed" / "state").glob("*zero_pp_rank_*_optim_states.pt")]
    if not names:
        return None
    return "bfloat16" if all(name.startswith("bf16_") for name in names) else "float32"


def _run_mismatch(path: Path, state: dict, *, strategy: str | None, trainer_ranks: int | None,
                  zero_stage: int | None = None, dtype: str | None = None) -> None:
    """Refuse a checkpoint written by another number of trainer ranks, another strategy or
    (deepspeed) another ZeRO stage or precision."""
    saved_size = len(state["consumed_ids"])
    if trainer_ranks is not None and saved_size != trainer_ranks:
        raise CheckpointError(
            f"checkpoint {path} was written by {saved_size} trainer rank(s); this run has "
            f"{trainer_ranks}. Resume with the same number of trainer ranks. Make split.trainer_ranks "
            f"list {saved_size} rank(s) (and split.world_size match), or start a fresh run in another "
            "train.output_dir"
        )
    if strategy is not None and state["strategy"] != strategy:
        raise CheckpointError(
            f"checkpoint {path} was written with train.strategy={state['strategy']!r}, "
            f"this run uses {strategy!r}. Resume with train.strategy={state['strategy']}, or start "
            "a fresh run in another train.output_dir"
        )
    saved_stage = _deepspeed_zero_stage(path) if state["strategy"] == "deepspeed" else None
    if zero_stage is not None and saved_stage is not None and saved_stage != zero_stage:
        # DeepSpeed would fail inside load_checkpoint with a bare AssertionError
        raise CheckpointError(
            f"checkpoint {path} was written with train.zero_stage={saved_stage}, this run uses "
            f"{zero_stage}: DeepSpeed cannot load one stage's files into the other. Resume with "
            f"train.zero_stage={saved_stage}, or start a fresh run in another train.output_dir"
        )
    saved_dtype = _deepspeed_dtype(path) if state["strategy"] == "deepspeed" else None
    if dtype is not None and saved_dtype is not None and saved_dtype != dtype:
        # DeepSpeed would look for the other precision's file names: a FileNotFoundError
        raise CheckpointError(
            f"checkpoint {path} was written with train.dtype={saved_dtype}, this run uses {dtype}: "
            "DeepSpeed keeps its optimizer state under file names of its precision and loads only "
            f"its own. Resume with train.dtype={saved_dtype} (auto is bfloat16 only on CUDA or a "
            "CPU with native bf16 matmuls), or start a fresh run in another train.output_dir"
        )


def _strategy_files(path: Path, strategy: str, trainer_ranks: int) -> list[Path]:
    """The files that resuming from checkpoint ``path`` reads besides the state and RNG files:
    those of the strategy that wrote it, every trainer rank's."""
    if strategy == "single":
        return [path / "model.safetensors", path / "optimizer.safetensors", path / "optimizer.json"]
    if strategy == "fsdp2":
        return [path / "dcp" / ".metadata"]  # it names the data files (_check_dcp)
    if strategy != "deepspeed":
        return []
    folder = path / "deepspeed" / "state"
    stage = _deepspeed_zero_stage(path)

    def named(pattern: str, fallback: str) -> Path:
        return next(iter(sorted(folder.glob(pattern))), folder / fallback)

    files = [named(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt",
                   f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for rank in range(trainer_ranks)]
    if stage == 3:
        files += [named(f"*zero_pp_rank_{rank}_mp_rank_*_model_states.pt",
                        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt") for rank in range(trainer_ranks)]
    else:
        files.append(named("mp_rank_*_model_states.pt", "mp_rank_00_model_states.pt"))
    return files


def _check_strategy_files(path: Path, state: dict) -> None:
    """Name the first file the resume would read that is missing, or (``optimizer.json``, a
    DeepSpeed ``.pt`` zip) unreadable, before any rank loads anything: otherwise a partial
    copy passes every check and one rank fails alone inside the strategy's load."""
    import zipfile

    for file in _strategy_files(path, state["strategy"], len(state["consumed_ids"])):
        if not file.is_file():
            raise _missing(file, path)
        if file.suffix == ".pt":  # torch.save's zip: a truncated one has no central directory
            try:
                zipfile.ZipFile(file).close()
            except (OSError, zipfile.BadZipFile) as exc:
                raise _corrupt(file, exc, path) from None
    if state["strategy"] == "single":
        meta_file = path / "optimizer.json"
        try:
            meta = json.loads(meta_file.read_text())
            if not (isinstance(meta, dict) and isinstance(meta.get("scalars"), dict)
                    and isinstance(meta.get("param_groups"), list)
                    and all(isinstance(g, dict) for g in meta["param_groups"])):
                raise ValueError("not an object with 'param_groups' (a list of objects) and 'scalars'")
        except (OSError, ValueError) as exc:
            raise _corrupt(meta_file, exc, path) from None


def read_checked_state(path: Path, *, model_config: dict | None = None, strategy: str | None = None,
                       trainer_ranks: int | None = None, zero_stage: int | None = None,
                       dtype: str | None = None) -> dict:
    """The trainer state of checkpoint ``path``, its files checked before anything loads.

    Checks that this user may read every file, that ``trainer_state.json`` parses, that
    every file the strategy that wrote it reads back is there (every trainer rank's;
    ``optimizer.json`` parses, DeepSpeed's
    ``.pt`` files are whole zips), that every safetensors file's
    header is readable, that a ``dcp/`` folder's metadata is DCP's and its data
    files are all there and whole, and (given ``model_config``) that the stored draft
    config is there and has the same shape fields, and (given ``strategy``, ``trainer_ranks``,
    ``zero_stage``, ``dtype``: deepspeed's) that the run that wrote it had them; raises
    :class:`CheckpointError` naming the file and what to do. Reads no tensor data and runs
    no collective.
    """
    from safetensors import safe_open

    from draftforge.train.compat import config_differences

    path = Path(path)
    _check_readable(path)
    state = _read_state(path)
    if problem := _state_problem(state):
        raise _corrupt(path / STATE_FILE, ValueError(problem), path)
    _run_mismatch(path, state, strategy=strategy, trainer_ranks=trainer_ranks, zero_stage=zero_stage,
                  dtype=dtype)
    for rank in range(len(state["consumed_ids"])):  # every strategy writes one per trainer rank
        if not (rng_file := path / "rng" / f"rank_{rank}.safetensors").is_file():
            raise _missing(rng_file, path)
    _check_strategy_files(path, state)
    draft_file = path / DRAFT_CONFIG_FILE
    if model_config is not None and not draft_file.is_file():  # a draft of any shape would pass
        raise _missing(draft_file, path)
    if model_config is not None:
        try:
            saved = json.loads(draft_file.read_text())
            if not isinstance(saved, dict):  # the shape check would skip it, or raise TypeError
                kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(saved), "a number")
                raise ValueError(f"{'null' if saved is None else kind}, not an object of DSparkConfig fields")
        except (OSError, ValueError) as exc:
            raise _corrupt(draft_file, exc, path) from None
        differences = config_differences(saved, model_config, saved_name="checkpoint",
                                         current_name="this recipe")
        if differences:
            raise CheckpointError(
                f"checkpoint {path} was written for a different draft:\n  "
                + "\n  ".join(differences)
                + "\nResume with the recipe that run used, or start a fresh run in another "
                "train.output_dir."
            )
    for file in sorted(path.rglob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    handle.get_slice(name)
            if file.stat().st_size < 8:
                raise ValueError("shorter than a safetensors header")
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise _corrupt(file, exc, path) from None
    if (path / "dcp").is_dir():
        _check_dcp(path)
    return state


def _raise_lost_peer(exc: BaseException) -> None:
    """Raise, as the RuntimeError it is, a collective's failure inside a strategy's load that
    another trainer going away caused (DCP collects every rank's failure in ``failures``): not
    the checkpoint's fault, so not a :class:`CheckpointError`, whose exit status 2 stops the
    launcher's restarts and whose advice is to delete a checkpoint that may be whole."""
    from draftforge.train.dcp_safe import failures

    for error in failures(exc):
        if isinstance(error, BaseException) and D.lost_peer(error):
            raise (error if isinstance(error, RuntimeError) else RuntimeError(str(error))) from None


def _missing(file: Path, checkpoint: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {checkpoint} has no {file.relative_to(checkpoint)}; it is incomplete: delete it "
        f"{_after_deleting(checkpoint)}"
    )


def _load_tensors(file: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except FileNotFoundError:
        raise _missing(file, checkpoint) from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise _corrupt(file, exc, checkpoint) from None


def load_checkpoint(*, path: Path, strategy: str, model, optimizer, engine, group,
                    model_config: dict | None = None) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; returns the trainer state.

    Files are checked first (:func:`read_checked_state`); a corrupt file or a
    draft of another shape raises :class:`CheckpointError` naming it.
    """
    path = Path(path)
    state = read_checked_state(path, model_config=model_config, strategy=strategy,
                               trainer_ranks=D.group_size(group=group))
    rank = D.group_rank(group=group)
    torch.set_rng_state(_load_tensors(path / "rng" / f"rank_{rank}.safetensors", path)["cpu"])
    if strategy == "single":
        loaded = _load_tensors(path / "model.safetensors", path)
        try:
            model.load_state_dict(loaded, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(
                f"checkpoint {path / 'model.safetensors'} does not match this draft: "
                f"{str(exc).splitlines()[0]}; resume with the recipe that run used"
            ) from None
        try:
            meta = json.loads((path / "optimizer.json").read_text())
        except (OSError, ValueError) as exc:
            raise _corrupt(path / "optimizer.json", exc, path) from None
        tensors = _load_tensors(path / "optimizer.safetensors", path)
        try:
            optimizer.load_state_dict(_unflatten_optimizer(tensors, meta))
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise _corrupt(path / "optimizer.safetensors", exc, path) from None
    elif strategy == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from draftforge.train.dcp_safe import (
            CheckedFileSystemReader,
            CheckedLoadPlanner,
            unsafe_failure,
        )

        model_state, optim_state = get_state_dict(model, optimizer)
        target = {"model": model_state, "optimizer": optim_state}
        _check_dcp(path)  # names a bad .metadata or data file before any rank loads
        reader = CheckedFileSystemReader(str(path / "dcp"))  # DCP's .metadata: the allowlist only
        try:
            dcp.load(target, checkpoint_id=str(path / "dcp"), storage_reader=reader,
                     process_group=group, planner=CheckedLoadPlanner())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the latter is a BaseException
            if reader.refused is not None:  # .metadata changed since _check_dcp read it
                raise CheckpointError(
                    f"{reader.refused}. Delete the folder {path} {_after_deleting(path)}") from None
            unsafe = unsafe_failure(exc)
            if unsafe is not None:
                raise CheckpointError(
                    f"{path / 'dcp'} holds a non-tensor item that is not plain data; refusing to "
                    f"unpickle it (it could run code): {unsafe}"
                ) from None
            _raise_lost_peer(exc)
            raise _load_failed(path / "dcp", exc, path) from None
        set_state_dict(model, optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
        if state.get("optimizer_stepped") is False:  # the saved moments are get_state_dict's filler
            optimizer.state.clear()
    elif strategy == "deepspeed":
        with _deepspeed_barriers_on(group):
            try:
                load_path, _ = engine.load_checkpoint(
                    str(path / "deepspeed"), tag="state", load_optimizer_states=True,
                    load_lr_scheduler_states=False)
            except Exception as exc:  # noqa: BLE001 - torch.load / DeepSpeed raise many types
                _raise_lost_peer(exc)
                raise _load_failed(path / "deepspeed", exc, path) from None
        if load_path is None:
            raise CheckpointError(f"deepspeed could not load the checkpoint in {path / 'deepspeed'}")
    return state
