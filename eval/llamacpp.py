"""llama.cpp from the source a pinned PyPI package vendors: fetch it, convert, build, run.

draftforge's exports are meant to load in llama.cpp as they are: its converter
(``convert_hf_to_gguf.py DIR --target-model-dir TARGET``) turns them into a GGUF
draft and ``--spec-type draft-dspark`` serves it. llama.cpp itself is not on
the package index, but the ``llama-cpp-python`` source distribution vendors its
whole tree. Version 0.3.36 holds the DSpark converter (``conversion/qwen.py``:
``Qwen3DSparkModel``, ``LingDSparkModel``) and runtime (``common/speculative.cpp``:
``draft-dspark``). This module downloads that archive once into the draftforge
cache (``$DRAFTFORGE_CACHE`` or ``~/.cache/draftforge``), converts with its
converter and its own ``gguf-py`` (newer than the ``gguf`` wheel, which lacks
the DSpark names), builds ``llama-speculative-simple`` and ``llama-tokenize``
with CMake, and runs them.

``python -m draftforge.eval.llamacpp fetch`` fetches the source alone (``make
install`` does, so that the converter test finds it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftforge.errors import InputError, last_lines
from draftforge.files import fsync_dir, fsync_tree, waiting_lock

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
TOOL = "llama-speculative-simple"
TOKENIZER = "llama-tokenize"  # built beside it: the prompt's token ids as llama.cpp makes them
CONVERTER = "convert_hf_to_gguf.py"
_VENDORED = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"


def _tool_env() -> dict[str, str]:
    """The environment llama.cpp's tools run in: without a backtrace after an abort. ggml prints
    a ``GGML_ASSERT`` message and then the backtrace (gdb's, where installed: dozens of lines),
    which would push the message out of the last lines an error quotes."""
    return dict(os.environ, GGML_NO_BACKTRACE="1")


def source_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the llama.cpp source of the pinned package is kept."""
    from draftforge.splitserve.smollm2 import cache_root

    return cache_root(cache_dir) / f"llama.cpp-{VERSION}"


def fetch_source(cache_dir: str | os.PathLike[str] | None = None, *, progress: Callable[[str], None] = print) -> Path:
    """The llama.cpp tree vendored by ``llama-cpp-python==VERSION``, downloaded on first use.

    The archive is unpacked into a temporary folder beside the destination and renamed
    into place, so an interrupted fetch leaves nothing that a later one would trust."""
    dest = source_dir(cache_dir)
    if (dest / CONVERTER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    progress(f"llama.cpp: downloading the {PACKAGE}=={VERSION} source archive (about 75 MB) into {dest.parent}")
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".llama.cpp-") as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--no-deps", "--no-binary", ":all:", f"{PACKAGE}=={VERSION}", "--dest", tmp,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise InputError(
                f"could not download {PACKAGE}=={VERSION} from the package index (offline?): "
                f"{last_lines(done.stderr) or 'no source archive came back'}"
            )
        staging = Path(tmp) / "llama.cpp"
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(_VENDORED) and m.name != _VENDORED]
            for member in members:
                member.name = member.name[len(_VENDORED):]
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise InputError(f"{archives[0].name}: unsafe path {member.name!r} in the archive")
            if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+: also refuses odd links
                tar.extractall(staging, members=members, filter="data")
            else:
                tar.extractall(staging, members=members)
        if not (staging / CONVERTER).is_file():
            raise InputError(f"{archives[0].name} has no {_VENDORED}{CONVERTER}: not the expected archive")
        # the rename is all a later fetch looks at: the files must be on disk before it is, or
        # a power loss leaves a tree of empty files that is trusted from then on
        fsync_tree(staging)
        try:
            os.replace(staging, dest)
        except OSError:  # another process put a complete copy there first
            if not (dest / CONVERTER).is_file():
                raise
        fsync_dir(dest.parent)
    progress(f"llama.cpp: source in {dest}")
    return dest


