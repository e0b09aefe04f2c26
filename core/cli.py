"""The ``draftforge`` command: a table of subcommands dispatched by their words.

Each command is one ``Command`` line: the words that select it, the
``module:function`` that runs it, and a one-line summary. The function takes
the remaining arguments (``main(argv) -> int | None``) and parses them itself,
so commands own their options and their modules are imported only when the
command runs: ``draftforge --help`` never imports torch.

An :class:`~draftforge.errors.InputError` (a bad recipe, a corrupt checkpoint, a
truncated data file, a draft that does not fit its target) from any command is
printed without a traceback and exits with status 2; a recipe's
(:class:`~draftforge.config.RecipeError`) is headed "invalid recipe:".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import select
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from draftforge import __version__
from draftforge.errors import InputError


@dataclass(frozen=True)
class Command:
    """A subcommand: the words that select it, its handler and a summary."""

    words: tuple[str, ...]
    handler: str  # "package.module:function", imported when the command runs
    summary: str
    usage: str = ""  # the arguments shown in the overview

    @property
    def name(self) -> str:
        return " ".join(self.words)


# Later stages add a line each: ("data", ...), ("train",), ("export",), ("eval",), ("bench", ...).
COMMANDS: tuple[Command, ...] = (
    Command(
        ("config", "show"),
        "draftforge.cli:config_show",
        "validate a recipe and print it resolved, derived values filled in",
        "RECIPE [key=value ...]",
    ),
    Command(
        ("config", "keys"),
        "draftforge.reference:main",
        "every recipe key: type, default, bounds and meaning (recipes/README.md)",
    ),
    Command(
        ("bench", "objective"),
        "draftforge.train.bench_objective:main",
        "peak memory and time of the objective, chunked vs unchunked, at Ling scale",
        "[options]",
    ),
    Command(
        ("bench", "train"),
        "draftforge.train.bench_train:main",
        "one trainer step on synthetic features: step time, tokens/s, MFU against the matmul peak of its dtype",
        "[RECIPE] [key=value ...] [options]",
    ),
    Command(
        ("bench", "peer"),
        "draftforge.train.bench_peer:main",
        "SpecForge's DSpark trainer step, then draftforge's, at the same shape: tokens/s, speedup",
        "[--specforge-path DIR] [options]",
    ),
    Command(
        ("bench", "target"),
        "draftforge.splitserve.bench_target:main",
        "tokens per second of the target's features and generate, bf16 vs fp32",
        "[options]",
    ),
    Command(
        ("train",),
        "draftforge.splitserve.launch:main",
        "train a draft: target ranks stream features to trainer ranks (one process per rank)",
        "RECIPE [key=value ...] [--dry-run]",
    ),
    Command(
        ("bench", "split"),
        "draftforge.splitserve.bench_split:main",
        "producer alone, consumer alone, both: split efficiency and idle shares",
        "RECIPE [key=value ...]",
    ),
    Command(
        ("data", "regenerate"),
        "draftforge.data.regenerate:main",
        "answer every prompt with the target (distribution-aligned data), resumable",
        "RECIPE [key=value ...]",
    ),
    Command(
        ("export",),
        "draftforge.train.export_cli:main",
        "write the SGLang / llama.cpp DSpark folder from a checkpoint",
        "RUN_DIR_OR_CHECKPOINT [--out DIR]",
    ),
    Command(
        ("eval",),
        "draftforge.eval.cli:main",
        "speculative decoding with the target vs no-draft and n-gram baselines",
        "DRAFT_DIR [--target NAME_OR_DIR] [--recipe RECIPE]",
    ),
    Command(
        ("eval", "compare"),
        "draftforge.eval.compare:main",
        "is one method's acceptance length ahead of another's? paired bootstrap over prompts",
        "REPORT_A [REPORT_B] [--a-method M] [--b-method M]",
    ),
    Command(
        ("eval", "llamacpp"),
        "draftforge.eval.llamacpp_check:main",
        "llama.cpp's converter and draft-dspark decoding vs draftforge: same outputs and counts?",
        "EXPORT --recipe RECIPE [options]",
    ),
    Command(
        ("demo",),
        "draftforge.eval.demo:main",
        "end to end: regenerate, train DSpark + DFlash, export, evaluate, one table",
        "[RECIPE] [options]",
    ),
)


def config_show(argv: Sequence[str]) -> int:
    """``draftforge config show RECIPE [key=value ...]``: print the resolved recipe."""
    parser = argparse.ArgumentParser(
        prog="draftforge config show",
        description="Load RECIPE strictly, apply key.sub=value overrides, check the split's rules "
        "that hold on every machine, print the resolved YAML.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="path to a recipe YAML file")
    # default=[]: without a default argparse counts a nargs="*" positional as required and
    # names it beside RECIPE when RECIPE is missing, although no override is ever needed.
    parser.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value",
        help="optional overrides, e.g. draft.block_size=8 train.steps=100",
    )
    args = parser.parse_args(list(argv))
    from draftforge.config import load_recipe

    cfg = load_recipe(args.recipe, args.overrides)
    # the split's rules that hold on every machine (draftforge train adds this machine's)
    from draftforge.config import RecipeError
    from draftforge.splitserve.roles import recipe_split_problems

    problems = recipe_split_problems(cfg)
    if problems:
        raise RecipeError([cfg.locate(problem) for problem in problems])
    write_output(cfg.to_yaml())
    return 0


class OutputError(InputError):
    """A write to standard output failed (``> /dev/full``). Printed as ``draftforge X: error:
    standard output: ...``, exit 2."""


def _discard_stdout() -> None:
    """Point standard output at /dev/null: what it still buffers goes nowhere at exit, where a
    second failed flush would print 'Exception ignored' and end the process with status 120.
    Nothing to do for a standard output without a file descriptor (a test's capture)."""
    try:
        fileno = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fileno)
    os.close(null)


