"""``draftforge train RECIPE [key=value ...] [--dry-run] [--nproc N]``: start a SplitServe job.

Loads and validates the recipe and its split before anything starts, then
starts one ``python -m draftforge.train RECIPE [key=value ...]`` process per
rank and supervises them (``supervisor``): the job's rendezvous store and gloo's
sockets listen on loopback only, unlike torchrun's store, which listens on
every interface. ``torchrun --nproc_per_node=N -m draftforge.train RECIPE``
starts the same job by hand.
``--dry-run`` prints the resolved config, the split, the draft's parameter count,
a per-rank memory estimate and the command each node runs, and exits without
starting anything.

Several machines (``split.num_nodes`` > 1): see ``multinode``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftforge import argtypes
from draftforge.splitserve.multinode import (
    DEFAULT_MASTER_PORT,
    LOOPBACK,
    check_master_port,
    check_node_args,
    is_loopback,
    launch_plan,
    master_addr_problems,
    multinode_torchrun_command,
    node_layout,
    node_rank_problem,
    rank_command,
    rendezvous_failure,
    rendezvous_timeout_s,
    rendezvous_wait_line,
    shown,
)
from draftforge.splitserve.supervisor import (
    JobInterrupted,
    SignalForwarder,
    children,
    die_with,
    run_ranks,
    term_seconds,
)
from draftforge.train.metrics import write_line

DEFAULT_RESTARTS = 3  # with split.restart_target
RESTART_ENV = "DRAFTFORGE_RESTART"  # which restart of the job the ranks belong to
RESTARTS_LEFT_ENV = "DRAFTFORGE_RESTARTS_LEFT"  # how many more the launcher makes after a failure
# Where a rank of this node that refused its input (exit status 2) says so: torchrun exits 1
# whatever its ranks' statuses were, and a restart would fail the same way.
INPUT_ERROR_ENV = "DRAFTFORGE_INPUT_ERROR_FILE"
# the user's own command (JSON list), which run.json records beside each rank's: its launcher
# options (--nproc, --master-addr, --node-rank, --max-restarts) are not in the rank's command
LAUNCH_COMMAND_ENV = "DRAFTFORGE_LAUNCH_COMMAND"
# set for the ranks of a one-node job: whether its launch found the answers file ("file") or
# answers inline ("inline"), so that every rank takes the same source even when 'draftforge
# data regenerate' finishes the file while they start (producer.launch_pin reads it)
ANSWERS_SOURCE_ENV = "DRAFTFORGE_ANSWERS_SOURCE"
# torchrun waits this many seconds for its ranks to stop after its SIGTERM before it SIGKILLs
# them (torch 2.13, installed here, reads it; releases before it was added, about 2.12, wait 30)
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def launch_env(master_addr: str = LOOPBACK, *, cpu: bool = True) -> dict[str, str]:
    """The ranks' environment: gloo's and NCCL's sockets on loopback unless the address is opened."""
    env = dict(os.environ)
    env.pop(ANSWERS_SOURCE_ENV, None)  # the launch sets it for its ranks, nothing inherited does
    if cpu:
        # one intra-op thread per process unless told otherwise: ranks share the cores
        env.setdefault("OMP_NUM_THREADS", "1")
    if is_loopback(master_addr) and sys.platform.startswith("linux"):
        # NCCL's bootstrap listens on the interface it picks, never lo unless told; one
        # node's GPUs talk over P2P or shared memory, not that socket
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            given = env.setdefault(name, "lo")
            if given != "lo":  # the user's to choose, but not silently: it is not loopback
                print(f"draftforge: {name}={given} from the environment: this one-node job's "
                      f"sockets listen there, not on loopback only (unset it to keep them on lo)",
                      file=sys.stderr, flush=True)
    env.setdefault("MASTER_ADDR", master_addr)
    env[LAUNCH_COMMAND_ENV] = json.dumps([sys.executable, *sys.argv])
    return env


def _other_output(folder: Path) -> str | None:
    """What ``folder`` holds that is another command's output, not a run's: an export
    (config.json and its weights) or an evaluation report (report.json); None otherwise."""
    from draftforge.train.export import CONFIG_FILE, is_model_folder

    if is_model_folder(folder):
        return f"is a draft export ({CONFIG_FILE} and its weights)"
    if (folder / "report.json").is_file() and not ((folder / "config.yaml").is_file() or (folder / "checkpoints").is_dir()):
        return "holds an evaluation report (report.json, written by 'draftforge eval --out')"  # and no run yet
    return None


def _not_a_runs_files(folder: Path) -> str | None:
    """Files of the names a run writes (its metrics, accounting, summary, plot) in a folder no
    run has started in (no run.json, config.yaml or checkpoints/): a run would replace or
    append to them."""
    from draftforge.train.metrics import (
        CONFIG_FILE,
        METRICS_FILE,
        PLOT_FILE,
        RUN_FILE,
        SUMMARY_FILE,
    )

    if any((folder / name).exists() for name in (RUN_FILE, CONFIG_FILE, "checkpoints")):
        return None
    found = [name for name in (METRICS_FILE, "accounting.jsonl", SUMMARY_FILE, PLOT_FILE)
             if (folder / name).exists()]
    if not found:
        return None
    return (f"holds {', '.join(found)} but no {RUN_FILE}, so no run wrote them, and a run would replace "
            "or append to them")


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found on this node's disk."""

    regenerate: bool  # no answers file: the target ranks answer the prompts inline
    resume_from: Path | None = None  # the checkpoint train.resume takes, its files checked
    resume_step: int | None = None  # that checkpoint's step