def convert(
    source: Path,
    model_dir: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    *,
    target_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Run llama.cpp's converter on a Hugging Face folder; write an f32 GGUF atomically.

    ``target_dir`` is the target's folder, which a DSpark draft needs for its tokenizer. The
    converter writes into a temporary folder of its own beside ``out_file`` (a fixed temporary
    name would be shared, overwritten and deleted by two conversions into one folder), and the
    finished GGUF is renamed into place."""
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp = staging / out.name  # made by the converter: the umask's permissions, not mkstemp's 0600
    command = [sys.executable, str(source / CONVERTER), str(model_dir), "--outfile", str(tmp), "--outtype", "f32"]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(source / "gguf-py"), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise InputError(f"llama.cpp's {CONVERTER} refused {model_dir}: {last_lines(done.stderr)}")
        if not tmp.is_file():
            raise InputError(f"llama.cpp's {CONVERTER} exited 0 on {model_dir} but wrote no GGUF at "
                             f"{tmp}: {last_lines(done.stderr or done.stdout) or 'it printed nothing'}")
        fsync_tree(staging)  # the converter does not: a power loss would leave an empty GGUF at out
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:  # a refusal or an interrupt leaves no partial GGUF (4 bytes a parameter) behind
        shutil.rmtree(staging, ignore_errors=True)
    return out


def build_tools(source: Path, *, jobs: int | None = None, progress: Callable[[str], None] = print) -> Path:
    """Build ``llama-speculative-simple`` and ``llama-tokenize`` from ``source`` with CMake, once
    (about 5 minutes on 2 cores); returns the folder holding both."""
    bin_dir = source / "build" / "bin"
    if all(os.access(bin_dir / tool, os.X_OK) for tool in (TOOL, TOKENIZER)):
        return bin_dir
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise InputError(
            f"building llama.cpp needs {' and '.join(missing)} (CMake and a C++ compiler), which this "
            f"machine lacks; install them, or pass --llama-cpp DIR: a llama.cpp checkout with "
            f"build/bin/{TOOL} and build/bin/{TOKENIZER}"
        )
    # one build at a time (two would configure and build into one folder, each truncating the
    # other's log); one that waited finds the tools built
    with waiting_lock(source / "build.lock", "another process is building llama.cpp's tools"):
        if all(os.access(bin_dir / tool, os.X_OK) for tool in (TOOL, TOKENIZER)):
            return bin_dir
        _build(source, jobs=jobs, progress=progress)
    return bin_dir


def _build(source: Path, *, jobs: int | None, progress: Callable[[str], None]) -> None:
    log = source / "build-log.txt"
    progress(f"llama.cpp: building {TOOL} and {TOKENIZER} (about 5 minutes on 2 cores; log in {log})")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake", "-S", str(source), "-B", str(source / "build"), *generator, "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    ]  # fmt: skip
    build = ["cmake", "--build", str(source / "build"), "--target", TOOL, TOKENIZER, "-j", str(jobs or os.cpu_count() or 1)]
    with log.open("w") as sink:
        for step in (configure, build):
            sink.write("$ " + " ".join(step) + "\n")
            sink.flush()
            if subprocess.run(step, stdout=sink, stderr=subprocess.STDOUT).returncode != 0:
                raise InputError(f"building llama.cpp failed: {last_lines(log.read_text())} (whole log: {log})")


TOKENIZE_TIMEOUT_S = 120  # seconds: llama-tokenize loads the GGUF's vocabulary and prints ids


def tokenize(bin_dir: Path, model_gguf: Path, text: str) -> list[int]:
    """The token ids llama.cpp feeds its model for ``text`` (BOS as the vocabulary asks, special
    tokens parsed), as llama-speculative-simple tokenizes its prompt. A run past
    :data:`TOKENIZE_TIMEOUT_S` is stopped and is an error like a failed one."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(text, encoding="utf-8")
        # its log (on stderr) stays on: --log-disable would also silence why it failed
        command = [str(bin_dir / TOKENIZER), "-m", str(model_gguf), "-f", str(prompt_file), "--ids", "--no-escape"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=_tool_env(),
                                  timeout=TOKENIZE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise InputError(f"{TOKENIZER} gave no ids within {TOKENIZE_TIMEOUT_S} s on {model_gguf}; "
                             "stopped") from None
    found = re.findall(r"^\[[\d, ]*\]$", done.stdout, flags=re.MULTILINE)
    if done.returncode != 0 or not found:
        reason = last_lines(done.stderr or done.stdout) or "it printed nothing"
        raise InputError(f"{TOKENIZER} failed (exit {done.returncode}) on {model_gguf}: {reason}")
    return json.loads(found[-1])


@dataclass
class SpecRun:
    """What ``llama-speculative-simple`` reports for one prompt."""

    prompt_tokens: int
    predicted: int  # tokens emitted, the end-of-turn token included
    drafted: int
    accepted: int
    text: str  # the generated text, without the prompt and the end-of-turn token
    round_log: list[tuple[int, int, int]] = field(default_factory=list)  # (accepted, drafted, last token)
    # each round's drafted tokens, in slot order (the draft's first candidate at each slot, as the
    # -v log lists them; a round's first ``drafted`` of them were verified); empty where the log
    # has no candidate lines that line up with its rounds
    round_drafts: list[list[int]] = field(default_factory=list)
    # the tokens its vocabulary ends generation on (llama_vocab_is_eog): the end of turn and
    # others it finds by their text, such as <|endoftext|>
    end_tokens: set[int] = field(default_factory=set)

    @property
    def rounds(self) -> int:
        """Each round emits its accepted drafts plus one target token."""
        return self.predicted - self.accepted

    @property
    def acceptance_length(self) -> float:
        return self.predicted / self.rounds if self.rounds else float("nan")


_STATS = {
    "prompt_tokens": r"encoded\s+(\d+) tokens",
    "predicted": r"n_predict\s*=\s*(\d+)",
    "drafted": r"n_drafted\s*=\s*(\d+)",
    "accepted": r"n_accept\s*=\s*(\d+)",
}
# the debug line each round logs (with -v)
_ROUND = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)")
_END_TOKEN = re.compile(r"print_info: EOG token\s+=\s+(\d+) ")  # logged as each model's vocabulary loads
# the debug lines a DSpark draft logs per slot (with -v, common/speculative.cpp): its three best
# candidates; candidate 0 is the token drafted there
_CANDIDATE = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+) ")


