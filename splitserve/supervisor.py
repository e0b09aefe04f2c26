"""Start and watch every rank of a one-machine job, with every socket it opens on loopback.

torchrun's rendezvous store (a ``TCPStore``) listens on all interfaces whatever
address it is given. For jobs on one machine, ``draftforge train`` therefore
starts the ranks itself: this process binds a socket to ``127.0.0.1``, hands the
listening descriptor to torch (``TCPStore(master_listen_fd=...)``) and hosts the
job's store on it; the ranks connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``, the protocol torchrun's own agent uses
with its workers, so ``init_process_group("gloo"|"nccl")`` with ``env://`` works
unchanged). With ``GLOO_SOCKET_IFNAME=lo`` gloo's data sockets bind to loopback
too, and with ``NCCL_SOCKET_IFNAME=lo`` NCCL's bootstrap socket, so nothing the
job opens can be reached from another machine.

Each rank gets the variables torchrun sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ...). When a rank fails, the others get ``grace_s`` seconds to
notice and explain themselves (the trainers name a dead target rank), then
SIGTERM and, after ``term_s`` more, SIGKILL. The job's status is 0 when every
rank exited 0, else that of the rank taken for the cause (128 + signal when it
was killed): the first to fail, except that one killed by a signal at about the same
moment (within a poll, at least half a second) goes before one that exited with an
error, since the others' errors are usually their reaction to it; every failed rank
is named. After a hang the hung rank never fails by itself: the launcher stops it once the grace
is over. When every rank that failed by itself reported a lost peer (exit status
:data:`LOST_PEER_STATUS`), the rank that did not stop by itself (the one that needed SIGKILL
first) is named as the likely cause instead, and listed with the failed ones; the job's status
stays that of the first rank that failed.

Ctrl-C or a SIGTERM to the launcher stops the job, which is never restarted then:
the ranks get the signal (once: a terminal's Ctrl-C already reached them), ``term_s``
seconds later SIGTERM, then SIGKILL; a second signal kills them at once. So does a first
one that comes while the job, a rank of it already failed, waits ``grace_s`` for the others.
:class:`JobInterrupted` (a ``SystemExit`` with status 128 + signal) says so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from draftforge.signals import outside_finalizers
from draftforge.train.metrics import write_line

LOOPBACK = "127.0.0.1"


class JobInterrupted(SystemExit):
    """The launcher was asked to stop (SIGINT, SIGTERM); ``code`` is 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@outside_finalizers  # raised in a __del__, the stop would be printed and lost
def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise JobInterrupted(signum)