def preflight(cfg, *, check_overlap: bool = False, reads_data: bool = True, loads_draft: bool = True) -> Preflight:
    """Checks of the user's files that need no process group, before torchrun starts.

    No other run may be training in ``train.output_dir``; the checkpoint ``train.resume``
    would pick must be readable and built for this recipe's draft; the data is read and validated exactly as the target
    ranks will read it (the overlap check, ``data.overlap_check``, is left to them unless
    ``check_overlap``: the dry run's only chance to say it); a logger the recipe
    turns on (``train.wandb``, ``train.tensorboard``) must be installed. Without
    ``reads_data`` (a node of several that runs no target rank) the data is not read: the
    trainer ranks never open it, except ``train.markov_init: bigram`` without a checkpoint to
    resume, which counts the answers' bigrams, so then it is read still. Without
    ``loads_draft`` (a node that runs no trainer rank) ``train.init_from`` is not read. Raises
    :class:`~draftforge.errors.InputError` (exit status 2) naming the file or key. Returns
    what it found (:class:`Preflight`).
    """
    from draftforge.files import file_in_the_way
    from draftforge.splitserve.producer import load_source_conversations
    from draftforge.train import checkpoint as ckpt
    from draftforge.train.metrics import missing_loggers

    missing = missing_loggers(cfg.train)
    if missing:  # found here, not by trainer rank 0 after the target has loaded
        from draftforge.errors import InputError

        raise InputError("; ".join(missing))
    run_dir = Path(cfg.train.output_dir)
    blocked = file_in_the_way(run_dir)
    if blocked is not None:
        from draftforge.errors import InputError

        raise InputError(f"train.output_dir: {run_dir} {blocked}; name a folder for the run")
    if (other := _other_output(run_dir)) is not None:  # eval and export would read the folder as that
        from draftforge.errors import InputError

        raise InputError(f"train.output_dir: {run_dir} {other}; a run written there would sit beside it, "
                         "and 'draftforge eval' and 'draftforge export' would take the folder for one or "
                         "the other: name another folder for the run")
    if (foreign := _not_a_runs_files(run_dir)) is not None:
        from draftforge.errors import InputError

        raise InputError(f"train.output_dir: {run_dir} {foreign}: move them away or name another "
                         "folder for the run")
    root = ckpt.checkpoints_root(run_dir)
    if (blocked := file_in_the_way(root)) is not None:  # else found at the first save, steps later
        from draftforge.errors import InputError

        raise InputError(f"train.output_dir: {root}, where the run saves its checkpoints, {blocked}; "
                         "move it away or name another folder for the run")
    if run_dir.is_dir():  # another run training there: refused now, not once the target has loaded
        ckpt.claim_run_dir(run_dir)
        ckpt.release_run_dir(run_dir)
    found = ckpt.find_resume(run_dir, cfg.train.resume)
    step = None
    if found is not None:
        model_config = _model_config(cfg)
        step = int(ckpt.read_checked_state(found, model_config=model_config, strategy=cfg.train.strategy,
                                           trainer_ranks=len(cfg.split.trainer_ranks),
                                           zero_stage=cfg.train.zero_stage, dtype=cfg.train.dtype)["step"])
    if found is None and cfg.train.init_from is not None and loads_draft:  # config now, weights at the start
        from draftforge.train.init_from import preflight_fit

        preflight_fit(cfg)
    if not reads_data and not (cfg.train.markov_init == "bigram" and found is None):
        # a trainers-only node: its ranks take their samples from the target ranks' nodes,
        # which check the data files there (the files need not be on this node)
        return Preflight(regenerate=False, resume_from=None if found is None else Path(found),
                         resume_step=step)
    data = cfg.data if check_overlap else cfg.data.model_copy(update={"overlap_check": False})
    conversations, regenerate = load_source_conversations(cfg.model_copy(update={"data": data}))
    if regenerate and cfg.train.markov_init == "bigram" and found is None:
        from draftforge.errors import InputError
        from draftforge.splitserve.producer import NO_ANSWERS_FOR_MARKOV_INIT

        raise InputError(NO_ANSWERS_FOR_MARKOV_INIT)
    from draftforge.data.formats import DataFormatError
    from draftforge.splitserve.producer import build_topology

    if not conversations:
        raise DataFormatError(
            f"data.train_files {list(cfg.data.train_files)}: no conversations to train on (the files "
            "are empty, or every row was skipped as invalid); check the files"
        )
    # target rank i serves position i of the order first: one conversation each at least
    producers = build_topology(cfg.split).producers
    if len(conversations) < len(producers):
        raise DataFormatError(
            f"data.train_files {list(cfg.data.train_files)}: {len(conversations)} conversations for "
            f"{len(producers)} target ranks, and each needs one at least; add data "
            "(data.num_samples) or use fewer target ranks"
        )
    # a step of every trainer takes train.grad_accum micro-batches of its own samples: with
    # fewer samples than that in all, some trainer has none to train on (it only joins steps
    # with micro-batches that supervise nothing), or no step runs at all (the job would end at
    # step 0, "data_exhausted", with status 0)
    epochs, trainers = cfg.split.max_epochs, len(cfg.split.trainer_ranks)
    needed = trainers * cfg.train.grad_accum
    if epochs is not None and len(conversations) * epochs < needed:
        raise DataFormatError(
            f"data.train_files {list(cfg.data.train_files)}: {len(conversations)} conversations x "
            f"split.max_epochs={epochs} give at most {len(conversations) * epochs} samples, and one "
            f"step of every trainer needs {needed} at least ({trainers} trainer ranks x "
            f"train.grad_accum={cfg.train.grad_accum}); add data "
            "(data.num_samples), raise split.max_epochs or use fewer trainer ranks"
        )
    return Preflight(regenerate=regenerate, resume_from=None if found is None else Path(found), resume_step=step)


