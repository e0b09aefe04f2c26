"""Atomic file and folder writes: write beside the target, make it durable, rename over it.

``tempfile`` creates private entries (``mkstemp`` 0600, ``mkdtemp`` 0700) and a rename
keeps the mode, so a written file or folder gets :func:`shareable` before it is renamed
into place: the mode a plain ``open``/``mkdir`` would have given it under the current
umask. Otherwise an export or a recipe copy would be unreadable to a server or a
colleague running as another user. A file that :func:`write_atomic` rewrites keeps its
own mode, as ``open(path, "w")`` would: a run's files made group-writable stay so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def _umask() -> int:
    """The process's umask, read where Linux shows it; setting it to read it (the fallback)
    would leave umask 0 for a moment to any thread creating a file meanwhile."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def nearest_existing(path: Path) -> Path | None:
    """``path`` made absolute, or the nearest folder above it that exists: where the missing
    part would be made (a file there means it cannot be); None only if nothing exists."""
    path = Path(path).absolute()
    return next((p for p in (path, *path.parents) if p.exists()), None)


def check_folder_writable(folder: Path, option: str, given: str) -> None:
    """``folder``, or the nearest existing one above it (where the missing ones would be made),
    is a folder this process may write in; else an :class:`~draftforge.errors.InputError` naming
    ``option`` as the user gave it (``given``)."""
    from draftforge.errors import InputError

    existing = nearest_existing(folder)
    if existing is None or not existing.is_dir():
        raise InputError(f"{option} {given}: {existing} is a file, not a folder, so nothing can be "
                         "written under it")
    try:  # made and removed: os.access says yes to root on a read-only mount or in /proc
        tempfile.TemporaryDirectory(prefix=".draftforge-write-check-", dir=existing).cleanup()
    except OSError as exc:
        raise InputError(f"{option} {given}: cannot write in {existing} ({exc.strerror or exc})") from None


def dangling_link(path: Path) -> str | None:
    """"is a symbolic link to nothing (T)" or "is under L, a symbolic link to nothing (T)" where
    ``path`` or a folder above it is one (``mkdir`` stops there with "File exists"), else None."""
    path = Path(path).absolute()
    dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is None:
        return None
    where = "is" if dangling == path else f"is under {dangling},"
    return f"{where} a symbolic link to nothing ({os.readlink(dangling)})"


def file_in_the_way(path: Path) -> str | None:
    """Why no folder can be at ``path`` ("is a file", "is under F, a file", or
    :func:`dangling_link`'s words), or None."""
    if (dangling := dangling_link(path)) is not None:
        return dangling
    existing = nearest_existing(path)
    if existing is None or existing.is_dir():
        return None
    return "is a file" if existing == Path(path).absolute() else f"is under {existing}, a file"


def shareable(path: Path) -> None:
    """Give ``path`` (and, for a folder, everything in it) the mode that ``mkdir``/``open``
    would have: 0o777 or 0o666 less the umask."""
    mask = _umask()
    if not path.is_dir():
        path.chmod(0o666 & ~mask)
        return
    path.chmod(0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            Path(root, name).chmod(0o777 & ~mask)
        for name in files:
            Path(root, name).chmod(0o666 & ~mask)


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename, a new file) durable; a no-op where
    the platform cannot open a folder."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and every folder's entries to disk, so that a
    marker written after this call never outlives the data it vouches for."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(Path(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(root))


def write_atomic(path: Path, payload: bytes | str) -> None:
    """Write ``payload`` (text as UTF-8) to ``path`` through a temporary file in the same
    folder, fsynced, then renamed over it: readers see the old file or the whole new one.

    A failure (a full disk, an unwritable folder) leaves no temporary file and raises an
    ``OSError`` with the failing call's errno whose ``filename`` is ``path``. A ``path`` that
    is a symbolic link is written through, as ``open(path, "w")`` would: the file it points to
    is replaced and the link stays (renaming over the link would leave that file stale)."""
    write_atomic_all([(path, payload)])


