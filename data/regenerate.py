"""Distribution-aligned data: the target answers every training prompt itself.

``draftforge data regenerate RECIPE [key=value ...]`` loads the recipe's prompts
(``data.train_files``), answers them with the recipe's target and sampling settings
(``target.generation``) and writes one jsonl row per prompt::

    {"id": ..., "messages": [...], "unfinished_turns": [...], "reply_token_ids": [...],
     "generation": {settings}, "target": "<name>", "target_fingerprint": "...",
     "arithmetic": {"device": ..., "backend": ..., "dtype": ..., "threads": ...}}

``unfinished_turns`` lists the message indices of replies the target did not end
itself (cut at ``max_new_tokens``); their end-of-turn marker is not supervised.
``reply_token_ids`` lies beside ``messages``: each reply's token ids as the target generated
them (its end-of-turn token left out), null for the other messages. Training supervises
these ids, not the reply's text tokenised again, where they spell that text; a byte-level
BPE tokenises some text otherwise than the target generated it (SmolLM2 writes ``ĊĊ``
before a list item, which ``"\n\n1."`` tokenises as ``Ċ``, ``Ċ``, ``1``). A row without the
key (an engine that reports no ids, an earlier draftforge) is tokenised from its text.
``target_fingerprint`` tells apart targets of one name (``splitserve.target.target_name``:
two local folders both called ``final``); it is absent for a registered target.

to ``data.regenerated_file`` (default ``<train.output_dir>/regenerated.jsonl``).
Multi-turn prompts are answered turn by turn: each user turn is answered given the
system prompt and the conversation regenerated so far.

Resumable and crash-safe:

- prompts are split into fixed batches of ``generation.batch_size`` in prompt order, and
  each batch is generated with a seed derived from the recipe seed, the ids in the batch
  and the turn, so a batch's replies never depend on what ran before it;
- the finished rows of a batch are appended to ``<out>.partial`` in one write and
  fsync'ed; a rerun keeps the rows there and generates only the missing batches;
- a batch with only some of its rows on disk (a write cut by a crash, at a line
  boundary or inside a line) is dropped and generated again whole -- identically; so is
  the short last batch of an earlier run over fewer prompts, which this run's batches
  extend;
- a finished ``<out>`` ending in an incomplete line (cut while copied: this command renames
  only whole files into place) is continued from its whole rows, as an interrupted run's
  ``.partial`` is, and replaced; a larger recipe's file so cut (or ending in a blank line) whose
  whole rows answer every prompt of this run is rewritten with its whole rows and accepted, as
  the whole file would be;
- a row repeated word for word (two runs appending to one file, a finished file
  concatenated with itself, which training would refuse) is dropped, the finished file
  rewritten with each row once; a second, different answer to one id is refused with the
  file and both lines (``check_answers`` refuses both, naming the lines);
- when every prompt is answered the rows are written in prompt order to a temporary
  file that is renamed to ``<out>``; ``<out>`` is never half-written;
- a finished ``<out>`` extended to more prompts stays in place until the extended file
  replaces it: its rows go to ``<out>.partial`` with the first new batch, in one rename,
  so a run stopped part way leaves the finished file usable, and the ``.partial`` beside
  it (holding prompts ``<out>`` lacks) is continued by a rerun;
- a second run on the same file while one writes it is refused at once (the first holds
  ``<out>.lock``, an ``flock`` that a killed run releases), where both would otherwise
  generate and the second fail at its end;
- rows are reused only when their id is one of this run's prompts, their system prompt
  and user turns equal that prompt's, and their target (name and fingerprint; a local folder
  renamed or moved since is recognised by its fingerprint) and settings equal this run's;
  anything else is refused with the file and id, never mixed in. A finished file that
  answers every prompt and more (a larger recipe's) is accepted as it is; training
  reads the rows of its own prompts, by id (``check_answers``). A larger recipe's stopped
  ``<out>.partial`` (its other rows of this run's target and settings) is used likewise: its
  rows of this run's prompts are kept, the missing ones answered into it, and ``<out>`` is
  written with this run's rows, the ``.partial`` left for the larger run to continue.

So an interrupted run followed by a rerun writes exactly the same file as an
uninterrupted run (given a deterministic engine, which the transformers backend is) over
the same prompts in the same order. Rows are reused by id: prompts reordered between runs
(``data.train_files`` in another order, rows inserted before others) keep answers that
were generated in other batches, with other seeds: valid answers of the same target and
settings, but not the file an uninterrupted run in the new order writes.

On a CPU with the transformers backend, ``--workers`` processes (default: one per
core, at most one per batch) answer whole batches side by side, each with its own
target (``data/answer_workers.py``); batches are written as they finish, and since a
batch's answers depend only on the batch, the file is the same for any number of
workers with the same ``--threads`` each (in float32 for any thread count too; in native
bfloat16 the thread count changes some answers). ``arithmetic`` records where the
answers were computed (device, backend, dtype, and on a CPU the threads of each target);
a rerun that would continue a file written with other arithmetic is refused, since the
file would then mix two (threads are compared only outside float32). Since the default
``--threads`` follows the number of batches, a rerun continuing a file defaults to the count
recorded in it where the count matters (``continued_threads``). Files written before
the record existed are continued without the check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from draftforge.cores import usable_cores
from draftforge.data.formats import Conversation, DataFormatError
from draftforge.data.tokenize import ChatTemplateError, template_failure
from draftforge.errors import InputError
from draftforge.files import (
    Locked,
    exclusive_lock,
    fsync_dir,
    made_folder,
    remove_stale_temporaries,
    write_atomic,
)
from draftforge.splitserve.supervisor import unwinding_on_sigterm

if TYPE_CHECKING:
    from draftforge.splitserve.config import GenerationConfig


class ReplyEngine(Protocol):
    """The part of ``splitserve.target.TargetEngine`` that regeneration uses."""

    name: str

    def generate(
        self, conversations: list[list[dict[str, str]]], settings: GenerationConfig
    ) -> list[str]: ...


class RegenerationError(InputError):
    """An existing answers file does not match this run's prompts, target or settings."""