def answers_note(cfg, checked: Preflight) -> str:
    """The line saying which answers the run trains on: a regenerated file's, or the target's
    own during training; on a resume whose run's last segment (run.json) took the other, a
    note that the steps from the checkpoint on train on other answers than it did."""
    from draftforge.data.loading import regenerated_path
    from draftforge.train.metrics import RUN_FILE

    path = regenerated_path(cfg.data, cfg.train.output_dir)
    now = "inline" if checked.regenerate else str(path)
    line = ("draftforge train: answers: the target answers the prompts during training (no "
            f"{path} yet)" if checked.regenerate else f"draftforge train: answers: read from {path}")
    if checked.resume_from is None:
        return line
    try:
        segments = json.loads((Path(cfg.train.output_dir) / RUN_FILE).read_text())["segments"]
        before = segments[-1].get("answers")
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return line
    if before is None or before == now:
        return line
    if before == "inline":
        said, keep = "answers the target gave during training", f"move {path} away"
    else:
        said, keep = f"the answers in {before}", f"restore {before}"
    return (f"{line}\nnote: the run's last segment trained on {said}: the steps after step "
            f"{checked.resume_step} train on other answers than the checkpointed run's ({keep} to "
            "continue it on its own)")


def _finished_at(cfg, checked: Preflight) -> str | None:
    """On one node, what to say when the checkpoint ``train.resume`` takes (``checked``) is
    already at ``train.steps`` or beyond: there is nothing to train, and starting the ranks
    would load the target and rewrite the run's config.yaml and run.json for no step. None
    otherwise (on several nodes every node must start, whatever its own disk holds)."""
    from draftforge.train import checkpoint as ckpt
    from draftforge.train.metrics import (
        METRICS_FILE,
        NO_PLOT,
        PLOT_FILE,
        RUN_FILE,
        SUMMARY_FILE,
        read_summary,
    )

    run_dir, found = Path(cfg.train.output_dir), checked.resume_from
    summary = read_summary(run_dir)
    no_plot = None if (run_dir / PLOT_FILE).is_file() else summary.get(NO_PLOT)
    # a checkpoint of another run (train.resume: PATH) is saved into this one by a rerun; a
    # missing summary.json or plot is written again by one (from run.json, or metrics.jsonl),
    # unless the summary records that the plot could not be drawn (no_plot): each rerun would
    # fail again
    if (cfg.split.num_nodes != 1 or found is None
            or found.resolve().parent != ckpt.checkpoints_root(run_dir).resolve()
            or not (run_dir / SUMMARY_FILE).is_file()
            or not ((run_dir / PLOT_FILE).is_file() or isinstance(no_plot, str))):
        return None
    unplotted = "" if no_plot is None else (
        f"\nnote: the run has no {PLOT_FILE}: it could not be drawn ({no_plot}; {SUMMARY_FILE}: "
        f"{NO_PLOT}); to try again, remove {SUMMARY_FILE} and rerun (it comes back from {RUN_FILE}, "
        f"which keeps it, and the plot is drawn from {METRICS_FILE})")
    if checked.resume_step >= cfg.train.steps:
        return (f"draftforge train: nothing to train: checkpoint {found} is at step {checked.resume_step} "
                f"and train.steps is {cfg.train.steps}; the run in {run_dir} is left as it is (raise "
                f"train.steps to train further; 'draftforge export' exports it){unplotted}")
    if _ran_out_of_data_at(run_dir, checked.resume_step, cfg, summary):
        return (f"draftforge train: nothing to train: the run in {run_dir} stopped at step "
                f"{checked.resume_step} of {cfg.train.steps} when its data ran out ({SUMMARY_FILE}: "
                "data_exhausted), with this same recipe, so it would stop there again; it is left as it "
                "is (raise split.max_epochs or add data, data.num_samples, to train further; 'draftforge "
                f"export' exports it){unplotted}")
    return None