def _round_drafts(stderr: str, rounds: int) -> list[list[int]]:
    """Each round's drafted tokens from the candidate lines logged before its ``accepted`` line;
    [] where they do not line up (a slot out of order, or not one group a round)."""
    if _CANDIDATE.search(stderr) is None:  # a log without them (no -v, another spec type)
        return []
    drafts: list[list[int]] = []
    current: list[int] = []
    for line in stderr.splitlines():
        if (found := _CANDIDATE.search(line)) is not None:
            slot, token = int(found.group(1)), int(found.group(2))
            if slot != len(current):
                return []
            current.append(token)
        elif _ROUND.search(line) is not None:
            drafts.append(current)
            current = []
    return drafts if len(drafts) == rounds else []


def parse_run(stdout: str, stderr: str, prompt: str, *, bos: str | None = None) -> SpecRun:
    """Read the statistics and the rounds off stderr and the generated text off stdout.

    stdout is ``"\\n\\n"``, the prompt, the generated text, then ``"\\n\\n"`` twice (after the
    loop and at exit); stderr carries the log with ``encoded N tokens``, ``n_predict``,
    ``n_drafted``, ``n_accept``, the vocabulary's ``EOG token`` ids and, with ``-v``, one
    ``accepted A/D draft tokens`` line a round, after the ``draft candidate`` lines of the
    round's block (:attr:`SpecRun.round_drafts`).
    ``bos``, the vocabulary's BOS text, only names the cause when llama.cpp echoes it before the
    prompt (a vocabulary that asks for one)."""
    stats = {}
    for key, pattern in _STATS.items():
        found = re.findall(pattern, stderr)
        if not found:
            raise InputError(f"{TOOL} printed no {pattern!r} line; its log ends: {last_lines(stderr)}")
        stats[key] = int(found[-1])
    head, tail = "\n\n" + prompt, "\n\n\n\n"
    if not stdout.startswith(head) or not stdout.endswith(tail):
        if bos and stdout.startswith("\n\n" + bos + prompt):
            raise InputError(
                f"{TOOL} echoed the BOS token {bos!r} before the prompt: the target's vocabulary asks "
                "llama.cpp to add one (tokenizer.ggml.add_bos_token), which draftforge's prompts "
                "(rendered without special tokens) lack; this check does not compare such targets"
            )
        raise InputError(f"{TOOL} did not echo the prompt as expected; its output starts {stdout[:120]!r}")
    rounds = [tuple(int(x) for x in m) for m in _ROUND.findall(stderr)]
    end_tokens = {int(x) for x in _END_TOKEN.findall(stderr)}
    run = SpecRun(text=stdout[len(head) : -len(tail)], round_log=rounds, end_tokens=end_tokens, **stats)
    if len(rounds) != run.rounds:  # also when the per-round lines (-v) are missing
        raise InputError(f"{TOOL} logged {len(rounds)} rounds but its totals imply {run.rounds}")
    run.round_drafts = _round_drafts(stderr, len(rounds))
    return run