@dataclass
class RegenerateReport:
    """What a regeneration run did."""

    path: Path
    num_prompts: int
    num_reused: int
    num_generated: int

    def summary(self) -> str:
        """One line with the counts and the output file."""
        return (
            f"{self.num_prompts} prompts: {self.num_generated} answered now, "
            f"{self.num_reused} already done -> {self.path}"
        )


def batch_seed(base_seed: int, ids: Sequence[str], turn: int) -> int:
    """The sampling seed of one generation call: a function of the batch, not of the run."""
    digest = hashlib.sha256(f"{base_seed}\x1f{turn}\x1f".encode() + "\x1f".join(ids).encode())
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF


def answer_batch(
    prompts: Sequence[Conversation], engine: ReplyEngine, settings: GenerationConfig
) -> tuple[list[list[dict[str, str]]], list[list[int]], list[list[list[int] | None]]]:
    """Regenerated conversations for a batch of prompts, answered turn by turn.

    Also returns, per conversation, the message indices of assistant turns the
    target did not finish (cut at ``max_new_tokens``; replies without a
    ``finished`` attribute count as finished), and a list beside its messages holding each
    reply's generated token ids (``Reply.token_ids``; None for the other messages and where
    the engine reports none).
    """
    histories = [[m for m in p.messages if m["role"] == "system"] for p in prompts]
    turns = [p.user_turns for p in prompts]
    ids = [p.id for p in prompts]
    unfinished: list[list[int]] = [[] for _ in prompts]
    generated: list[list[list[int] | None]] = [[None] * len(h) for h in histories]
    for turn in range(max(len(t) for t in turns)):
        active = [i for i, t in enumerate(turns) if turn < len(t)]
        for i in active:
            histories[i].append({"role": "user", "content": turns[i][turn]})
            generated[i].append(None)
        call_settings = settings.model_copy(update={"seed": batch_seed(settings.seed, ids, turn)})
        try:
            replies = engine.generate([list(histories[i]) for i in active], call_settings)
        except InputError as err:  # a prompt the template or the target refuses: name it
            index = getattr(err, "conversation_index", None)
            if index is None:
                raise
            prompt = prompts[active[index]]
            where = f"{prompt.source or 'prompt'} (id {prompt.id!r})"
            where += f", user turn {turn + 1}" if turn else ""  # a later turn's prompt holds replies
            if isinstance(err, ChatTemplateError):
                if err.__cause__ is None:
                    raise
                raise ChatTemplateError(f"{where}: {template_failure(err.__cause__, 'this prompt')}") from err
            # "target 'x': the prompt of conversation 3 has ..." names its place in this batch
            problem = str(err).replace(f"the prompt of conversation {index}", "the prompt", 1)
            raise InputError(f"{where}: {problem}") from err
        if len(replies) != len(active) or not all(isinstance(r, str) for r in replies):
            raise RuntimeError(
                f"target {engine.name!r} returned {len(replies)} replies for {len(active)} "
                "conversations (one string per conversation expected)"
            )
        for i, reply in zip(active, replies, strict=True):
            if not getattr(reply, "finished", True):
                unfinished[i].append(len(histories[i]))
            histories[i].append({"role": "assistant", "content": str(reply)})
            token_ids = getattr(reply, "token_ids", None)
            generated[i].append(None if token_ids is None else list(token_ids))
    return histories, unfinished, generated


def answered_batches(pending: Sequence[tuple[int, list[Conversation]]], engine: ReplyEngine,
                     settings: GenerationConfig):
    """``(batch index, conversations, unfinished, generated ids)`` (:func:`answer_batch`'s) for
    every pending batch: in order from
    ``engine`` itself, or in the order they finish from an engine that answers batches
    itself (``answer_workers.WorkerPool``)."""
    if hasattr(engine, "answer_batches"):
        yield from engine.answer_batches(pending, settings)
        return
    for b, todo in pending:
        yield b, *answer_batch(todo, engine, settings)


