"""The tokenizer a ``target.model: random`` borrows: SmolLM2's, cut to the target's vocabulary.

SmolLM2's byte-level BPE lists its 17 special tokens and 235 single characters
first, then one token per merge in merge order (merge ``i`` makes token
``252 + i``, from tokens listed before it). Its first ``N`` tokens with its
first ``N - 252`` merges are therefore a complete BPE tokenizer whose ids are
all below ``N``, with SmolLM2's chat template and special tokens; a text that
SmolLM2 tokenises into ids below ``N`` gets the same ids from it (BPE applies
the lowest-ranked applicable merge first, and no merge it applies is cut).

A random target with that vocabulary runs the whole pipeline (chat templates,
loss masks, generation, evaluation) at a fraction of the vocabulary-sized work
of 49,152 tokens; the tests' tiny targets use it. The cut tokenizer is written
once per size into the draftforge cache, beside the converted SmolLM2 folder,
under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from draftforge.errors import InputError
from draftforge.files import fsync_dir, fsync_tree, shareable
from draftforge.splitserve import smollm2

#: SmolLM2's vocabulary: a random target of this size borrows its tokenizer whole
FULL_VOCAB = 49152
#: tokens before SmolLM2's first merge (specials and single characters): the smallest cut
MIN_VOCAB = 252
#: the files a cut tokenizer folder holds; tokenizer.json is rewritten, the others copied
_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def has_tokenizer(vocab_size: int | None) -> bool:
    """Whether a random target of ``vocab_size`` tokens can borrow a tokenizer."""
    return vocab_size is not None and MIN_VOCAB <= vocab_size <= FULL_VOCAB


def no_tokenizer_reason(vocab_size: int | None) -> str:
    """Why a random target of ``vocab_size`` has no tokenizer, and the sizes that have one."""
    return (
        f"a random target of vocab_size {vocab_size} has no tokenizer: it borrows SmolLM2's, cut to "
        f"its first vocab_size tokens, which needs {MIN_VOCAB} <= vocab_size <= {FULL_VOCAB}"
    )


def tokenizer_dir(vocab_size: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder of SmolLM2's tokenizer cut to ``vocab_size`` tokens (SmolLM2's own folder at
    49,152), writing it first if needed. Raises :class:`~draftforge.errors.InputError` for a
    size outside ``MIN_VOCAB..FULL_VOCAB``."""
    if not has_tokenizer(vocab_size):
        raise InputError(no_tokenizer_reason(vocab_size))
    source = smollm2.ensure_smollm2(cache_dir)
    if vocab_size == FULL_VOCAB:
        return source
    final = source.parent / f"{smollm2.NAME}-tokenizer-{vocab_size}"
    if all((final / name).is_file() for name in _FILES):
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=source.parent))
    try:
        (tmp / "tokenizer.json").write_text(json.dumps(cut_tokenizer_json(
            json.loads((source / "tokenizer.json").read_text()), vocab_size)))
        for name in _FILES[1:]:
            shutil.copyfile(source / name, tmp / name)
        shareable(tmp)
        fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError as err:  # another process renamed its identical copy first
            if not all((final / name).is_file() for name in _FILES):
                raise InputError(
                    f"{final} exists but is not a cut tokenizer folder (one of {', '.join(_FILES)} "
                    "is missing); delete it and run again"
                ) from err
        fsync_dir(source.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def cut_tokenizer_json(spec: dict, vocab_size: int) -> dict:
    """``spec`` (a byte-level BPE ``tokenizer.json`` laid out as SmolLM2's) with its first
    ``vocab_size`` tokens and the merges that make them. Raises ``ValueError`` when the
    layout is not the one this relies on (merge ``i`` makes token ``MIN_VOCAB + i``)."""
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    for rank, (left, right) in enumerate(merges):
        made = vocab.get(left + right)
        if made != MIN_VOCAB + rank or vocab[left] >= made or vocab[right] >= made:
            raise ValueError(
                f"tokenizer merge {rank} ({left!r} + {right!r}) makes token {made}, not "
                f"{MIN_VOCAB + rank} from earlier tokens: not SmolLM2's layout, cannot cut it"
            )
    if any(token["id"] >= vocab_size for token in spec["added_tokens"]):
        raise ValueError(f"an added token's id is {vocab_size} or more; cannot cut to {vocab_size}")
    cut = json.loads(json.dumps(spec))
    cut["model"]["vocab"] = {token: i for token, i in vocab.items() if i < vocab_size}
    cut["model"]["merges"] = [list(m) for m in merges[: vocab_size - MIN_VOCAB]]
    return cut