def _ran_out_of_data_at(run_dir: Path, step: int, cfg, summary: dict) -> bool:
    """Whether the run's ``summary`` (:func:`~draftforge.train.metrics.read_summary`) says it
    stopped at ``step`` for want of data and its config.yaml is this recipe: a rerun would load
    the target, take no step and stop again."""
    from draftforge.train.metrics import CONFIG_FILE

    try:
        saved = (run_dir / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return False
    return (summary.get("stopped_reason") == "data_exhausted" and summary.get("step") == step
            and saved == cfg.to_yaml())


def _check_output_dir_writable(cfg) -> None:
    """Refuse a ``train.output_dir`` this machine cannot write (a read-only file system, a
    folder of another user) before the target loads, not after, from trainer rank 0's first
    write, as a traceback. Creates and removes a folder in it, or in the nearest one above."""
    from draftforge.errors import InputError
    from draftforge.files import nearest_existing

    run_dir = Path(cfg.train.output_dir)
    existing = nearest_existing(run_dir)
    if existing is None or not existing.is_dir():  # preflight named the file in the way
        return
    try:
        tempfile.TemporaryDirectory(prefix=".draftforge-write-check-", dir=existing).cleanup()
    except OSError as exc:
        where = "" if existing == run_dir.absolute() else f" in {existing}"
        raise InputError(
            f"train.output_dir: {run_dir}: cannot write{where} ({exc.strerror or exc}); name a "
            "folder this machine can write for the run") from None


def _node_ranks(layout, node_rank: int | None) -> range:
    """The ranks this machine (node ``node_rank``, 0 on one node) runs."""
    node = node_rank or 0
    return range(node * layout.nproc_per_node, (node + 1) * layout.nproc_per_node)


def _runs_trainers(cfg, layout, node_rank: int | None) -> bool:
    """Whether this machine (node ``node_rank``, 0 on one node) runs a trainer rank."""
    return any(rank in cfg.split.trainer_ranks for rank in _node_ranks(layout, node_rank))


def _runs_targets(cfg, layout, node_rank: int | None) -> bool:
    """Whether this machine (node ``node_rank``, 0 on one node) runs a target rank."""
    return any(rank in cfg.split.target_ranks for rank in _node_ranks(layout, node_rank))


def _check_trainer_node(cfg, layout, node_rank: int | None) -> None:
    """Refuse to start trainer ranks on a machine where the draft's RoPE base is unknown
    (:func:`~draftforge.splitserve.registry.rope_theta_problem`)."""
    from draftforge.config import RecipeError
    from draftforge.splitserve.registry import rope_theta_problem

    problem = rope_theta_problem(cfg)
    if problem is not None and _runs_trainers(cfg, layout, node_rank):
        raise RecipeError([problem])


def _model_config(cfg) -> dict | None:
    """The draft's DSparkConfig as a dict when the target's shape is known without loading it."""
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    shape = resolve_target_shape(cfg.target)
    if shape is None or cfg.draft.rope_theta is None:  # unknown here: no guess to compare
        return None
    return build_dspark_config(cfg.draft, shape, vocab_size=shape.vocab_size).to_dict()


INPUT_ERROR_STATUS = 2  # how draftforge exits on an InputError (bad recipe, data, checkpoint)


def _bare_address(text: str) -> str:
    """An address as sockets take it: IPv6 without the URL brackets (``[::1]`` is ``::1``).

    An empty one (``--master-addr "$ADDR"`` with ADDR unset) is refused: bound, it listens on
    every interface, and the ranks, told to reach rank 0 at it, retry until the store's timeout.
    So is ``HOST:PORT`` (``10.0.0.1:29500``): a multi-node torchrun would wait for a node 0 at
    host ``10.0.0.1:29500`` until its rendezvous timeout.
    """
    text = text.strip()
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not bare:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no address (an empty one would listen on every interface); give an "
            f"address of this machine, or drop --master-addr for {LOOPBACK} (loopback only)")
    if ":" in bare:  # IPv6, or HOST:PORT, which no socket resolves and torchrun splits wrongly
        import ipaddress

        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is no address: give the host alone (an IPv6 address as is or in "
                "[brackets]) and node 0's port with --master-port") from None
    return bare