def _stdout_error() -> OSError | None:
    """Flush standard output: the OSError that fails it (other than a reader gone, which is
    raised as BrokenPipeError), its buffer then discarded; None where it flushes or is closed."""
    if sys.stdout is None:
        return None
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _discard_stdout()
        return exc
    return None


def write_output(text: str) -> None:
    """Write ``text`` to standard output and flush it, so that a failing output (a full disk)
    is an :class:`OutputError` here, not a traceback or a lost write at interpreter exit.
    Started with standard output closed (``>&-``, a service manager), it writes nothing, as
    ``print`` does. A reader that stopped reading (``| head``) still raises BrokenPipeError,
    which :func:`main` quiets."""
    if sys.stdout is None:
        return
    try:
        sys.stdout.write(text)
    except BrokenPipeError:
        raise
    except OSError as exc:
        _discard_stdout()
        raise OutputError(f"standard output: {exc.strerror or exc}") from None
    failed = _stdout_error()
    if failed is not None:
        raise OutputError(f"standard output: {failed.strerror or failed}") from None


class _GuardedStdout:
    """Standard output while a command runs: a write or flush that fails (a full disk) is an
    :class:`OutputError` naming it, wherever the command prints (``print`` included), not an
    ``OSError`` that a flush afterwards cannot tell from the command's own (the failed write
    drops its buffer, so that flush succeeds). A reader gone still raises BrokenPipeError."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            _discard_stdout()
            raise OutputError(f"standard output: {exc.strerror or exc}") from None

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def writelines(self, lines) -> None:
        self._guarded(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _guarded_stdout() -> Iterator[None]:
    """:class:`_GuardedStdout` in place of ``sys.stdout`` while the block runs (nothing where
    there is no standard output, or it is guarded already)."""
    stream = sys.stdout
    if stream is None or isinstance(stream, _GuardedStdout):
        yield
        return
    sys.stdout = _GuardedStdout(stream)
    try:
        yield
    finally:
        if isinstance(sys.stdout, _GuardedStdout) and sys.stdout._stream is stream:
            sys.stdout = stream


def _overview(commands: Sequence[Command]) -> str:
    width = max(len(f"{c.name} {c.usage}".strip()) for c in commands)
    rows = [f"  {f'{c.name} {c.usage}'.strip():<{width}}  {c.summary}" for c in commands]
    return (
        "usage: draftforge <command> [args ...]\n\n"
        "Train DSpark speculative-decoding drafts against a live target LLM.\n\n"
        "commands:\n" + "\n".join(rows) + "\n\n"
        "Run 'draftforge <command> --help' for a command's options.\n"
    )


def _stdout_gone() -> bool:
    """Whether standard output is a pipe or socket whose reader has closed it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no usable stdout
        return False


def _reader_gone() -> int | None:
    """The status of a command whose output's reader stopped reading (a BrokenPipeError);
    None where the pipe is not standard output but one of the command's own (a worker's,
    a socket), whose error the caller re-raises."""
    if not _stdout_gone():
        return None
    # the output's reader stopped reading (`draftforge train R --dry-run | head`): quiet, as
    # a command killed by SIGPIPE is; what is still buffered goes nowhere at exit
    _discard_stdout()
    return 128 + signal.SIGPIPE