@contextlib.contextmanager
def unwinding_on_sigterm(lead: str, hint: str | Callable[[], str]) -> Iterator[None]:
    """Within it, SIGTERM unwinds like Ctrl-C (:class:`JobInterrupted`), so ``finally`` blocks
    stop child processes; a stop, Ctrl-C's KeyboardInterrupt included, prints ``LEAD: stopped
    on SIGNAL; HINT`` and propagates (``hint`` called then, where it depends on how far the
    work got)."""
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        yield
    except (JobInterrupted, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, JobInterrupted) else signal.SIGINT
        said = hint() if callable(hint) else hint
        write_line(f"{lead}: stopped on {signal.Signals(signum).name}; {said}", sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


class SignalForwarder:
    """While entered, Ctrl-C and SIGTERM go to ``procs`` (the list as it grows): once, and not
    a Ctrl-C the terminal already sent their whole process group; a second signal kills them,
    and with ``kill_children`` their children's process groups first (torchrun's ranks, each
    in a session of its own, would outlive a killed torchrun holding their GPUs and ports).
    So does a first signal when ``failed()`` says the job already failed (:attr:`killed_failed`
    then): what is left of it only waits out a grace period.
    :attr:`asked` holds the signals received. Outside the main thread it installs nothing
    (the caller handles signals)."""

    def __init__(self, procs: list[subprocess.Popen], *, kill_children: bool = False,
                 failed: Callable[[], bool] | None = None) -> None:
        self.procs = procs
        self.kill_children = kill_children
        self.failed = failed
        self.killed_failed = False
        self.asked: list[int] = []
        self._previous: dict[int, object] = {}

    def __call__(self, signum: int, _frame: object = None) -> None:
        self.asked.append(signum)
        live = [proc for proc in self.procs if proc.poll() is None]
        if len(self.asked) == 1 and self.failed is not None and self.failed():
            self.killed_failed = True
        if len(self.asked) > 1 or self.killed_failed:  # asked twice, or after a failure: no more waiting
            for proc in live:
                if self.kill_children:
                    for child in children(proc.pid):
                        _kill_group(child)
                proc.kill()
        elif not (signum == signal.SIGINT and terminal_sent_it_to_the_group()):
            for proc in live:
                proc.send_signal(signum)

    def __enter__(self) -> SignalForwarder:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[signum] = signal.signal(signum, self)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def children(pid: int, *, living: bool = False) -> list[int]:
    """The processes whose parent is ``pid``, from Linux's /proc (none where there is none);
    with ``living``, not those that ended and wait to be reaped."""
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 1 and fields[1] == str(pid) and not (living and fields[0] in ("Z", "X")):
            found.append(int(entry))
    return found


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid`` and, when it leads a process group, the whole group."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# A rank's status when it stops because a peer died or went silent (roles.EXIT_PEER_DIED)
LOST_PEER_STATUS = 3
DEFAULT_GRACE_S = 15.0
DEFAULT_TERM_S = 5.0
# An SGLang target rank stopping closes its feature runner first: the children finish their
# batch (up to 30 s) and get 10 s after their own SIGTERM (sglang_runner.FeatureRunnerProcess.close)
SGLANG_TERM_S = 45.0


def term_seconds(target_backend: str) -> float:
    """How long ranks get between SIGTERM and SIGKILL for a recipe's target backend."""
    return SGLANG_TERM_S if target_backend == "sglang" else DEFAULT_TERM_S


def host_store(host: str = LOOPBACK):
    """A listening ``TCPStore`` server bound to ``host`` only; returns ``(store, port)``.

    Keep the store alive for the job's lifetime: it serves the ranks'
    rendezvous and every later key exchange (new process groups, barriers). The
    store owns the listening descriptor from then on (it closes it).
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
    except OSError as exc:  # an unknown name, or an address of another machine
        listener.close()
        from draftforge.errors import InputError

        raise InputError(
            f"--master-addr {host}: the rendezvous cannot listen there ({exc.strerror or exc}); "
            "give an address of this machine (default 127.0.0.1)") from None
    listener.listen(1024)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, use_libuv=True,
        master_listen_fd=listener.fileno(), timeout=datetime.timedelta(minutes=30),
    )  # fmt: skip
    listener.detach()  # torch owns and closes the descriptor now
    return store, port


def rank_env(base: Mapping[str, str], *, rank: int, world: int, host: str, port: int) -> dict[str, str]:
    """The environment of one rank: ``base`` plus what torchrun would set on one node."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default", "MASTER_ADDR": host, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    })  # fmt: skip
    return env


def describe_status(code: int) -> str:
    """``exit status 3`` or ``killed by SIGKILL`` for a ``Popen.returncode``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def die_with(launcher_pid: int, signum: int = signal.SIGTERM):
    """A ``preexec_fn`` (Linux) that has the kernel send the child ``signum`` when the launcher
    dies, even by SIGKILL or an out-of-memory kill, so no child outlives its job holding memory
    and ports. SIGTERM for a child that stops what it started on it (torchrun, an answer
    worker); SIGKILL for a rank, which unwinds on SIGTERM and can be held up in a collective
    with no launcher left to follow up. ``None`` elsewhere (no such kernel feature)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    # Resolved here, in the launcher: the hook runs in the child between fork and exec, where
    # an import could wait forever on a lock that another launcher thread held at the fork.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, death_signal, getppid, exit_now = 1, int(signum), os.getppid, os._exit

    def set_parent_death_signal() -> None:
        prctl(pr_set_pdeathsig, death_signal)
        if getppid() != launcher_pid:  # the launcher died before the call
            exit_now(1)

    return set_parent_death_signal