def main(argv: Sequence[str] | None = None) -> int:
    """Validate, then start torchrun (or print the dry run); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="draftforge train",
        description="Train a DSpark draft against a live target: target ranks stream features "
        "to trainer ranks (the recipe's split section). Rerun the same command to resume.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="e.g. train.steps=100")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, split, parameter count and memory estimate")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to start on this node; must equal split.world_size / "
                        "split.num_nodes (default: that)")
    parser.add_argument("--max-restarts", type=argtypes.non_negative_int, default=None,
                        help=f"restarts of the whole job after it fails, each from the newest "
                        f"checkpoint (train.resume: auto); default {DEFAULT_RESTARTS} with "
                        "split.restart_target: true, else 0")
    parser.add_argument("--master-addr", default=None, type=_bare_address,
                        help="address the ranks reach rank 0 at (default 127.0.0.1, loopback "
                        "only); give this machine's address only to open the job deliberately. "
                        "Several nodes (split.num_nodes > 1): node 0's address on the cluster "
                        "network, the same on every node (the host alone: the port is "
                        "--master-port's)")
    parser.add_argument("--node-rank", type=argtypes.non_negative_int, default=None,
                        help="this machine's node (0..split.num_nodes-1); needed when "
                        "split.num_nodes > 1")
    parser.add_argument("--master-port", type=argtypes.port, default=DEFAULT_MASTER_PORT,
                        help=f"node 0's rendezvous port when split.num_nodes > 1 (default "
                        f"{DEFAULT_MASTER_PORT})")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    given_addr = args.master_addr  # None: the default, which a multi-node dry run leaves as a placeholder
    args.master_addr = args.master_addr or LOOPBACK

    from draftforge.config import RecipeError, load_recipe
    from draftforge.errors import InputError
    from draftforge.splitserve.roles import check_split

    # a dry run reads it once; a start hands its path to every rank
    cfg = load_recipe(args.recipe, args.overrides,
                      reread=None if args.dry_run else "every rank of the job reads it again")
    if args.dry_run:  # plans every node; a node rank given must still be one of them
        layout = node_layout(cfg)
        problem = node_rank_problem(layout, args.node_rank, needed=False)
        if problem is not None:  # the advice a start gives, an option's error as there
            raise InputError(problem)
        problems = [] if given_addr is None else master_addr_problems(layout, given_addr)
        if problems:  # an address a multi-node start would refuse, refused now
            raise InputError("\n".join(problems))
    else:
        layout = check_node_args(cfg, node_rank=args.node_rank, master_addr=args.master_addr)
        if layout.num_nodes > 1 and args.node_rank == 0:  # node 0's torchrun hosts the rendezvous
            check_master_port(args.master_port)
        _check_trainer_node(cfg, layout, args.node_rank)
    if args.nproc is not None and args.nproc != layout.nproc_per_node:  # an option's error
        raise InputError(
            f"--nproc {args.nproc}: processes on this node: split.world_size / split.num_nodes = "
            f"{cfg.split.world_size} / {layout.num_nodes} = {layout.nproc_per_node} (target ranks "
            f"{cfg.split.target_ranks}, trainer ranks {cfg.split.trainer_ranks}); pass --nproc "
            f"{layout.nproc_per_node}, drop --nproc or change the split (e.g. split.world_size=N)"
        )
    # A dry run plans the job for the machine the recipe names: its GPUs need not be here.
    check_split(cfg, cuda_devices=planned_gpus(cfg) if args.dry_run else None,
                ranks=None if args.dry_run else _node_ranks(layout, args.node_rank))
    restarts = args.max_restarts
    if restarts is None:
        restarts = DEFAULT_RESTARTS if cfg.split.restart_target else 0
    if restarts and cfg.train.resume != "auto":  # with split.restart_target, check_split said so
        raise RecipeError([cfg.locate(
            f"train.resume: --max-restarts {restarts} restarts a failed job from the newest "
            f"checkpoint, which needs train.resume: auto (it is {cfg.train.resume!r}); set "
            "train.resume=auto or drop --max-restarts"
        )])
    # a real run's target ranks check the overlap; a dry run plans every node, so reads the data
    checked = preflight(cfg, check_overlap=args.dry_run,
                        reads_data=args.dry_run or _runs_targets(cfg, layout, args.node_rank),
                        loads_draft=args.dry_run or _runs_trainers(cfg, layout, args.node_rank))
    if _runs_trainers(cfg, layout, args.node_rank):  # trainer rank 0 writes the run there
        _check_output_dir_writable(cfg)
    finished = _finished_at(cfg, checked) if isinstance(checked, Preflight) else None  # None: tests stub it
    if finished is not None and not args.dry_run:  # no rank started, no run file rewritten
        print(finished, flush=True)
        return 0
    if args.dry_run:
        from draftforge.splitserve.dry_run import dry_run

        if finished is not None:
            print(f"note: {finished}", flush=True)
        from draftforge.cli import write_output

        # write_output: a full standard output is an error naming it, not a traceback
        write_output(f"{dry_run(cfg)}\n\n")
        write_output(launch_plan(cfg, args.recipe, args.overrides, master_addr=args.master_addr,
                                 master_port=args.master_port, max_restarts=args.max_restarts) + "\n")
        if not Path(args.recipe).is_file():  # a pipe such as <(...): read once here, but not by a start
            write_output(f"note: {args.recipe} is not a regular file: a start refuses it, since every "
                         "rank of the job reads the recipe again; save it to a file and start with that\n")
        return 0

    if cfg.target.backend == "sglang" and _runs_targets(cfg, layout, args.node_rank):
        # a missing or other SGLang is said once, here, not by every target rank after the start
        # (whose restarts would meet it again); a dry run plans for the machine the recipe names
        from draftforge.splitserve.sglang_backend import require_sglang

        require_sglang()
    env = launch_env(args.master_addr, cpu=not torch_cuda_visible())  # [0] is one GPU: any() said none
    if isinstance(checked, Preflight) and cfg.data.regenerate and cfg.split.num_nodes == 1:  # one finding for every rank
        env[ANSWERS_SOURCE_ENV] = "inline" if checked.regenerate else "file"
        print(answers_note(cfg, checked), flush=True)
    with tempfile.TemporaryDirectory(prefix="draftforge-train-") as folder:
        env[INPUT_ERROR_ENV] = str(Path(folder) / "input-error")
        return _supervise(cfg, args, layout, env, restarts)


def _supervise(cfg, args, layout, env: dict[str, str], restarts: int) -> int:
    """Start this node's ranks, restart the job up to ``restarts`` times after a failure that
    was not an input error; returns the exit status."""
    marker = Path(env[INPUT_ERROR_ENV])
    if layout.num_nodes > 1:
        # the static rendezvous waits this long for the other nodes (torch's default: 900 s,
        # silently, on every attempt), then fails; the line before each wait says so
        timeout = rendezvous_timeout_s(cfg.split)
        command = multinode_torchrun_command(
            args.recipe, args.overrides, layout, node_rank=args.node_rank,
            master_addr=args.master_addr, master_port=args.master_port, rendezvous_timeout=timeout,
        )
        if args.node_rank == 0:
            print(f"draftforge train: node 0 hosts the rendezvous: torch's TCPStore listens on "
                  f"every interface at port {args.master_port}; firewall it to the cluster "
                  "network", file=sys.stderr, flush=True)
        # what this node runs, as one types it (quoted, torchrun for python -m torch.distributed.run)
        print(f"draftforge train: node {args.node_rank} runs: {shown(command)}", file=sys.stderr, flush=True)
        # torchrun takes an option it is not given from PET_<OPTION> (a Kubeflow PyTorchJob sets
        # them): PET_RDZV_BACKEND=c10d or PET_RDZV_ENDPOINT would replace the static rendezvous
        # at --master-addr (ranks handed out in join order, the split's groups scattered over
        # the nodes), PET_MAX_RESTARTS restart ranks behind the launcher's back, PET_LOG_DIR or
        # PET_REDIRECTS hide their messages. The command above says everything.
        ignored = sorted(key for key in env if key.startswith("PET_"))
        if ignored:
            print(f"draftforge train: ignoring torchrun's options from the environment "
                  f"({', '.join(ignored)}): the command above sets the rendezvous",
                  file=sys.stderr, flush=True)

        def run() -> int:  # env as it is now: a restart sets RESTART_ENV
            torchrun_env = {key: value for key, value in env.items() if not key.startswith("PET_")}
            if cfg.target.backend == "sglang":  # torchrun's grace before SIGKILL: 30 s by default
                torchrun_env.setdefault(SHUTDOWN_TIMEOUT_ENV, str(math.ceil(term_seconds("sglang"))))
            print(rendezvous_wait_line(layout, args.node_rank, args.master_addr, args.master_port,
                                       timeout), file=sys.stderr, flush=True)
            seen: dict[int, str] = {}  # this node's ranks torchrun started: none before the rendezvous
            began = time.monotonic()
            status = run_torchrun(command, env=torchrun_env, nproc=layout.nproc_per_node,
                                  hint=_stop_hint(cfg, layout, args.node_rank, every_node=True),
                                  seen=seen)
            # no rank started in all that time: the rendezvous timed out (its traceback says
            # only "timed out" or a store error, not where it waited nor what to check)
            if status != 0 and not seen and time.monotonic() - began >= timeout - 1:
                print(rendezvous_failure(layout, args.node_rank, args.master_addr, args.master_port,
                                         timeout), file=sys.stderr, flush=True)
            return status
    else:
        command = rank_command(args.recipe, args.overrides)
        labels = {r: f"target rank {r}" for r in cfg.split.target_ranks}
        labels.update({r: f"trainer rank {r}" for r in cfg.split.trainer_ranks})
        print(f"draftforge train: {cfg.split.world_size} ranks of {shown(command)} "
              f"(rendezvous on {args.master_addr})", file=sys.stderr, flush=True)

        def run() -> int:
            return run_ranks(command, nproc=cfg.split.world_size, env=env,
                             host=args.master_addr, labels=labels, hint=_stop_hint(cfg, layout, args.node_rank),
                             term_s=term_seconds(cfg.target.backend))

    def start() -> int:
        status = run()
        # torchrun's status is 1 whatever its ranks' were, and the supervisor's may be a rank
        # killed in reaction: the marker says a rank refused its input
        return INPUT_ERROR_STATUS if status != 0 and marker.exists() else status

    env[RESTARTS_LEFT_ENV] = str(restarts)  # a rank then says the launcher restarts, not "rerun"
    status = start()  # JobInterrupted (Ctrl-C, SIGTERM) ends it here: never restarted
    # split.restart_target: a dead rank (a target, usually) ends the job; every rank
    # starts again, exactly as if the user reran the command, and continues from the
    # newest checkpoint (train.resume: auto).
    for attempt in range(1, restarts + 1):
        if status == 0:
            break
        if status == INPUT_ERROR_STATUS:
            print("draftforge train: a rank refused its input (exit status 2); a restart would "
                  "fail the same way, so none is made", file=sys.stderr, flush=True)
            break
        why = "--max-restarts" if args.max_restarts is not None else "split.restart_target"
        print(
            f"draftforge train: the job failed (exit status {status}); restart {attempt} of "
            f"{restarts} ({why}), {_restart_from(cfg, layout, args.node_rank)}",
            file=sys.stderr, flush=True,
        )
        env[RESTART_ENV] = str(attempt)
        env[RESTARTS_LEFT_ENV] = str(restarts - attempt)
        status = start()
    if status != 0:
        refused = status == INPUT_ERROR_STATUS
        print(f"draftforge train: the job failed (exit status {status}); the messages above name "
              f"the failing rank. {_after_failure(cfg, layout, args.node_rank, refused=refused)}",
              file=sys.stderr, flush=True)
    return status


def _restart_from(cfg, layout, node_rank: int | None) -> str:
    """Where a restart continues: the newest checkpoint, or nothing yet (it starts over)."""
    if _no_checkpoint_yet(cfg, layout, node_rank):
        return f"starting over: no checkpoint was written yet in {cfg.train.output_dir}"
    if not _runs_trainers(cfg, layout, node_rank):  # they are on another node's disk: no guess
        return (f"continuing from the newest checkpoint in {cfg.train.output_dir} on the trainers' "
                "node where there is one (starting over where none was written yet)")
    return f"continuing from the newest checkpoint in {cfg.train.output_dir}"


def _no_checkpoint_yet(cfg, layout, node_rank: int | None) -> bool:
    """Whether this node runs trainers and their output folder holds no checkpoint to resume
    (False where the trainers run on another node, or the folder cannot be listed: no guess)."""
    from draftforge.train import checkpoint as ckpt

    try:
        return (_runs_trainers(cfg, layout, node_rank)
                and ckpt.find_resume(Path(cfg.train.output_dir), "auto") is None)
    except OSError:
        return False


def _after_failure(cfg, layout, node_rank: int | None, *, refused: bool = False) -> str:
    """How to continue after the job failed: what a rerun of the same command does. After a
    rank refused its input (``refused``: exit status 2, a bad file or setting, a full disk) the
    same command fails the same way until what it named is fixed: that comes first."""
    from draftforge.train import checkpoint as ckpt

    if refused:
        advice = _after_failure(cfg, layout, node_rank)
        if advice.startswith("No checkpoint was written"):  # says "once the cause is fixed"
            return advice
        return ("A rank refused its input, and the same command would fail the same way: fix "
                "what its message names first. " + advice.replace("Rerun", "Then rerun", 1))
    advice = _not_auto_advice(cfg)
    if advice is not None:  # the same command does not continue from the newest checkpoint
        return advice
    if not _runs_trainers(cfg, layout, node_rank):  # the trainers' node has them, or none
        return (f"Where the trainers' node wrote no checkpoint yet, the same command starts over. "
                f"Rerun the same command on every node to resume from the newest checkpoint "
                f"in {cfg.train.output_dir} on the trainers' node (train.resume={cfg.train.resume}).")
    if ckpt.find_resume(Path(cfg.train.output_dir), "auto") is not None:
        return (f"Rerun the same command to resume from the newest checkpoint in "
                f"{cfg.train.output_dir} (train.resume={cfg.train.resume}).")
    return "No checkpoint was written: once the cause is fixed, the same command starts over."


def _not_auto_advice(cfg) -> str | None:
    """What rerunning the same command does when ``train.resume`` is not ``auto`` (it starts
    over, or resumes from the named checkpoint again, and is refused once the run saved a
    later one: ``checkpoint.find_resume``), and how to continue instead; None for ``auto``."""
    from draftforge.train import checkpoint as ckpt

    resume, run_dir = cfg.train.resume, cfg.train.output_dir
    if resume == "auto":
        return None
    given = cfg.override("train.resume")  # a key given twice is refused: the override is replaced
    rerun = "rerun with train.resume=auto" + (f" in place of '{given}'" if given else "")
    try:  # what the rerun will do, by the rule it applies
        ckpt.find_resume(Path(run_dir), resume)
    except ckpt.CheckpointError:
        newest = ckpt.find_resume(Path(run_dir), "auto")
        if newest is not None:  # the run saved past where the same command would start
            return (f"With train.resume={resume} the same command is now refused ({run_dir} holds "
                    f"{newest.name}, later than where it would start); {rerun} to continue from {newest}.")
    if resume == "never":
        does = f"starts over (refused once {run_dir} holds a checkpoint)"
    else:
        does = f"resumes from {resume} again (refused once {run_dir} holds a later checkpoint)"
    return (f"With train.resume={resume} the same command {does}; {rerun} to continue from the newest "
            "checkpoint instead.")


class _Hint:
    """A stop hint worked out when the launcher prints it: the run may have written its first
    checkpoint since the job started."""

    def __init__(self, make) -> None:
        self._make = make

    def __format__(self, spec: str) -> str:
        return format(self._make(), spec)

    def __str__(self) -> str:
        return self._make()


def _stop_hint(cfg, layout, node_rank: int | None, *, every_node: bool = False) -> _Hint:
    """How to continue after Ctrl-C or SIGTERM stopped the job, for the launcher's last line."""

    def make() -> str:
        advice = _not_auto_advice(cfg)
        if advice is not None:
            return advice[0].lower() + advice[1:]
        on = " on every node" if every_node else ""
        if _no_checkpoint_yet(cfg, layout, node_rank):
            return f"no checkpoint was written yet: the same command{on} starts over"
        if not _runs_trainers(cfg, layout, node_rank):  # their checkpoints are not on this disk
            return (f"rerun the same command{on} to continue from the newest checkpoint on the "
                    "trainers' node (it starts over where none was written yet)")
        return f"rerun the same command{on} to continue from the newest checkpoint"

    return _Hint(make)


