"""Refuse training prompts that overlap the evaluation workloads.

Texts are normalised (case-folded, every run of non-alphanumeric characters made one
space). A training text overlaps an evaluation text when

- their normalised forms are equal (``exact``), or
- their character 5-gram sets ``T`` (training) and ``E`` (evaluation) score at least the
  threshold on ``max(|T & E| / |T | E|, |W & E| / |E|)`` (``near``): Jaccard catches
  lightly edited copies, containment an evaluation prompt pasted inside a longer prompt.
  ``W`` is the 5-grams of the stretch of the training text that holds most of ``E``'s;
  stretches are ``2 s`` characters long and start every ``s = CONTAINMENT_WINDOW * len(E)``
  characters, so a copy up to twice ``E``'s length (edits lengthen it) lies whole in one.
  A text no longer than ``2 s`` is one stretch. Containment over a whole long text would
  be noise: a 10,000-character licence holds half the 5-grams of a short MT-Bench
  question, scattered through it.

An inverted index over the rarest 5-grams of each evaluation text keeps this fast
(prefix filtering): only evaluation texts sharing one of their indexed grams with a
training text can reach the threshold, and only those are scored. The filter is exact:
no pair over the threshold is missed.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from draftforge.data.formats import Conversation
from draftforge.errors import InputError

NGRAM = 5
CONTAINMENT_WINDOW = 2  # containment stretches start every this many times len(E) characters
# the check's progress bar shows once it has run this long (minutes for 100,000 long
# conversations, well under this for the built-in prompts)
PROGRESS_DELAY_S = 3.0
_NON_ALNUM = re.compile(r"[\W_]+")


def normalize(text: str) -> str:
    """Case-folded text (after NFKC, so full-width and other compatibility forms read as
    their plain letters) with every run of non-alphanumeric characters replaced by one space."""
    return _NON_ALNUM.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def shingles(normalized: str, n: int = NGRAM) -> frozenset[str]:
    """The set of character n-grams of an already normalised text (the text itself if shorter)."""
    if len(normalized) <= n:
        return frozenset([normalized]) if normalized else frozenset()
    return frozenset(normalized[i : i + n] for i in range(len(normalized) - n + 1))


class GramSequence:
    """Where each 5-gram of a long normalised text starts, for :meth:`stretch_shared`."""

    def __init__(self, normalized: str, grams: frozenset[str], n: int = NGRAM):
        self.length = len(normalized) - n + 1
        self.vocab = {gram: i for i, gram in enumerate(grams)}
        pieces = map(normalized.__getitem__, map(slice, range(self.length), range(n, self.length + n)))
        ids = np.fromiter(map(self.vocab.__getitem__, pieces), dtype=np.int64, count=self.length)
        # the start positions grouped by gram (in order within a gram), and where each group begins
        self.order = np.argsort(ids, kind="stable")
        self.bounds = np.searchsorted(ids[self.order], np.arange(len(self.vocab) + 1))
        # where the same gram started last before each position (-1: nowhere)
        self.previous = np.full(self.length, -1, dtype=np.int64)
        repeat = ids[self.order[1:]] == ids[self.order[:-1]]
        self.previous[self.order[1:][repeat]] = self.order[:-1][repeat]

    def stretch_shared(self, reference: frozenset[str], stride: int) -> int:
        """The most distinct grams of ``reference`` that start in one stretch of ``2 * stride``
        characters, stretches starting every ``stride``: any run of at most ``stride``
        characters (a pasted copy) lies whole inside one of them."""
        groups = [self.vocab[g] for g in reference if g in self.vocab]
        if not groups:
            return 0
        starts = np.concatenate([self.order[self.bounds[g] : self.bounds[g + 1]] for g in groups])
        block = starts // stride  # stretch k covers blocks k and k + 1
        previous = self.previous[starts]
        blocks = self.length // stride + 1
        # a gram counts once in a stretch: where it did not start earlier in that stretch
        new_in_first = np.bincount(block[previous < block * stride], minlength=blocks)
        new_in_second = np.bincount(block[previous < (block - 1) * stride], minlength=blocks)
        per_stretch = new_in_first + np.append(new_in_second[1:], 0)
        return int(per_stretch.max())


@dataclass(frozen=True)
class OverlapHit:
    """A training text that overlaps an evaluation text."""

    train_id: str
    eval_id: str
    kind: str  # "exact" or "near"
    score: float
    where: str = ""


class OverlapError(InputError):
    """Training prompts overlap the evaluation sets; ``hits`` lists every offending pair."""

    def __init__(self, hits: Sequence[OverlapHit], max_lines: int = 20):
        self.hits = list(hits)
        lines = [
            f"{len({h.train_id for h in self.hits})} training prompts overlap the evaluation "
            "workloads (remove them from the training data; data.overlap_check: false turns "
            "this check off, which makes evaluation results meaningless):"
        ]
        for hit in self.hits[:max_lines]:
            where = f" ({hit.where})" if hit.where else ""
            lines.append(
                f"  training {hit.train_id!r}{where} ~ eval {hit.eval_id!r}: "
                f"{hit.kind}, score {hit.score:.2f}"
            )
        if len(self.hits) > max_lines:
            lines.append(f"  ... and {len(self.hits) - max_lines} more")
        super().__init__("\n".join(lines))


class OverlapIndex:
    """Evaluation texts indexed for exact and near-duplicate look-ups."""

    def __init__(self, references: Iterable[tuple[str, str]], threshold: float = 0.5):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"overlap threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.ids: list[str] = []
        self.grams: list[frozenset[str]] = []
        self.lengths: list[int] = []  # normalised characters, for the containment window
        self.exact: dict[str, str] = {}
        for ref_id, text in references:
            norm = normalize(text)
            self.ids.append(ref_id)
            self.grams.append(shingles(norm))
            self.lengths.append(len(norm))
            self.exact.setdefault(norm, ref_id)
        # Prefix filter: a pair scoring >= threshold shares at least k = ceil(threshold * |E|)
        # grams of E, so it shares at least one of E's |E| - k + 1 rarest grams. Only those
        # are indexed, which keeps the posting lists short and misses no pair.
        doc_freq = Counter(g for grams in self.grams for g in grams)
        postings: dict[str, list[int]] = {}
        for index, grams in enumerate(self.grams):
            k = max(1, math.ceil(threshold * len(grams) - 1e-9))
            rarest = sorted(grams, key=lambda g: (doc_freq[g], g))[: len(grams) - k + 1]
            for gram in rarest:
                postings.setdefault(gram, []).append(index)
        self.postings = postings

    def query(self, text: str) -> tuple[str, str, float] | None:
        """The best overlapping evaluation text as ``(eval_id, kind, score)``, or None."""
        norm = normalize(text)
        if norm in self.exact:
            return self.exact[norm], "exact", 1.0
        grams = shingles(norm)
        if not grams:
            return None
        candidates = {i for g in grams for i in self.postings.get(g, ())}
        best: tuple[str, str, float] | None = None
        sequence: GramSequence | None = None  # built once a long text needs it
        for index in candidates:
            ref = self.grams[index]
            if not ref:
                continue
            shared = len(grams & ref)
            jaccard = shared / (len(grams) + len(ref) - shared)
            stride = CONTAINMENT_WINDOW * self.lengths[index]
            if shared / len(ref) >= self.threshold > jaccard and len(norm) > 2 * stride:
                # the whole text holds enough of E: does one stretch of it? (never more)
                sequence = sequence if sequence is not None else GramSequence(norm, grams)
                shared = sequence.stretch_shared(ref, stride)
            score = max(jaccard, shared / len(ref))
            if score >= self.threshold and (best is None or score > best[2]):
                best = (self.ids[index], "near", score)
        return best


@functools.lru_cache(maxsize=4)
def eval_index(workloads: tuple[str, ...], threshold: float) -> OverlapIndex:
    """The overlap index of the named evaluation workloads (cached)."""
    from draftforge.data.workloads import load_workload

    refs = [(p.id, p.text) for name in workloads for p in load_workload(name)]
    return OverlapIndex(refs, threshold)


def find_overlaps(
    conversations: Iterable[Conversation], index: OverlapIndex, *, assistant: bool = False
) -> list[OverlapHit]:
    """Every (conversation, evaluation text) pair where a user turn or the system prompt of
    the conversation overlaps (an eval prompt placed in the system prompt is seen all the same),
    and with ``assistant`` an assistant turn too (trained as they are when the data is not
    regenerated: a reply quoting a HumanEval prompt teaches it all the same)."""
    hits = []
    for conv in conversations:
        turns = _turns(conv.user_turns, "user turn") + ([(conv.system, "system prompt")] if conv.system else [])
        if assistant:
            turns += _turns([m["content"] for m in conv.messages if m["role"] == "assistant"],
                            "assistant turn")
        for turn, role in turns:
            found = index.query(turn)
            if found is not None:
                where = ", ".join(part for part in (conv.source, role) if part)
                hits.append(OverlapHit(conv.id, found[0], found[1], found[2], where))
                break
    return hits


def _turns(texts: list[str], role: str) -> list[tuple[str, str]]:
    """``texts`` with where each is in its conversation: the role, numbered among the turns
    of that role where there are several (a hit in a long conversation names its turn), and
    the system prompt by name; a lone user turn needs no label."""
    if len(texts) == 1:
        return [(texts[0], "" if role == "user turn" else role)]
    return [(text, f"{role} {number}") for number, text in enumerate(texts, start=1)]


def check_no_overlap(
    conversations: Sequence[Conversation],
    *,
    threshold: float = 0.5,
    workloads: Sequence[str] | None = None,
    assistant: bool = False,
    progress: bool = True,
) -> None:
    """Raise :class:`OverlapError` naming every training conversation that overlaps an
    evaluation workload (all of them by default); ``assistant``: check the assistant turns too.
    ``progress``: a bar on stderr once the check has run ``PROGRESS_DELAY_S`` seconds."""
    from tqdm import tqdm

    from draftforge.data.workloads import WORKLOAD_NAMES, WorkloadUnavailableError

    names = tuple(workloads) if workloads is not None else WORKLOAD_NAMES
    try:
        index = eval_index(names, threshold)
    except WorkloadUnavailableError as err:  # say why a command that evaluates nothing needs it
        raise WorkloadUnavailableError(
            f"data.overlap_check compares the training data with the evaluation workloads "
            f"({', '.join(names)}) so that none is trained on; {err}") from None
    with tqdm(conversations, desc="overlap check", unit="conversation", file=sys.stderr,
              delay=PROGRESS_DELAY_S, disable=not progress, dynamic_ncols=True) as bar:
        hits = find_overlaps(bar, index, assistant=assistant)
    if hits:
        raise OverlapError(hits)