def run_speculative(
    bin_dir: Path,
    target_gguf: Path,
    draft_gguf: Path,
    prompt: str,
    *,
    max_new_tokens: int,
    block_size: int,
    p_min: float = 0.0,
    threads: int = 1,
    context: int = 4096,
    timeout_s: float = 600,
    bos: str | None = None,
) -> SpecRun:
    """Greedy speculative decoding of ``prompt`` (chat-templated text) with ``--spec-type draft-dspark``.

    Raises InputError when the tool fails (an abort while loading a GGUF included), runs past
    ``timeout_s`` or prints what :func:`parse_run` does not recognise (``bos`` as there)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(prompt, encoding="utf-8")
        command = [
            str(bin_dir / TOOL), "-m", str(target_gguf), "-md", str(draft_gguf), "--spec-type", "draft-dspark",
            "--spec-draft-n-max", str(block_size), "--spec-draft-p-min", str(p_min),
            # -bf keeps the prompt byte for byte (-f drops a final newline); --no-escape keeps backslashes
            "-bf", str(prompt_file), "--no-escape", "-n", str(max_new_tokens),
            "--temp", "0", "--top-k", "1", "--seed", "0", "-t", str(threads), "-c", str(context),
            "-v",  # the per-round "accepted A/D" lines
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, timeout=timeout_s, env=_tool_env())
        except subprocess.TimeoutExpired as timeout:  # killed; what it logged so far says where it was
            log = (timeout.stderr or b"").decode("utf-8", errors="replace")
            raise InputError(
                f"{TOOL} ran past {timeout_s:.0f} s on one prompt, after {len(_ROUND.findall(log))} "
                f"rounds; its log ends: {last_lines(log)}"
            ) from None
    stdout = done.stdout.decode("utf-8", errors="replace")
    stderr = done.stderr.decode("utf-8", errors="replace")
    if done.returncode != 0:
        raise InputError(f"{TOOL} failed (exit {done.returncode}): {last_lines(stderr)}")
    return parse_run(stdout, stderr, prompt, bos=bos)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m draftforge.eval.llamacpp fetch [--cache-dir DIR]``: fetch the source only."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m draftforge.eval.llamacpp", description=main.__doc__)
    parser.add_argument("action", choices=["fetch"], help="fetch: download and unpack the llama.cpp source")
    parser.add_argument("--cache-dir", default=None, help="the draftforge cache (default $DRAFTFORGE_CACHE or ~/.cache/draftforge)")
    args = parser.parse_args(argv)
    fetch_source(args.cache_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