def run_torchrun(command: Sequence[str], *, env: Mapping[str, str], nproc: int | None = None,
                 hint: str = "rerun the same command on every node to continue from the newest "
                 "checkpoint", seen: dict[int, str] | None = None) -> int:
    """Run this node's torchrun and wait for it; returns its exit status (128 + the signal
    that killed it, if one did).

    Ctrl-C and SIGTERM go to torchrun (once: a terminal's Ctrl-C reached it already), which
    stops the ranks it started (each in a session of its own, out of reach of a signal to
    this process group) and exits; :class:`JobInterrupted` then says so. A second signal
    kills the ranks and torchrun at once (its first act on the first was to pass it to the
    ranks; killed alone, it would leave those still stopping running on their own). torchrun
    dies with this process (SIGKILL, out of memory): the kernel sends it SIGTERM, and it
    stops its ranks. Ranks torchrun leaves running when it ends (itself killed outright, or
    stopped in the middle of stopping them) are killed, with their process groups: orphans
    would hold their GPUs, ports and the run's lock beside a restarted job.

    With ``nproc`` (the ranks torchrun starts), so does a first signal that comes after some of
    them ended and the others did not: torchrun, after a rank failed, waits up to its own
    grace (30 s) for the others to stop, and a signal then adds that wait once more.

    ``seen``, where given, is filled with the ranks it saw torchrun start (pid -> start time):
    empty after a torchrun that failed at its rendezvous.
    """
    procs: list[subprocess.Popen] = []
    ranks: dict[int, str] = {} if seen is None else seen  # torchrun's ranks seen so far: pid -> start time

    def lost_a_rank() -> bool:
        # torchrun starts a node's ranks together, after the rendezvous: fewer living than
        # nproc, but some, means one ended (one that lived a few ms is never seen by a poll)
        return nproc is not None and bool(procs) and 0 < len(children(procs[0].pid, living=True)) < nproc

    with SignalForwarder(procs, kill_children=True, failed=lost_a_rank) as forward:
        try:
            procs.append(subprocess.Popen(list(command), env=dict(env),
                                          preexec_fn=die_with(os.getpid())))
            if forward.asked:  # a signal came while it started: it gets it now
                forward(forward.asked.pop())
            while True:
                try:
                    status = procs[0].wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if nproc is not None and len(ranks) >= nproc:  # all seen (it restarts none)
                        continue
                    for pid in children(procs[0].pid, living=True):
                        started = _started(pid)
                        if started is not None:
                            ranks.setdefault(pid, started)
        finally:
            if procs and procs[0].poll() is None:  # an exception other than the signals above
                procs[0].terminate()
                procs[0].wait()
            if procs:  # a second signal (or one after a failure) killed them already: no word
                _kill_orphans(ranks, procs[0].returncode,
                              quiet=len(forward.asked) > 1 or forward.killed_failed)
    asked = forward.asked
    if asked:
        after = " after a rank of this node ended (killed what was left)" if forward.killed_failed else ""
        write_line(f"draftforge train: stopped on {signal.Signals(asked[0]).name}{after}; {hint}", sys.stderr)
        raise JobInterrupted(asked[0])
    # torchrun killed by a signal (out of memory: SIGKILL) exits as a shell says, 128 + signal,
    # as a one-machine job's does; Popen's -9 would leave this process with status 247
    return status if status >= 0 else 128 - status


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's field 22), None
    once it is gone or ended (a zombie): with the pid, it names one process, never a later one
    that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 and fields[0] not in ("Z", "X") else None