def _show(prog: str, text: str) -> int:
    """Print ``text`` (help, the version) for ``prog``: 0, or 2 with the reason where standard
    output cannot take it."""
    try:
        write_output(text)
    except BrokenPipeError:
        status = _reader_gone()
        if status is None:
            raise
        return status
    except OutputError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    return 0


def _override_first(command: Command, exc) -> str:
    """A hint when the "recipe file" that is missing is a key=value override given before the
    recipe (``draftforge train train.steps=5 r.yaml``); empty otherwise."""
    missing = exc.problems[0].removesuffix(": no such recipe file") if len(exc.problems) == 1 else ""
    if "key=value" not in command.usage or not re.fullmatch(r"[A-Za-z_][\w.]*=.*", missing):
        return ""
    return (f"{missing!r} is a key=value override: the recipe comes first, the overrides after it "
            f"(draftforge {command.name} {command.usage})\n")


def _load(handler: str):
    module_name, _, function = handler.partition(":")
    return getattr(importlib.import_module(module_name), function)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``draftforge`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write(_overview(COMMANDS))
        return 2
    if argv[0] == "help" and len(argv) > 1:  # `draftforge help train`: train's own help
        argv = [*argv[1:], "--help"]
    if argv[0] in ("-h", "--help", "help"):
        return _show("draftforge", _overview(COMMANDS))
    if argv[0] in ("-V", "--version"):
        return _show("draftforge", f"draftforge {__version__}\n")

    matches = [c for c in COMMANDS if tuple(argv[: len(c.words)]) == c.words]
    if not matches:
        prefix = [c for c in COMMANDS if c.words[: len(argv[:1])] == tuple(argv[:1])]
        if prefix:
            if len(argv) > 1 and argv[1] in ("-h", "--help"):
                return _show(f"draftforge {argv[0]}", _overview(prefix))
            given = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else None
            what = f"unknown subcommand {given!r} of" if given else "a subcommand is needed after"
            sys.stderr.write(f"draftforge: {what} '{argv[0]}':\n")
            sys.stderr.write(_overview(prefix).split("commands:\n", 1)[1])
        else:
            groups = sorted({c.words[0] for c in COMMANDS})
            sys.stderr.write(
                f"draftforge: unknown command {argv[0]!r}; valid commands: {', '.join(groups)}\n"
                "Run 'draftforge --help' for the list.\n"
            )
        return 2
    command = max(matches, key=lambda c: len(c.words))

    try:
        from draftforge.allocator import tune_malloc

        tune_malloc()
        if os.environ.get("DRAFTFORGE_PACKED_LINEAR") is not None:  # torch loads only when set
            from draftforge.splitserve.packed_linear import packing_enabled

            packing_enabled()
        with _guarded_stdout():
            status = _load(command.handler)(argv[len(command.words) :])
        # a reader gone (`| head`) or a full disk is found here, not at interpreter exit
        write_output("")
    except SystemExit as stop:
        # argparse's --help (exit 0) prints and ignores a failed write, and a command's own exit
        # (130 after Ctrl-C) may leave output buffered for a reader gone: flushed here, not at
        # exit, where it failed again with status 120; other exits keep their status
        success = stop.code in (0, None)
        try:
            failed = _stdout_error()
        except BrokenPipeError:
            _discard_stdout()
            if success:
                return 128 + signal.SIGPIPE
            raise stop from None
        if failed is not None and success:
            sys.stderr.write(f"draftforge {command.name}: error: standard output: "
                             f"{failed.strerror or failed}\n")
            return 2
        raise
    except KeyboardInterrupt:
        sys.stderr.write("draftforge: interrupted\n")
        return 130
    except BrokenPipeError:
        gone = _reader_gone()
        if gone is None:
            raise
        return gone
    except Exception as exc:
        # A RecipeError (an InputError, headed here by what it is about) can only come from
        # an already imported draftforge.config; looking it up here keeps the config stack
        # out of commands that never load one.
        config = sys.modules.get("draftforge.config")
        if config is not None and isinstance(exc, config.RecipeError):
            sys.stderr.write(f"draftforge {command.name}: invalid recipe:\n{exc}\n{_override_first(command, exc)}")
            return 2
        if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
            # a full disk, a read-only or missing folder: the path and the cause, no traceback
            sys.stderr.write(f"draftforge {command.name}: error: {exc.filename}: {exc.strerror}\n")
            return 2
        if not isinstance(exc, InputError):
            raise
        # A file or argument that cannot be used: the message says which and what to do.
        sys.stderr.write(f"draftforge {command.name}: error: {exc}\n")
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
