"""Local data files -> validated conversations, offline.

Supported files: ``.jsonl``, ``.jsonl.gz``, ``.json`` (a list of row objects, or one object a
line as in ``.jsonl``, which ``datasets`` reads from a ``.json`` too), ``.json.gz`` and
``.parquet``. JSON files are read with plain readers because every error must name
its row -- a jsonl row by its 1-based line, a ``.json`` row by its 1-based place in the list
(``datasets`` infers one schema for the whole file and hides both); parquet files are read
through ``datasets`` offline, row ``i`` being the i-th row of the table.
``builtin:train-prompts`` names the training prompt set shipped with draftforge.

Every row is validated (see :mod:`draftforge.data.formats`); a malformed row raises
:class:`DataFormatError` unless ``skip_invalid`` is set, in which case it is skipped,
counted and reported.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import json
import logging
import os
import sys
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftforge.data.config import BUILTIN_DATA_SETS, DataConfig, unknown_builtin
from draftforge.data.formats import (
    Conversation,
    DataFormatError,
    Expect,
    RowFormat,
    RowLocation,
    detect_format,
    parse_row,
)

BUILTIN_DIR = Path(__file__).resolve().parent / "prompts"
BUILTINS = {name: BUILTIN_DIR / f"{name}.jsonl.gz" for name in BUILTIN_DATA_SETS}
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")

RESERVED_ID_MARK = "#e"  # SplitServe appends it and the epoch to a sample id after epoch 0
# json raises RecursionError (not JSONDecodeError) past Python's recursion limit
NESTED_TOO_DEEPLY = "invalid JSON: arrays or objects nested too deeply to read"


@dataclass(frozen=True)
class SkippedRow:
    """A malformed row left out because ``skip_invalid`` is set."""

    where: str
    reason: str


@dataclass
class LoadResult:
    """Conversations read from data files, and the rows skipped as malformed."""

    conversations: list[Conversation]
    skipped: list[SkippedRow] = field(default_factory=list)

    def summary(self, max_lines: int = 20) -> str:
        """One line of counts, then the reason for each skipped row (the first ``max_lines``)."""
        lines = [
            f"{len(self.conversations)} rows loaded, {len(self.skipped)} malformed rows skipped"
        ]
        lines += [f"  skipped {s.where}: {s.reason}" for s in self.skipped[:max_lines]]
        if len(self.skipped) > max_lines:
            lines.append(f"  ... and {len(self.skipped) - max_lines} more")
        return "\n".join(lines)


@dataclass(frozen=True)
class RawRow:
    """One row as read from a file: its location and value, or why it could not be read."""

    where: RowLocation
    value: Any = None
    error: str | None = None


def resolve_data_path(spec: str) -> Path:
    """The file named by ``spec``: ``builtin:NAME`` or a local path (checked to exist)."""
    if spec.startswith("builtin:"):
        unknown = unknown_builtin(spec)
        if unknown is not None:
            raise DataFormatError(f"{unknown} (data.train_files)")
        path = BUILTINS[spec.removeprefix("builtin:")]
        if not path.is_file():
            raise DataFormatError(
                f"{spec} is missing from the installation ({path}); "
                "rebuild it with: python -m draftforge.data.prompts"
            )
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        raise DataFormatError(f"data file not found: {spec}{where}; check data.train_files")
    if not path.is_file():
        raise DataFormatError(f"data path is not a file: {spec} (data.train_files)")
    return path


def data_suffix(path: Path) -> str:
    """The data extension of ``path`` (``.jsonl.gz`` counts as one), checked to be supported."""
    name = path.name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    raise DataFormatError(
        f"{path}: unsupported file type {''.join(path.suffixes) or '(no extension)'}; "
        f"supported: {', '.join(SUFFIXES)}"
    )


def file_stem(path: Path) -> str:
    """The file name without its data extension: the prefix of default row ids."""
    return path.name[: len(path.name) - len(data_suffix(path))]


# byte-order marks of encodings other than UTF-8 (UTF-32's first: UTF-16 LE's is its prefix)
_OTHER_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
               (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def _refuse_other_encoding(path: Path, start: bytes) -> None:
    """Refuse a file that starts with a UTF-16 or UTF-32 byte-order mark (what Windows
    PowerShell 5's ``>`` and ``Out-File`` write): read as UTF-8, each of its lines failed as a
    row of its own, "invalid UTF-8 at column 1" then "invalid JSON", and with
    data.skip_invalid every row was skipped as malformed."""
    for bom, name in _OTHER_BOMS:
        if start.startswith(bom):
            raise DataFormatError(
                f"{path}: the file is encoded in {name} (it starts with a {name} byte-order "
                "mark); data files must be UTF-8: save it as UTF-8 (PowerShell: "
                "Out-File -Encoding utf8, or Set-Content -Encoding utf8)")


def _json_message(exc: json.JSONDecodeError) -> str:
    """json's message, with "Unterminated string starting at" said plainly."""
    if exc.msg == "Unterminated string starting at":
        return "a string is not closed (no ending quote) starting at"
    return exc.msg


def _read_jsonl(path: Path, suffix: str) -> Iterator[RawRow]:
    number = 0
    try:  # bytes, decoded line by line: invalid UTF-8 is that row's error, with its line
        with gzip.open(path, "rb") if suffix.endswith(".gz") else open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                where = RowLocation(str(path), number, "line")
                if number == 1:
                    _refuse_other_encoding(path, raw)
                # a byte-order mark (Windows editors write one) is no JSON; after line 1 it is
                # the first line of another file joined on (cat a.jsonl b.jsonl)
                raw = raw.removeprefix(codecs.BOM_UTF8)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield RawRow(where, error=f"invalid UTF-8 at column {exc.start + 1}")
                    continue
                if not line.strip():
                    continue
                try:  # without its line break, which would put an error at its end on "column 1"
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    yield RawRow(where, error=f"invalid JSON: {_json_message(exc)} (column {exc.colno})")
                    continue
                except RecursionError:
                    yield RawRow(where, error=NESTED_TOO_DEEPLY)
                    continue
                except ValueError as exc:  # an integer of more digits than Python converts
                    yield RawRow(where, error=f"invalid JSON: {exc}")
                    continue
                yield RawRow(where, value)
    except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a corrupt .gz stream
        # a .gz cut short or damaged part-way fails after its good lines: say where
        after = f" (after line {number})" if number else ""
        raise DataFormatError(f"{path}: cannot be read: {exc}{after}") from None


def _read_json(path: Path, suffix: str) -> Iterator[RawRow]:
    try:
        with gzip.open(path, "rb") if suffix.endswith(".gz") else open(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataFormatError(f"{path}: cannot be read: {exc}") from None
    _refuse_other_encoding(path, raw)
    raw = raw.removeprefix(codecs.BOM_UTF8)  # Windows editors write one; it is no JSON
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # the line and column, as a jsonl file's error says them
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise DataFormatError(f"{path}, line {line}: invalid UTF-8 at column {column}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and _object_line(text.lstrip().split("\n", 1)[0]):
            # one object a line (JSON Lines), as datasets (SpecForge's loader) reads a .json too
            yield from _read_jsonl(path, suffix)
            return
        raise DataFormatError(
            f"{path}, line {exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})"
        ) from None
    except RecursionError:
        raise DataFormatError(f"{path}: {NESTED_TOO_DEEPLY}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise DataFormatError(f"{path}: invalid JSON: {exc}") from None
    if isinstance(data, dict) and detect_format(data) is not None and "\n" not in text.strip():
        # one row object on one line: JSON Lines of one row, as datasets reads it (and as a
        # .json file of two or more such lines is read above); another object ({"data": [...]})
        # is refused below
        yield from _read_jsonl(path, suffix)
        return
    if not isinstance(data, list):
        raise DataFormatError(
            f"{path}: a .json data file must hold a list of row objects, got "
            f"{type(data).__name__}; use .jsonl for one object per line"
        )
    for number, value in enumerate(data, start=1):
        yield RawRow(RowLocation(str(path), number, "row"), value)


def _object_line(line: str) -> bool:
    """Whether ``line`` is a whole JSON object by itself."""
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):  # ValueError: JSONDecodeError, or too long an integer
        return False


@contextlib.contextmanager
def _datasets_quiet(datasets) -> Iterator[None]:
    """Silence ``datasets`` on stderr for one read, restoring its settings after.

    On a malformed file ``datasets`` logs its own "Failed to read schema from ..." line
    (logger.error) before raising, and on any file it draws a "Generating train split" bar;
    the :class:`DataFormatError` raised here names the file and the reason, so both are
    noise. A user's HF_DATASETS_DISABLE_PROGRESS_BARS setting is left alone.
    """
    library_logger = logging.getLogger("datasets")
    saved_level = library_logger.level
    hide_bars = (
        datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is None
        and not datasets.are_progress_bars_disabled()
    )
    library_logger.setLevel(logging.CRITICAL)
    if hide_bars:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        library_logger.setLevel(saved_level)
        if hide_bars:
            datasets.enable_progress_bars()


def _read_parquet(path: Path) -> Iterator[RawRow]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    with tempfile.TemporaryDirectory(prefix="draftforge-parquet-") as cache:
        try:
            with _datasets_quiet(datasets):
                table = datasets.Dataset.from_parquet(
                    str(path), cache_dir=cache, keep_in_memory=True
                )
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
            # A page that fails to decode surfaces as datasets' generic DatasetGenerationError
            # ("An error occurred while generating the dataset"); pyarrow's reason is its cause.
            if isinstance(exc, datasets.exceptions.DatasetGenerationError) and exc.__cause__:
                exc = exc.__cause__
            reason = " ".join(str(exc).split())  # pyarrow's messages may span lines
            raise DataFormatError(
                f"{path}: not a readable parquet table of rows ({type(exc).__name__}: {reason})"
            ) from None
        for number, value in enumerate(table, start=1):
            yield RawRow(RowLocation(str(path), number, "row"), value)


def read_rows(path: Path) -> Iterator[RawRow]:
    """The rows of one data file in order, each with its 1-based line or row number."""
    suffix = data_suffix(path)
    if suffix in (".jsonl", ".jsonl.gz"):
        yield from _read_jsonl(path, suffix)
    elif suffix in (".json", ".json.gz"):
        yield from _read_json(path, suffix)
    else:
        yield from _read_parquet(path)


def load_conversations(
    specs: Sequence[str],
    *,
    fmt: RowFormat = "auto",
    expect: Expect = "prompt",
    skip_invalid: bool = False,
    limit: int | None = None,
    own_replies: bool = False,
) -> LoadResult:
    """Read and validate every row of ``specs`` (files or ``builtin:`` names).

    Ids come from a row's ``id`` field, else ``<file stem>-<line or row number>``; they
    must be unique across all files. ``limit`` keeps the first valid rows only (the files it
    leaves unread are still refused when they hold no row). ``own_replies``: the assistant
    turns are trained as they are (:func:`~draftforge.data.formats.check_structure`).
    """
    if not specs:
        raise DataFormatError("no data files given (data.train_files is empty)")
    paths = [resolve_data_path(spec) for spec in specs]  # all missing files fail up front
    named: dict[Path, str] = {}
    for spec, path in zip(specs, paths, strict=True):
        if path.resolve() in named:  # else its first row is refused as a clash of ids
            raise DataFormatError(
                f"{path}: listed twice in data.train_files (as {named[path.resolve()]!r} and "
                f"{spec!r}); its rows would be read twice"
            )
        named[path.resolve()] = spec
    result = LoadResult(conversations=[])
    seen: dict[str, str] = {}
    for index, path in enumerate(paths):
        stem = file_stem(path)
        rows = 0
        for raw in read_rows(path):
            rows += 1
            try:
                if raw.error is not None:
                    raise DataFormatError(f"{raw.where}: {raw.error}")
                conv = parse_row(
                    raw.value,
                    raw.where,
                    default_id=f"{stem}-{raw.where.number}",
                    fmt=fmt,
                    expect=expect,
                    own_replies=own_replies,
                )
                if conv.id in seen:
                    hint = ""
                    if conv.id == f"{stem}-{raw.where.number}":
                        hint = (
                            f" (a default id, <file name>-<{raw.where.unit} number>: two data files "
                            f"named {stem!r} give the same ones; rename one or give its rows "
                            "an 'id' field)"
                        )
                    raise DataFormatError(
                        f"{raw.where}: id {conv.id!r} is already used at {seen[conv.id]}; "
                        f"ids must be unique across data files{hint}"
                    )
                if RESERVED_ID_MARK in conv.id:
                    raise DataFormatError(
                        f"{raw.where}: id {conv.id!r} contains {RESERVED_ID_MARK!r}, which marks a "
                        "later epoch's sample ids (conv#e1, ...); rename it"
                    )
            except DataFormatError as exc:
                if not skip_invalid:
                    raise
                reason = str(exc).removeprefix(f"{raw.where}: ")
                result.skipped.append(SkippedRow(str(raw.where), reason))
                continue
            seen[conv.id] = conv.source
            result.conversations.append(conv)
            if limit is not None and len(result.conversations) >= limit:
                for unread in paths[index + 1 :]:  # not needed now, but needed by a larger limit
                    if next(iter(read_rows(unread)), None) is None:
                        raise _no_rows(unread)
                return result
        if not rows and len(paths) > 1:  # alone, it is "no prompts" / "no conversations"
            raise _no_rows(path)
    return result


def _no_rows(path: Path) -> DataFormatError:
    """A data file that holds no row beside others: it would add nothing without a word (a file
    emptied by a failed export or copy, or the wrong file listed)."""
    return DataFormatError(f"{path}: holds no rows (the file is empty, blank lines only or an empty "
                           "list); fill it or remove it from data.train_files")


def _report(result: LoadResult, what: str) -> None:
    if result.skipped:
        print(f"draftforge data: {what}: {result.summary()}", file=sys.stderr)


def load_prompts(cfg: DataConfig, *, progress: bool = True) -> LoadResult:
    """The prompts of ``data.train_files`` for regeneration, checked against the eval sets
    (``progress``: the check's bar, shown when it takes a while)."""
    return _load_checked(cfg, list(cfg.train_files), cfg.format, "prompt", "prompts",
                         progress=progress)


def _load_checked(
    cfg: DataConfig, specs: list[str], fmt: str, expect: str, what: str, *, assistant: bool = False,
    progress: bool = True,
) -> LoadResult:
    """Load, report the counts, and refuse overlap with the evaluation sets (data.overlap_check);
    ``assistant``: the assistant turns are trained as they are, so check them too."""
    result = load_conversations(
        specs, fmt=fmt, expect=expect, skip_invalid=cfg.skip_invalid, limit=cfg.num_samples,
        own_replies=assistant,
    )
    _report(result, what)
    if cfg.overlap_check:
        from draftforge.data.overlap import check_no_overlap

        check_no_overlap(result.conversations, threshold=cfg.overlap_threshold, assistant=assistant,
                         progress=progress)
    return result


def regenerated_path(cfg: DataConfig, output_dir: str | os.PathLike[str]) -> Path:
    """Where regenerated conversations live: ``data.regenerated_file`` or ``<output_dir>/regenerated.jsonl``."""
    if cfg.regenerated_file is not None:
        return Path(cfg.regenerated_file).expanduser()
    return Path(output_dir) / "regenerated.jsonl"


def load_training_conversations(cfg: DataConfig, output_dir: str | os.PathLike[str]) -> LoadResult:
    """The finished conversations to train on, checked against the eval sets.

    With ``data.regenerate`` these are the target's own answers written by
    ``draftforge data regenerate``; otherwise the conversations of ``data.train_files``
    as they are.
    """
    if cfg.regenerate:
        path = regenerated_path(cfg, output_dir)
        if not path.is_file():
            raise DataFormatError(
                f"regenerated data not found: {path}; write it with "
                "'draftforge data regenerate RECIPE' (or set data.regenerate: false to train "
                "on the conversations of data.train_files as they are)"
            )
        specs, fmt = [str(path)], "messages"
    else:
        specs, fmt = list(cfg.train_files), cfg.format
    return _load_checked(cfg, specs, fmt, "conversation", "training conversations",
                         assistant=not cfg.regenerate)