def run_ranks(
    command: Sequence[str],
    *,
    nproc: int,
    env: Mapping[str, str] | None = None,
    host: str = LOOPBACK,
    labels: Mapping[int, str] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    term_s: float = DEFAULT_TERM_S,
    poll_s: float = 0.05,
    prefix: str = "draftforge train",
    hint: str = "rerun the same command to continue from the newest checkpoint",
) -> int:
    """Run ``command`` as ranks ``0..nproc-1`` and supervise them; returns the job's status.

    ``labels`` name ranks in messages (e.g. ``{0: "target rank 0"}``); ``hint`` ends the line
    that says the job was stopped by a signal (how to continue).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    base = dict(os.environ if env is None else env)
    store, port = host_store(host)
    procs: list[subprocess.Popen] = []

    def name(rank: int) -> str:
        return (labels or {}).get(rank, f"rank {rank}")

    def say(message: str) -> None:  # one write: the ranks write to the same stderr
        write_line(f"{prefix}: {message}", sys.stderr)

    # Ctrl-C or a scheduler's SIGTERM; the handlers are restored after the ranks are gone
    with SignalForwarder(procs) as forwarder:
        asked = forwarder.asked
        try:
            for rank in range(nproc):
                procs.append(subprocess.Popen(list(command), env=rank_env(base, rank=rank, world=nproc,
                                                                         host=host, port=port),
                                              # a rank unwinds on SIGTERM: see die_with
                                              preexec_fn=die_with(os.getpid(), signal.SIGKILL)))
            failures: dict[int, int] = {}  # rank -> status, in the order they were seen
            seen_at: dict[int, float] = {}
            stopped: dict[int, tuple[int, bool]] = {}  # rank the launcher stopped -> (status, SIGKILLed)
            deadline = None
            failed_first = False  # a rank failed before any signal: the grace is running
            while True:
                codes = [proc.poll() for proc in procs]
                new = {r: c for r, c in enumerate(codes) if c not in (None, 0) and r not in failures}
                for rank in sorted(new, key=lambda r: new[r] >= 0):  # signal deaths first
                    failures[rank] = new[rank]
                    seen_at[rank] = time.monotonic()
                    if deadline is None and not asked and not failed_first:  # said once, for the first
                        failed_first = True
                        say(f"{name(rank)} failed ({describe_status(new[rank])}); waiting up to "
                            f"{grace_s:g} s for the other ranks to stop (Ctrl-C stops them now)")
                if deadline is None and (failures or asked):
                    deadline = time.monotonic() + (term_s if asked else grace_s)
                if all(code is not None for code in codes):
                    break
                if failed_first and asked:
                    # Ctrl-C or SIGTERM while the job, already failed, waits for its other ranks
                    # to explain themselves: no more waiting (those left are mostly stuck in a
                    # collective with the dead rank, where SIGINT does not reach them)
                    _kill_now(procs, say=say, name=name, why=signal.Signals(asked[0]).name)
                    break
                if deadline is not None and time.monotonic() > deadline:
                    stopped = _stop(procs, term_s=term_s, say=say, name=name)
                    break
                time.sleep(poll_s)
            if asked:
                after = ""
                if failed_first:
                    first = next(iter(failures))
                    after = f" after {name(first)} failed ({describe_status(failures[first])})"
                say(f"stopped on {signal.Signals(asked[0]).name}{after}; {hint}")
                raise JobInterrupted(asked[0])
            if not failures:
                return 0
            summary, code = failure_summary(failures, seen_at, stopped, name=name, poll_s=poll_s)
            if summary:
                say(summary)
            return code
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            del store  # closes the listening socket


def failure_summary(
    failures: Mapping[int, int],
    seen_at: Mapping[int, float],
    stopped: Mapping[int, tuple[int, bool]] | None = None,
    *,
    name: Callable[[int], str] = lambda rank: f"rank {rank}",
    poll_s: float = 0.05,
) -> tuple[str | None, int]:
    """The launcher's line on a failed job (None where one rank failed and nothing needs
    saying) and the job's status.

    ``failures``: rank -> ``Popen.returncode`` of each rank that failed by itself, in the order
    seen (at ``seen_at[rank]``, monotonic); ``stopped``: rank -> (returncode, whether SIGKILL
    was needed) of each rank the launcher stopped when the grace was over.

    The cause is the first failure, but for a rank killed by a signal at about its moment
    (within a poll, at least half a second: the others' errors are usually their reaction to
    it; one killed later, an NCCL watchdog's abort after its peer vanished, is a reaction
    itself). When every failure is a lost peer (:data:`LOST_PEER_STATUS`) and the launcher had
    to stop ranks, those ranks did not stop by themselves while their peers gave up on them: a
    hung rank (frozen, stopped, deadlocked), which is the likely cause, the one that needed
    SIGKILL first. The status is the cause's among the failures (128 + signal when it was
    killed), the first failure's where the cause is a stopped rank."""
    stopped = dict(stopped or {})
    first = next(iter(failures))
    at_once = max(poll_s, 0.5)
    cause = next((r for r, c in failures.items() if c < 0 and seen_at[r] - seen_at[first] <= at_once), first)
    code = failures[cause]
    status = code if code > 0 else 128 - code
    listed = ", ".join(f"{name(r)} ({describe_status(c)})" for r, c in failures.items())
    if stopped and all(c == LOST_PEER_STATUS for c in failures.values()):
        hung = [r for r, (_, killed) in stopped.items() if killed] or list(stopped)

        def how(code: int, killed: bool) -> str:
            if killed:
                return "killed by SIGKILL after SIGTERM"
            return "stopped by SIGTERM" if code == -signal.SIGTERM else f"{describe_status(code)} on SIGTERM"

        left = ", ".join(f"{name(r)} (did not stop by itself: {how(c, k)})" for r, (c, k) in stopped.items())
        likely = " or ".join(name(r) for r in hung)
        return (f"failed: {listed}, {left}; the first cause is most likely {likely}: the ranks that "
                f"failed all reported a lost peer (exit status {LOST_PEER_STATUS}), and "
                f"{'it' if len(hung) == 1 else 'they'} had to be killed (a hung rank?)"), status
    if len(failures) > 1:
        return f"failed: {listed}; the first cause is most likely {name(cause)}", status
    return None, status