def write_atomic_all(items: Sequence[tuple[Path, bytes | str]]) -> None:
    """:func:`write_atomic` for files that belong together: each is written to its temporary
    file and fsynced before the first is renamed over its path, so a full disk or an unwritable
    folder leaves every one of them as it was, not some new beside some old. The renames follow
    in the order given."""
    staged: list[tuple[str, Path, Path]] = []  # (temporary file, path asked, path written)
    try:
        for asked, payload in items:
            staged.append(_stage(Path(asked), payload))
        for tmp, asked, path in staged:
            try:
                os.replace(tmp, path)
            except OSError as err:
                if err.errno is None:
                    raise
                raise _named_error(err, asked, path) from err
    except BaseException:
        for tmp, _, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise
    for folder in dict.fromkeys(path.parent for _, _, path in staged):
        fsync_dir(folder)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files that :func:`write_atomic` of ``path`` leaves only when killed
    outright (SIGKILL, out of memory) between writing and renaming one: ``.NAME.*.tmp`` beside
    it (not a sibling's: ``.NAME.bak.*.tmp``). Call it only while holding the lock that keeps every
    other writer of ``path`` away.
    Returns those removed."""
    path = Path(path)
    stale = [p for p in _made_by_tempfile(path.parent, f".{path.name}.", ".tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _stage(asked: Path, payload: bytes | str) -> tuple[str, Path, Path]:
    """A fsynced temporary file beside ``asked`` (or the file a link there points to) holding
    ``payload``, with the mode the file has or would get: (temporary, asked, path to replace)."""
    if isinstance(payload, str):
        payload = payload.encode("utf-8")
    asked.parent.mkdir(parents=True, exist_ok=True)  # its error names the folder
    path = Path(os.path.realpath(asked)) if asked.is_symlink() else asked
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            try:  # a rewrite keeps the file's permissions
                os.chmod(tmp, os.stat(path).st_mode & 0o777)
            except FileNotFoundError:
                shareable(Path(tmp))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        if err.errno is None:
            raise
        raise _named_error(err, asked, path) from err
    return tmp, asked, path


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give an OSError raised inside (a write or fsync on a full disk says only "[Errno 28] No
    space left on device") ``path`` as its file name, where it names none."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


def _named_error(err: OSError, asked: Path, path: Path) -> OSError:
    """``err`` (which has an errno) naming the file the caller asked for: a write or fsync on a
    full disk says only "[Errno 28] No space left on device", and mkstemp names its temporary
    file (through a link: both, "link -> the file it points to")."""
    return OSError(err.errno, err.strerror, str(asked), *((None, str(path)) if path != asked else ()))


def replace_dir(staging: Path, out: Path) -> None:
    """Move the finished folder ``staging`` to ``out`` (same file system). An existing ``out``
    is first moved aside into ``.NAME.old-*`` beside it and deleted only once the new one is
    in place; a crash between the two renames leaves it there, whole, to be moved back."""
    if not out.exists():
        os.replace(staging, out)
        fsync_dir(out.parent)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:  # both renames: a signal's exception raised as the first returns must move it back too
        os.replace(out, retired / out.name)
        os.replace(staging, out)
    except BaseException:
        if not out.exists() and (retired / out.name).exists():
            os.replace(retired / out.name, out)
        shutil.rmtree(retired, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    shutil.rmtree(retired, ignore_errors=True)


def temporaries_of(out: Path, kind: str) -> list[Path]:
    """The folders ``tempfile.mkdtemp(prefix=f".{out.name}.{kind}-", dir=out.parent)`` made for
    ``out`` (``kind``: ``tmp``, a staging folder; ``old``, :func:`replace_dir`'s aside), sorted:
    not those of a sibling whose name starts the same (``.NAME.old-v1.tmp-*``, an export into
    ``NAME.old-v1`` writing now)."""
    return _made_by_tempfile(out.parent, f".{out.name}.{kind}-", "")


def _made_by_tempfile(folder: Path, prefix: str, suffix: str) -> list[Path]:
    """The entries of ``folder`` named as ``tempfile`` names those it makes with ``prefix`` and
    ``suffix``: 8 of its random characters between them, exactly, sorted."""
    import re

    pattern = re.compile(re.escape(prefix) + "[a-z0-9_]{8}" + re.escape(suffix))
    if not folder.is_dir():
        return []
    return sorted(entry for entry in folder.iterdir() if pattern.fullmatch(entry.name))


def put_back_aside(out: Path, usable: Callable[[Path], bool] | None = None) -> bool:
    """Move back the folder that :func:`replace_dir` had moved aside into ``.NAME.old-*/NAME``
    beside ``out`` where a kill between its two renames left it the only copy: ``out`` does not
    exist. Of several such copies (those ``usable`` accepts, when given) the newest goes back;
    the ``.NAME.old-*`` folders are left for the caller to clear. Returns whether one was put
    back. The caller holds the lock of whatever writes ``out`` (an export's, a run directory's),
    so that no replace_dir is between its renames meanwhile."""
    out = Path(out)
    if out.exists():
        return False
    retired = sorted((p / out.name for p in temporaries_of(out, "old")
                      if (p / out.name).is_dir() and (usable is None or usable(p / out.name))),
                     key=lambda p: p.stat().st_mtime)
    if not retired:
        return False
    os.replace(retired[-1], out)  # the newest: the one the killed replace_dir moved aside
    fsync_dir(out.parent)
    return True


@contextlib.contextmanager
def waiting_lock(path: Path, waiting: str) -> Iterator[None]:
    """Hold ``path`` locked (``flock``), waiting for another holder; the wait is said on stderr
    (``waiting``: what the holder is doing), not silent, since a stopped or hung holder keeps
    every other process waiting."""
    import sys

    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[draftforge] waiting for {path}: {waiting}", file=sys.stderr, flush=True)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class Locked(Exception):
    """Another process holds the lock; ``holder`` is its process id (:func:`flock_holder`, else
    what it wrote in the file), or ``None`` when neither tells."""

    def __init__(self, holder: str | None) -> None:
        super().__init__(holder)
        self.holder = holder


NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # flock's "not here"


@contextlib.contextmanager
def made_folder(folder: Path) -> Iterator[None]:
    """``folder`` made, with its missing parents, while the block runs; on leaving, those this
    made are removed again where they are still empty, so that a command refused before it
    wrote anything leaves no empty folders behind."""
    missing = []
    at = Path(folder).absolute()
    while not at.exists() and at != at.parent:
        missing.append(at)  # the deepest first
        at = at.parent
    Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        for made in missing:
            try:
                made.rmdir()
            except OSError:  # something was written there (or someone else's now): kept
                break


@contextlib.contextmanager
def lock_or_refuse(path: Path, refused: Callable[[str], Exception]) -> Iterator[bool]:
    """Hold :func:`exclusive_lock` at ``path`` (its folder made, :func:`made_folder`) while the
    block runs; when another process holds it, raise ``refused(holder)`` at once (``holder``:
    "process N"). On a file system without ``flock`` (some network ones) the block runs
    unlocked. Yields whether the lock is held."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(made_folder(path.parent))  # removed again if the block writes nothing
            stack.enter_context(exclusive_lock(path))
            locked = True
        except Locked as busy:
            raise refused(f"process {busy.holder}" if busy.holder else "a process that is starting") from None
        except OSError as err:
            if err.errno not in NO_FLOCK:
                raise
            locked = False
            stack.callback(lambda: path.unlink(missing_ok=True))  # made before flock failed
        yield locked


def flock_holder(stat: os.stat_result, locks: Path = Path("/proc/locks")) -> str | None:
    """The process id holding a ``flock`` on the file ``stat`` describes, as Linux lists it in
    ``/proc/locks``; None where that is not known (another system, no such line). It names the
    holder where the lock file's text cannot: a stale file of another user's killed run, held
    as it is in a sticky folder, still reads that run's process id."""
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        lines = locks.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; a waiter's line has "->" after "1:"
        # pid 0: a holder this process cannot see (another pid namespace), so not known here
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
            return fields[4] if int(fields[4]) else None
    return None


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock file at ``path`` (``flock``, so a process that dies releases it)
    while the block runs; raise :class:`Locked` at once when another process holds it. The file
    holds the holder's process id and is removed on leaving, by the holder, while it holds the
    lock; a process that opened it just before is told by the inode check and locks the new one."""
    path = Path(path)
    remade = 0
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            writable = True
        except FileNotFoundError:
            # its folder was just removed: another process that made it and was refused left it
            # empty (made_folder); made again, a few times at most
            if remade >= 3:
                raise
            remade += 1
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        except PermissionError as refused:
            # a lock file a killed run of another user left, in its umask's mode: flock works
            # on a read-only descriptor too, and tells a held lock from a stale file
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # no such file: the folder refused to create it
                raise refused from None
            writable = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = flock_holder(os.fstat(fd)) or os.read(fd, 32).decode(errors="replace").strip() or None
            os.close(fd)
            raise Locked(holder) from None
        except BaseException:  # no flock on this file system (ENOLCK, ...): the caller decides
            os.close(fd)
            raise
        try:
            mine, there = os.fstat(fd), os.stat(path)
            current = (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
        except FileNotFoundError:
            current = False
        if current and not writable:
            try:  # stale (nobody holds it): put one of this user's in its place where the folder allows
                os.unlink(path)
            except PermissionError:  # a sticky folder: hold the lock on the stale file as it is
                break
            os.close(fd)
            continue
        if current:
            break
        os.close(fd)  # the holder removed the file between our open and our lock
    try:
        if writable:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)
        os.close(fd)