def _row_line(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")


def _append(handle, payload: bytes, path: Path) -> None:
    """Append ``payload`` to ``path``, open unbuffered as ``handle``, and make it durable. A
    failure (a full disk) raises an ``OSError`` whose ``filename`` is ``path``: the file
    system says only "No space left on device"."""
    try:
        view = memoryview(payload)
        while view:
            view = view[handle.write(view):]
        os.fsync(handle.fileno())
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from err


def _not_a_row(path: Path, number: int, problem: object) -> RegenerationError:
    return RegenerationError(
        f"{path}, line {number}: not a regenerated row ({problem}); this file was not "
        "written by 'draftforge data regenerate' -- move it away and rerun"
    )


def _row_problem(row: Any) -> str | None:
    """What keeps a parsed line from being a regenerated row, or None."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str):
        return "not a row object with a string id"
    messages = row.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        return "no 'messages' list of {role, content} strings"
    return None


def _read_rows(
    path: Path, keep: Callable[[dict[str, Any], int], bool] | None = None
) -> tuple[list[dict[str, Any]], bool]:
    """Complete rows of an output file (those ``keep(row, line number)`` accepts, if given),
    and whether its last line was torn. Read line by line: a checked file of any size costs
    one row of memory."""
    rows = []
    valid = 0  # rows read, kept or not
    torn = blank = False
    bad: tuple[int, ValueError] | None = None  # an unparsable line: torn if it is the last
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if bad is not None:
                raise _not_a_row(path, *bad)
            if not line.endswith(b"\n"):  # bytes after the last newline: the last write was cut
                if not valid:  # ... of a first row, which begins as every row written here does
                    _check_cut_first_row(path, number, line)
                torn = True
                break
            # a blank line (an edit; none is written here) is no row, as the data loader
            # skips it; the last line blank is taken as an unparsable last line, rewritten
            blank = not line.strip()
            if blank:
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
                bad = (number, exc)
                continue
            # valid JSON is never a torn write (a cut object does not parse), wherever it is
            problem = _row_problem(row)
            if problem is not None:
                raise _not_a_row(path, number, problem)
            valid += 1
            if keep is None or keep(row, number):
                rows.append(row)
    if bad is not None and not valid:  # not one row: no regenerated file, whatever its end says
        raise _not_a_row(path, *bad)
    # a cut inside the last line's bytes that happens to end in "\n"
    return rows, torn or blank or bad is not None


def _check_cut_first_row(path: Path, number: int, line: bytes) -> None:
    """Refuse an unterminated line before any whole row that is not a cut regenerated row: a
    text file without a final newline, or a JSON object that is no row (each regenerated row
    is written as ``{"id": ...``), which would be taken for a cut write and replaced."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        if not line.lstrip().startswith(b'{"id": '):
            raise _not_a_row(path, number, exc) from None
        return
    problem = _row_problem(row)
    if problem is not None:
        raise _not_a_row(path, number, problem)


class _FirstOfEachId:
    """A ``keep`` for :func:`_read_rows`: a row repeated word for word (two runs appending the
    same batch, a file concatenated with itself) is dropped; another answer to an id already
    answered is refused with both lines. ``line[id]`` is the line of each kept row, and
    ``repeated`` the ``(line, line of the first)`` of the first repetition. Rows are
    remembered by digest: a checked file of any size costs 32 bytes an id."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digest: dict[str, bytes] = {}
        self.line: dict[str, int] = {}
        self.repeated: tuple[int, int] | None = None

    def __call__(self, row: dict[str, Any], line: int) -> bool:
        ident = row["id"]
        digest = hashlib.sha256(json.dumps(row, sort_keys=True).encode()).digest()
        if ident not in self.digest:
            self.digest[ident], self.line[ident] = digest, line
            return True
        if digest != self.digest[ident]:
            raise RegenerationError(
                f"{self.path}, line {line}: a second, different answer to id {ident!r} "
                f"(the first is on line {self.line[ident]}; were two runs writing it at "
                "once?); move it away and rerun to answer every prompt anew")
        self.repeated = self.repeated or (line, self.line[ident])
        return False


def _asked(messages: Sequence[dict[str, str]]) -> list[tuple[str, str]]:
    """What a conversation asked: its system prompt and user turns, without the answers."""
    return [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]


def _setting_differences(written: Any, wanted: dict) -> str:
    """``key: file X, this run Y`` for each generation setting that differs."""
    if not isinstance(written, dict):
        return f"no generation settings recorded (this run: {wanted})"
    keys = sorted(set(written) | set(wanted))
    return "; ".join(
        f"{key}: file {written.get(key, '(absent)')!r}, this run {wanted.get(key, '(absent)')!r}"
        for key in keys
        if written.get(key) != wanted.get(key)
    )


def arithmetic_record(*, device: str, backend: str, dtype: str, threads: int | None,
                      tensor_parallel: int = 1) -> dict[str, Any]:
    """What a regeneration run computes its answers with, as written into every row: the
    device type, the target backend, the dtype, and the intra-op threads of each target on
    a CPU (or the tensor-parallel width on a GPU)."""
    record: dict[str, Any] = {"device": device.split(":")[0], "backend": backend, "dtype": dtype}
    if record["device"] == "cpu":
        record["threads"] = threads
    else:
        record["tensor_parallel"] = tensor_parallel
    return record


def arithmetic_differences(written: Any, wanted: dict[str, Any] | None) -> str | None:
    """``key: file X, this run Y`` for each part of the arithmetic that would change answers,
    or None when the two may be mixed: equal, or one side unrecorded (a file written before
    the record, or a run that has none). Threads matter only outside float32."""
    if not isinstance(written, dict) or wanted is None:
        return None
    if written.get("dtype") == wanted.get("dtype") == "float32":
        written, wanted = ({k: v for k, v in d.items() if k != "threads"} for d in (written, wanted))
    return _setting_differences(written, wanted) if written != wanted else None


def continued_threads(out: Path, arithmetic: dict[str, Any]) -> tuple[Path, int] | None:
    """The file a run writing ``out`` with ``arithmetic`` (its threads left out) would continue
    (``<out>.partial``, else ``<out>``) and the threads per target its answers were computed
    with, where the count decides answers (a CPU, outside float32) and all else matches this
    run's: the default for ``--threads``, whose own default follows the number of batches, so
    that a rerun with default options is never refused for a count its user never chose.
    None otherwise (also for a file from before the record)."""
    # read before the lock (it sets --threads' default): another run may rename its .partial to
    # <out> between the look and the read, so a file gone is looked for again, as <out>
    for path in (out.with_name(out.name + ".partial"), out):
        if not path.is_file():
            continue
        try:
            return _threads_of(path, arithmetic)
        except FileNotFoundError:
            continue
    return None


def _threads_of(path: Path, arithmetic: dict[str, Any]) -> tuple[Path, int] | None:
    """:func:`continued_threads` of one file; FileNotFoundError where it has gone."""
    with path.open("rb") as lines:
        for line in lines:
            try:
                written = json.loads(line).get("arithmetic")
            except (ValueError, RecursionError, AttributeError):  # a cut or blank line: _regenerate's to judge
                continue
            if isinstance(written, dict):
                threads = written.get("threads")
                if (written.get("dtype") != "float32" and isinstance(threads, int)
                        and written == dict(arithmetic, threads=threads)):
                    return path, threads
                return None
    return None


def _where(path: Path, line: int | None) -> str:
    return f"{path}" if line is None else f"{path}, line {line}"


def _check_arithmetic(rows: list[dict[str, Any]], path: Path, arithmetic: dict[str, Any] | None) -> None:
    """Refuse to continue ``path`` with other arithmetic than its rows were written with."""
    for row in rows:
        differences = arithmetic_differences(row.get("arithmetic"), arithmetic)
        if differences:
            hint = ""
            written = row["arithmetic"]
            only_threads = {k: v for k, v in written.items() if k != "threads"} == \
                {k: v for k, v in arithmetic.items() if k != "threads"}
            if only_threads and written.get("threads") not in (None, arithmetic.get("threads")):
                hint = f" (rerun with --threads {written['threads']}, or without --threads, to continue it)"
            raise RegenerationError(
                f"{path} (id {row['id']!r}) was answered with other arithmetic ({differences}); "
                "continuing it would mix answers computed two ways, which may differ: rerun as "
                f"it was written{hint}, or move it away and rerun to answer every prompt anew"
            )


def _check_rows(
    rows: list[dict[str, Any]], path: Path, prompts: dict[str, Conversation], settings: dict,
    target: str, *, line: int | None = None, lines: dict[str, int] | None = None,
    others: bool = False,
) -> None:
    """Refuse rows that do not answer ``prompts`` with ``target`` and ``settings``; ``line``
    (of a single row), or ``lines[id]`` (of each row), goes into the message. A ``target``
    with a ``fingerprint`` (``splitserve.target.TargetName``) must match the one the rows record.
    ``others``: rows of other ids (a larger run's) are accepted, checked for target and settings."""
    fingerprint = getattr(target, "fingerprint", None)
    for row in rows:
        where = _where(path, line if lines is None else lines.get(row["id"]))
        if row["id"] not in prompts:
            if not others:
                raise RegenerationError(
                    f"{where} holds id {row['id']!r}, which is not among this run's prompts; it "
                    "was written for other data: move it away (or restore data.train_files / "
                    "data.num_samples) and rerun"
                )
        elif _asked(row["messages"]) != _asked(prompts[row["id"]].messages):
            raise RegenerationError(
                f"{where} (id {row['id']!r}) answers a different prompt than this run's prompt "
                f"{row['id']!r} (the prompt set changed since it was written, e.g. a newer "
                "built-in set); move it away and rerun to answer the current prompts"
            )
        written = row.get("target_fingerprint")
        # a local folder renamed or moved since (the same config, tokenizer and weights) is
        # the same target: its fingerprint says so where the name cannot
        moved = written is not None and written == fingerprint
        if row.get("target") != target and not moved:
            raise RegenerationError(
                f"{where} (id {row['id']!r}) holds answers of target {row.get('target')!r}, but "
                f"this run's target is {target!r}; move it away and rerun to answer with this "
                "target (or restore target.model)"
            )
        # Rows written before fingerprints were recorded have none, nor do a registered
        # target's: those are accepted on the name alone.
        if written is not None and fingerprint is not None and written != fingerprint:
            raise RegenerationError(
                f"{where} (id {row['id']!r}) holds answers of target {row['target']!r} "
                f"(fingerprint {written}), but this run's target {target!r} is another model of "
                f"that name (fingerprint {fingerprint}); move it away and rerun to answer with "
                f"this target ({_restore_hint(target)})"
            )
        if row.get("generation") != settings:
            raise RegenerationError(
                f"{where} (id {row['id']!r}) was written with other target.generation settings "
                f"({_setting_differences(row.get('generation'), settings)}); move it away or "
                "restore the settings, then rerun"
            )


def _restore_hint(target: str) -> str:
    """What to restore for a target of the same name whose fingerprint differs: the random
    target's is its seed and shape, a folder's its files (target.model names it the same)."""
    if target == "random":
        return "or restore target.seed and target.shape"
    return ("or point target.model at the folder that wrote it: the config, tokenizer or weights "
            "of this one differ")


def check_answers(
    path: str | os.PathLike[str],
    prompts: Sequence[Conversation],
    settings: GenerationConfig,
    target: str,
) -> None:
    """Refuse a finished answers file that does not answer this run's prompts: each of
    ``prompts`` must have a row with the same id, system prompt and user turns, written with
    ``target`` (and its fingerprint, when both it and the row have one) and ``settings``.
    Rows of other ids are ignored (a larger recipe's file holds a smaller one's prompts).
    Raises :class:`RegenerationError` naming the file and what differs: training from a
    stale file would silently learn from other answers."""
    path = Path(path)
    by_id = {p.id: p for p in prompts}
    settings_json = settings.model_dump(mode="json")
    answered: set[str] = set()
    once = _FirstOfEachId(path)  # training reads each id once: a repeated row is refused

    def check(row: dict[str, Any], line: int) -> bool:  # checked as read; no row is kept
        if once(row, line) and row["id"] in by_id:
            _check_rows([row], path, by_id, settings_json, target, line=line)
            answered.add(row["id"])
        return False

    _, torn = _read_rows(path, keep=check)
    if torn:
        raise RegenerationError(
            f"{path} ends with an incomplete line; rerun 'draftforge data regenerate' to rewrite it"
        )
    if once.repeated is not None:
        raise RegenerationError(
            f"{path}, line {once.repeated[0]}: repeats line {once.repeated[1]} word for word; "
            "rerun 'draftforge data regenerate' (with the same overrides) to rewrite it with "
            "each row once"
        )
    missing = len(by_id) - len(answered)
    if missing:
        raise RegenerationError(
            f"{path} answers {len(answered)} of this run's {len(by_id)} prompts; run "
            "'draftforge data regenerate RECIPE' (with the same overrides) to answer the rest"
        )


def regenerate(
    prompts: Sequence[Conversation],
    engine: ReplyEngine,
    settings: GenerationConfig,
    out_path: str | os.PathLike[str],
    *,
    progress: bool = True,
    arithmetic: dict[str, Any] | None = None,
) -> RegenerateReport:
    """Answer every prompt with ``engine`` and write ``out_path`` (see the module docstring).

    ``arithmetic`` (from :func:`arithmetic_record`) is written into every new row, and rows
    already on disk with other arithmetic are refused instead of continued. A second run on the
    same file while one writes it is refused at once (``<out>.lock``), not at its end."""
    out = Path(out_path)
    with answers_held(out):
        for leftover in (out, out.with_name(out.name + ".partial")):  # a killed writer's, only
            remove_stale_temporaries(leftover)
        return _regenerate(prompts, engine, settings, out, progress=progress, arithmetic=arithmetic)


_HELD: set[Path] = set()  # the answers files whose lock this process holds (answers_held)


@contextlib.contextmanager
def answers_held(out: Path) -> Iterator[None]:
    """Hold ``<out>.lock`` while the block runs, its folder made (and removed again where the
    block leaves it empty: :func:`~draftforge.files.made_folder`); a second writer of ``out`` is
    refused at once, naming its process, and so is a folder where the lock cannot be made.
    Held already by this process (the command takes it before the target loads, then
    :func:`regenerate`), it is held on."""
    out = Path(out).absolute()
    if out in _HELD:
        yield
        return
    lock = out.with_name(out.name + ".lock")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(made_folder(out.parent))
        except OSError as err:
            raise RegenerationError(f"data.regenerated_file {out}: its folder cannot be made "
                                    f"({err.strerror or err})") from None
        try:
            stack.enter_context(exclusive_lock(lock))
        except Locked as busy:
            raise RegenerationError(
                f"{out}: another draftforge data regenerate"
                + (f" (process {busy.holder})" if busy.holder else "")
                + f" is writing it ({lock} is held); wait for it to finish or stop it, then rerun"
            ) from None
        except OSError as err:
            raise RegenerationError(f"data.regenerated_file {out}: cannot make its lock file "
                                    f"{lock.name} there ({err.strerror or err})") from None
        _HELD.add(out)
        try:
            yield
        finally:
            _HELD.discard(out)


def _regenerate(
    prompts: Sequence[Conversation],
    engine: ReplyEngine,
    settings: GenerationConfig,
    out: Path,
    *,
    progress: bool,
    arithmetic: dict[str, Any] | None,
) -> RegenerateReport:
    fingerprint = getattr(engine.name, "fingerprint", None)  # see splitserve.target.TargetName
    partial = out.with_name(out.name + ".partial")
    order = {p.id: i for i, p in enumerate(prompts)}
    if len(order) != len(prompts):
        raise DataFormatError("prompt ids are not unique")
    by_id = {p.id: p for p in prompts}
    settings_json = settings.model_dump(mode="json")
    size = settings.batch_size
    batches = [list(prompts[i : i + size]) for i in range(0, len(prompts), size)]
    batch_of = {p.id: b for b, batch in enumerate(batches) for p in batch}

    if out.exists() and partial.exists():
        finished, torn_out = _read_rows(out)
        leftover, torn_partial = _read_rows(partial)
        same = sorted(map(_row_line, finished)) == sorted(map(_row_line, leftover))
        if same and not torn_out and not torn_partial:
            partial.unlink()  # a run that wrote the file and stopped before removing its .partial
            fsync_dir(out.parent)
        elif same and torn_out and not torn_partial:
            # stopped after moving a cut file's whole rows to the .partial (below), before
            # removing the file: the .partial holds them, continued as an interrupted run's
            out.unlink()
            fsync_dir(out.parent)
        elif torn_out or not {r["id"] for r in leftover} - {r["id"] for r in finished}:
            raise RegenerationError(
                f"both {out} and {partial} exist; keep one of them (move the other away) and rerun"
            )
        # else the .partial extends the finished file to more prompts, by a run stopped part
        # way: the file stays as it is until the extended one replaces it
    if out.exists():
        kept = _FirstOfEachId(out)
        rows, torn = _read_rows(out, keep=kept)
        ours = [r for r in rows if r["id"] in by_id]
        _check_rows(ours, out, by_id, settings_json, engine.name, lines=kept.line)
        if kept.repeated is not None and not torn:  # training refuses an id answered twice
            print(f"draftforge data regenerate: {out} repeats rows word for word; rewriting it "
                  "with each row once", file=sys.stderr)
            write_atomic(out, b"".join(_row_line(r) for r in rows))
        if torn and len(rows) > len(ours) and {r["id"] for r in ours} == set(order):
            # a larger recipe's file cut short (a copy) or ending in a blank line, which training
            # refuses ("rerun draftforge data regenerate"): it answers every prompt of this run in
            # its whole rows, and a whole larger file is accepted, so keep those rows as one
            print(f"draftforge data regenerate: {out} ends with an incomplete line; rewriting it "
                  f"with its {len(rows)} whole rows", file=sys.stderr)
            write_atomic(out, b"".join(_row_line(r) for r in rows))
            torn = False
        if {r["id"] for r in ours} == set(order) and not torn:
            others = len(rows) - len(ours)
            print(
                f"draftforge data regenerate: all {len(order)} prompts already answered in {out}"
                + (f" (it also answers {others} other prompts, which training skips)" if others else "")
                # a larger recipe's run stopped part way: this run does not need it, nor touch it
                + (f"; {partial.name} beside it, a larger run's stopped extension, is left for that "
                   "run to continue" if partial.exists() else ""),
                file=sys.stderr,
            )
            return RegenerateReport(out, len(order), len(ours), 0)
        _check_rows(rows, out, by_id, settings_json, engine.name,  # other ids: cannot extend it
                    lines=kept.line)
        _check_arithmetic(rows, out, arithmetic)
        if torn:  # never left here (a whole file is renamed into place): cut while copied? Its
            # whole rows are continued as an interrupted run's; it is no answers file as it is
            print(f"draftforge data regenerate: {out} ends with an incomplete line; continuing "
                  f"from its whole rows in {partial}", file=sys.stderr)
            write_atomic(partial, b"".join(_row_line(r) for r in rows))
            out.unlink()
            fsync_dir(out.parent)
    # more prompts than a finished file answers: continue from its rows, which go to the
    # .partial with the first new batch (the file itself stays until the new one replaces it)
    extending = out.exists() and not partial.exists()
    if not extending:
        rows = []
    torn = repeated = False
    others: list[dict[str, Any]] = []  # a larger run's rows in the .partial, kept there for it
    if partial.exists():
        kept = _FirstOfEachId(partial)
        rows, torn = _read_rows(partial, keep=kept)
        repeated = kept.repeated is not None
        _check_rows(rows, partial, by_id, settings_json, engine.name, lines=kept.line, others=True)
        _check_arithmetic(rows, partial, arithmetic)  # this run appends to the larger run's rows
        others = [r for r in rows if r["id"] not in by_id]
        rows = [r for r in rows if r["id"] in by_id]
    # A batch's rows go to disk in one write, so a batch with only some of its rows
    # there was cut by a crash (at a line boundary or inside a line, which _read_rows
    # dropped), or was the short last batch of a run over fewer prompts. Either way
    # it is generated again whole: its seed depends on all of its ids.
    present: dict[int, int] = {}
    for r in rows:
        present[batch_of[r["id"]]] = present.get(batch_of[r["id"]], 0) + 1
    incomplete = {b for b, n in present.items() if n < len(batches[b])}
    rows = [r for r in rows if batch_of[r["id"]] not in incomplete]
    if not extending and (torn or incomplete or repeated):
        write_atomic(partial, b"".join(_row_line(r) for r in rows + others))
    seed = b"".join(_row_line(r) for r in rows) if extending else None
    done = {r["id"] for r in rows}
    num_reused = len(done)
    if num_reused:
        print(
            f"draftforge data regenerate: continuing; {num_reused} of {len(order)} prompts"
            f" already answered in {out if extending else partial}",
            file=sys.stderr,
        )

    from tqdm import tqdm

    bar = tqdm(
        total=len(prompts),
        initial=num_reused,
        desc="regenerate",
        unit="prompt",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    generated = 0
    handle = None
    try:
        if seed is None:  # unbuffered: nothing is left buffered by a failed write
            handle = open(partial, "ab", buffering=0)
        pending = [(b, [p for p in batch if p.id not in done]) for b, batch in enumerate(batches)]
        pending = [(b, todo) for b, todo in pending if todo]
        todo_of = dict(pending)
        for b, conversations, unfinished, token_ids in answered_batches(pending, engine, settings):
            todo = todo_of[b]
            payload = b"".join(
                _row_line(
                    {
                        "id": p.id,
                        "messages": msgs,
                        "unfinished_turns": cut,
                        # the replies' ids as generated, which training supervises (engines that
                        # report none: the replies' text, tokenised again)
                        **({"reply_token_ids": ids} if any(i is not None for i in ids) else {}),
                        "generation": settings_json,
                        "target": engine.name,
                        **({"target_fingerprint": fingerprint} if fingerprint is not None else {}),
                        **({"arithmetic": arithmetic} if arithmetic is not None else {}),
                    }
                )
                for p, msgs, cut, ids in zip(todo, conversations, unfinished, token_ids, strict=True)
            )
            if seed is not None:  # a .partial beside a finished file always extends it
                write_atomic(partial, seed + payload)
                seed = None
                handle = open(partial, "ab", buffering=0)
            else:
                _append(handle, payload, partial)
            generated += len(todo)
            bar.update(len(todo))
    finally:
        if handle is not None:
            handle.close()
        bar.close()

    rows, _ = _read_rows(partial)
    ours = sorted((r for r in rows if r["id"] in order), key=lambda r: order[r["id"]])
    if [r["id"] for r in ours] != [p.id for p in prompts]:
        raise RegenerationError(f"{partial} does not hold exactly one row per prompt (was another "
                                "run writing it at the same time?); rerun the same command to repair it")
    write_atomic(out, b"".join(_row_line(r) for r in ours))
    if len(ours) < len(rows):  # a larger run's stopped run: its rows stay for it to continue
        print(f"draftforge data regenerate: {partial.name}, which also answers {len(rows) - len(ours)} "
              "other prompts, is left for the larger run that wrote them to continue", file=sys.stderr)
    else:
        partial.unlink()
    fsync_dir(out.parent)
    report = RegenerateReport(out, len(prompts), num_reused, generated)
    print(f"draftforge data regenerate: {report.summary()}", file=sys.stderr)
    return report


def answers_path_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the answers file (a folder, or a name training would not read as
    JSON lines), for ``data regenerate`` before it writes and ``train`` before it advises writing
    it; None when it can."""
    if out.is_dir():
        return f"data.regenerated_file {out} is a folder; give a .jsonl file path"
    if not out.name.lower().endswith(".jsonl"):  # training reads a file by its extension
        return (f"data.regenerated_file {out}: the answers are written as plain JSON lines, which "
                "training reads only from a file whose name ends in .jsonl (not compressed, not "
                ".json or .parquet); give a .jsonl file path")
    return None


def quiet_loading() -> None:
    """No weight-loading progress bar from transformers in this process (``--no-progress``)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def target_placement(choice: str, cfg, *, cuda_available: bool | None = None) -> tuple[str, int]:
    """The device and tensor-parallel width ``--device`` gives the recipe's target: on a GPU
    the recipe's own group (``split.target_tensor_parallel`` GPUs, SGLang only), on CPU one."""
    from draftforge.splitserve.target import resolve_device

    try:
        device = resolve_device(choice, cfg.split.target_devices, cuda_available=cuda_available)
    except InputError as err:
        raise RegenerationError(str(err)) from None
    if device == "cpu" or cfg.target.backend != "sglang":
        return device, 1
    return device, cfg.split.target_tensor_parallel


def worker_plan(workers: int | None, threads: int | None, *, device: str, backend: str,
                cores: int, num_batches: int, recorded: int | None = None) -> tuple[int, int]:
    """``(workers, threads per worker)`` for ``--workers`` and ``--threads`` (None = default).

    Several workers only on a CPU with the transformers backend; by default one per core,
    at most one per batch, sharing the cores; refused elsewhere, where one target already
    has the device (a GPU, an SGLang engine). ``recorded``: the threads of the answers this
    run continues (:func:`continued_threads`), the default for ``threads``, with by default
    as many workers as the cores hold at that count."""
    if device != "cpu" or backend == "sglang":
        if workers is not None and workers > 1:
            raise RegenerationError(
                f"--workers {workers}: several workers run on a CPU with target.backend hf; "
                f"here the target runs on {device} with backend {backend}, one engine")
        return 1, threads or recorded or cores
    if threads is None and recorded is not None:
        threads = recorded
        workers = max(1, cores // recorded) if workers is None else workers
    # one per core by default; a worker answers whole batches, so no more than there are
    workers = max(1, min(cores if workers is None else workers, num_batches))
    return workers, threads or max(1, cores // workers)


def main(argv: Sequence[str] | None = None) -> int:
    """``draftforge data regenerate RECIPE [key=value ...]``: write the recipe's regenerated data."""
    parser = argparse.ArgumentParser(
        prog="draftforge data regenerate",
        description="Answer every prompt of data.train_files with the recipe's target and write "
        "data.regenerated_file (default <train.output_dir>/regenerated.jsonl). Rerun to resume.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="path to a recipe YAML file")
    parser.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="e.g. data.num_samples=64"
    )
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (neither regeneration's, the overlap check's nor the "
                        "target's weight loading)")
    parser.add_argument(
        "--device", default="auto",
        help="where the target runs: auto (default) is the recipe's first target GPU "
        "(split.target_devices[0], else GPU 0) when CUDA is visible, else cpu; or cpu, cuda, "
        "cuda:N. On a GPU an SGLang target runs as one tensor-parallel group of "
        "split.target_tensor_parallel GPUs from that one, as in training",
    )
    parser.add_argument(
        "--workers", type=int, default=None,
        help="processes answering batches side by side on a CPU, each with its own copy of the "
        "target (default: one per core this process may use, at most one per batch; 1 on a "
        "GPU or with target.backend sglang, which allow only 1). Each holds the whole target "
        "in memory: use fewer for a large target. At a given --threads the answers do not "
        "depend on it (in native bfloat16 they depend on --threads, whose default follows it)",
    )
    parser.add_argument(
        "--threads", type=int, default=None,
        help="intra-op threads of each worker's target (default: the cores this process may "
        "use divided among the workers, so 1 when there are at least as many batches as cores; "
        "target.num_threads is for the target rank of a training job, which shares the "
        "machine). In native bfloat16 the thread count changes some answers (float32 does not), so "
        "a file is continued only with the count that started it (recorded in its rows), which is "
        "then the default",
    )
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    for flag in ("workers", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    from draftforge.config import load_recipe
    from draftforge.data.loading import load_prompts, regenerated_path
    from draftforge.data.overlap import OverlapError
    from draftforge.data.workloads import WorkloadUnavailableError

    cfg = load_recipe(args.recipe, args.overrides)
    # SIGTERM (a scheduler, a demo being stopped) unwinds like Ctrl-C: the worker pool's
    # cleanup stops its processes, and the batches written so far stay for a rerun
    with unwinding_on_sigterm("draftforge data regenerate", "rerun the same command to continue"):
        try:
            if not cfg.data.regenerate:  # the answers would be written for nothing
                raise RegenerationError(
                    "data.regenerate is false: training reads the replies of data.train_files as "
                    "they are and would never read the target's answers written here; set "
                    "data.regenerate: true (in the recipe, or data.regenerate=true for this command "
                    "and for 'draftforge train') to train on them")
            prompts = load_prompts(cfg.data, progress=not args.no_progress).conversations
            if not prompts:
                raise RegenerationError(f"data.train_files {cfg.data.train_files} hold no prompts; "
                                        "nothing to answer")
            device, tensor_parallel = target_placement(args.device, cfg)  # before any folder
            out = regenerated_path(cfg.data, cfg.train.output_dir)
            problem = answers_path_problem(out)
            if problem:
                raise RegenerationError(problem)
            if cfg.target.backend == "sglang":  # said before any folder or load, as training says it
                from draftforge.splitserve.sglang_backend import require_sglang

                require_sglang()
            from draftforge.splitserve.target import build_target, target_name

            num_batches = -(-len(prompts) // cfg.target.generation.batch_size)
            # an auto dtype was resolved for CUDA when there is one; on the CPU it is the CPU's rule
            dtype = cfg.target.dtype_on(device)
            continued = None if args.threads is not None else continued_threads(
                out, arithmetic_record(device=device, backend=cfg.target.backend, dtype=dtype,
                                       threads=None, tensor_parallel=tensor_parallel))
            if continued is not None:
                print(f"draftforge data regenerate: {continued[1]} thread(s) per target, as "
                      f"{continued[0]} was answered with (in {dtype} another count changes answers)",
                      file=sys.stderr)
            workers, threads = worker_plan(args.workers, args.threads, device=device,
                                           backend=cfg.target.backend, cores=usable_cores(),
                                           num_batches=num_batches,
                                           recorded=continued[1] if continued else None)
            if args.workers is not None and workers < args.workers:
                print(f"draftforge data regenerate: --workers {args.workers}: {workers} started, one per "
                      f"batch of {cfg.target.generation.batch_size} prompts (target.generation.batch_size)",
                      file=sys.stderr)
            # the folder and the lock before the target loads (minutes for a large one): a second
            # writer of the file, or a folder that refuses it, is told now
            with answers_held(out):
                print(f"draftforge data regenerate: {len(prompts)} prompts -> {out}", file=sys.stderr)
                where = f"{device}" + (f" (tensor parallel {tensor_parallel})" if tensor_parallel > 1 else "")
                print(f"draftforge data regenerate: target on {where}, "
                      + (f"{workers} workers of {threads} thread(s) each" if workers > 1
                         else f"{threads} thread(s)"), file=sys.stderr)
                target = cfg.target.model_copy(update={"num_threads": threads, "dtype": dtype})
                if workers > 1:
                    from draftforge.data.answer_workers import WorkerPool

                    build = functools.partial(build_target, target, list(cfg.draft.target_layer_ids))
                    engine = WorkerPool(build, workers, name=target_name(target), quiet=args.no_progress)
                else:
                    if args.no_progress:
                        quiet_loading()
                    engine = build_target(target, cfg.draft.target_layer_ids, device=device,
                                          tensor_parallel=tensor_parallel)
                arithmetic = arithmetic_record(device=device, backend=cfg.target.backend,
                                               dtype=target.dtype, threads=threads,
                                               tensor_parallel=tensor_parallel)
                regenerate(prompts, engine, cfg.target.generation, out, progress=not args.no_progress,
                           arithmetic=arithmetic)
        except (DataFormatError, OverlapError, RegenerationError, WorkloadUnavailableError) as exc:
            print(f"draftforge data regenerate: {exc}", file=sys.stderr)
            return 2
    return 0  # Ctrl-C: unwinding_on_sigterm says what SIGTERM's stop says (the answers are kept)


if __name__ == "__main__":
    raise SystemExit(main())