def terminal_sent_it_to_the_group() -> bool:
    """Whether this process runs in the foreground of a terminal, where Ctrl-C reaches
    its whole process group, ranks included."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _kill_now(procs, *, say, name, why: str) -> None:
    """SIGKILL every rank still running, and wait for them."""
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    if running:
        say(f"{why}: killing {', '.join(name(r) for r in running)} (SIGKILL)")
    for rank in running:
        procs[rank].kill()
        procs[rank].wait()


def _stop(procs, *, term_s: float, say, name) -> dict[int, tuple[int, bool]]:
    """SIGTERM the ranks still running, SIGKILL those not gone ``term_s`` later; returns rank ->
    (its returncode, whether it needed SIGKILL) for each one stopped."""
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    if not running:
        return {}
    say(f"stopping {', '.join(name(r) for r in running)} (SIGTERM)")
    for rank in running:
        procs[rank].terminate()
    deadline = time.monotonic() + term_s
    stopped = {}
    for rank in running:
        killed = False
        try:
            procs[rank].wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # a rank inside a collective (its peer gone) handles no signal until that returns
            say(f"{name(rank)} did not stop within {term_s:g} s of SIGTERM (a rank blocked in a "
                "collective handles no signal until it returns); SIGKILL")
            procs[rank].kill()
            procs[rank].wait()
            killed = True
        stopped[rank] = (procs[rank].returncode, killed)
    return stopped