def _kill_orphans(ranks: Mapping[int, str], status: int | None, *, quiet: bool = False) -> None:
    """SIGKILL (with their process groups) the ranks torchrun left running when it ended: killed
    outright (SIGKILL, out of memory) or stopped mid-shutdown, it did not stop them, and each,
    in a session of its own, would go on holding its GPU, ports and the run's lock, beside a
    restarted job's ranks."""
    import time

    from draftforge.splitserve.supervisor import _kill_group, describe_status

    left = [pid for pid, started in ranks.items() if _started(pid) == started]
    if not left:
        return
    if not quiet:
        how = "ended" if status is None else f"ended ({describe_status(status)})"
        write_line(f"draftforge train: torchrun {how} leaving {len(left)} of its ranks running (pid "
                   f"{', '.join(map(str, left))}); killing them (SIGKILL)", sys.stderr)  # one write: theirs go there too
    for pid in left:
        _kill_group(pid)
    deadline = time.monotonic() + 10
    while any(_started(pid) == ranks[pid] for pid in left) and time.monotonic() < deadline:
        time.sleep(0.05)


def planned_gpus(cfg) -> int:
    """GPUs per node the recipe's split uses (what a dry run assumes): every GPU a group's
    device list names and, where samples go over NCCL as planned on a GPU machine, each
    unlisted rank's node-local GPU LOCAL_RANK; over gloo with train.device cuda (or auto,
    which a GPU machine runs on its GPUs: ``roles._device``), one GPU for each trainer rank of
    the node with the most."""
    from draftforge.splitserve.roles import comm_backend, trainers_by_node

    split = cfg.split
    per_node = split.world_size // split.num_nodes
    nccl = comm_backend(cfg, gpus_visible=True) == "nccl"
    gpus = []
    if cfg.train.device != "cpu" and not nccl:
        gpus += list(range(max(map(len, trainers_by_node(split)))))
    for ranks, devices in ((split.target_ranks, split.target_devices),
                           (split.trainer_ranks, split.trainer_devices)):  # fmt: skip
        if devices is not None:
            gpus += devices
        elif nccl:
            gpus += [rank % per_node for rank in ranks]
    return max(gpus, default=-1) + 1


def torch_cuda_visible() -> list[int]:
    """GPU indices torch can see here (empty on CPU machines)."""
    import torch

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
