"""Target ranks: prompts or conversations -> (regenerated) samples with target features.

Order, sharding and assignment are pure functions of the recipe, so a resumed run
sees exactly the samples an uninterrupted run would have:

- the conversations are permuted once, seeded by ``data.shuffle_seed``; position
  ``n`` of that order belongs to one producer (:meth:`Topology.producer_of`), so
  every trainer gets the same share of the data, and producers share it in
  proportion to the trainers they feed (or, with more producers than trainers,
  share their trainer's part);
- a producer cuts its share into fixed chunks of ``target.generation.batch_size``
  conversations. Epoch 0 walks the chunks in order, epoch ``e`` in a permutation
  seeded by ``(data.shuffle_seed, e)``; with ``split.reuse_features``, epoch 1 walks
  them in order too, each chunk right after the next one's epoch-0 visit, and sends
  the features its epoch-0 visit computed (:func:`epoch_rounds`; a feature batch that
  a resumed run did not compute in epoch 0 is computed again, from the same rows);
- a chunk is regenerated in one call (seeded by its ids and the recipe seed, so
  with the hf backend its answers are the same whenever it is computed; SGLang
  applies that seed only in its deterministic mode; they are kept in memory and
  reused by later epochs), tokenised with the target's chat template, its
  features computed in batches of ``split.feature_batch_size``, and its samples
  assigned to the producer's trainers by the micro-batches their packers will make
  of them (:mod:`draftforge.splitserve.balance`: each sample, in stream order, to the
  trainer whose packer is least advanced, carried over the whole run; ties rotate
  with the chunk's position in the stream);
- sample ids are the conversation ids, with ``#e<epoch>`` appended after the
  first epoch. Samples whose ids the trainers already consumed (their
  checkpoint) are skipped; a chunk consumed entirely is skipped without being
  computed at all. Its assignment is replayed from the tokens the checkpoint
  recorded for each of its samples, and a consumed sample of a chunk computed
  again counts with its recorded tokens too, so every later sample goes where the
  uninterrupted run sent it. A consumed sample without recorded tokens (a
  checkpoint written before they were, or by a run resumed from one) is left out
  of the balance, by that run and by every later resume alike: the trainers later
  samples go to differ from a run that never met such a checkpoint (a note says
  so), nothing is lost or repeated, and the resumes after it are exact again.
  The ids of conversations dropped for ``data.min_loss_tokens``, because an
  assistant reply's text holds a special token's text (``<|im_end|>`` inside a reply), or
  because the template rewrites a reply cut at ``max_new_tokens`` (both
  :mod:`draftforge.data.tokenize`), go to the trainers with the next sample, and their
  checkpoint records them as consumed with it (0 tokens), so a chunk that holds one counts
  as consumed too.

Epochs repeat until every trainer says stop (or ``split.max_epochs``).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftforge.data.loading import RESERVED_ID_MARK
from draftforge.errors import InputError
from draftforge.splitserve.accounting import Meter
from draftforge.splitserve.balance import PackedBalance
from draftforge.splitserve.transport import settle

if TYPE_CHECKING:
    from draftforge.config import RecipeConfig
    from draftforge.data.formats import Conversation
    from draftforge.splitserve.config import SplitConfig
    from draftforge.splitserve.target import TargetEngine, TargetFeatures
    from draftforge.splitserve.transport import AckListener, Pulse


# --------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Topology:
    """Which target rank feeds which trainer ranks.

    With at most as many producers as trainers, trainer ``j`` (in trainer-rank
    order) is fed by producer ``j mod T`` alone; with more producers than
    trainers, producer ``i`` feeds trainer ``i mod R`` alone. Either way every
    link is one producer -> one trainer and no trainer waits on two producers
    that wait on each other.
    """

    producers: tuple[int, ...]
    trainers: tuple[int, ...]

    def dests(self, producer: int) -> list[int]:
        """The trainer ranks ``producer`` sends to, in rank order."""
        i = self.producers.index(producer)
        num_p, num_r = len(self.producers), len(self.trainers)
        if num_p <= num_r:
            return [r for j, r in enumerate(self.trainers) if j % num_p == i]
        return [self.trainers[i % num_r]]

    def sources(self, trainer: int) -> list[int]:
        """The target ranks that feed ``trainer``, in rank order."""
        j = self.trainers.index(trainer)
        num_p, num_r = len(self.producers), len(self.trainers)
        if num_p <= num_r:
            return [self.producers[j % num_p]]
        return [p for i, p in enumerate(self.producers) if i % num_r == j]

    def producer_of(self, position: int) -> int:
        """The producer owning position ``position`` of an epoch's order.

        Positions go round the trainers first, so every trainer gets the same share of
        conversations whatever the numbers; a trainer's share goes round its producers. The
        micro-batches those shares make can still differ (tests/test_balance_r60.py): at the
        end of the data the trainers that run short fill their steps with micro-batches that
        supervise nothing (``Trainer.fit``)."""
        num_r = len(self.trainers)
        sources = self.sources(self.trainers[position % num_r])
        return sources[(position // num_r) % len(sources)]


def build_topology(split: SplitConfig) -> Topology:
    """The topology of a resolved ``split`` section (one producer per tensor-parallel group)."""
    tp = split.target_tensor_parallel
    producers = tuple(split.target_ranks[::tp])
    return Topology(producers=producers, trainers=tuple(split.trainer_ranks or ()))


def epoch_order(num: int, *, seed: int, epoch: int) -> list[int]:
    """A permutation of ``range(num)`` that depends only on ``(seed, epoch)``."""
    order = list(range(num))
    random.Random(f"draftforge-order:{seed}:{epoch}").shuffle(order)
    return order


EPOCH_MARK = RESERVED_ID_MARK  # data files may not use it in their ids


def epoch_rounds(num_chunks: int, *, seed: int, max_epochs: int | None,
                 interleave: bool) -> Iterator[list[tuple[int, int, int]]]:
    """The chunk visits of a producer's stream, a list per round: ``(epoch, chunk index, rotation)``.

    A round is one epoch: epoch 0 visits the chunks in order, epoch ``e`` in
    :func:`epoch_order`. With ``interleave`` (``split.reuse_features``) the first round holds
    epochs 0 and 1 together, each chunk's epoch-1 visit right after the next chunk's epoch-0
    one (0/0, 0/1, 1/0, 0/2, 1/1, ...), so its features, kept from epoch 0, are sent again
    while they are still held. ``rotation`` is the visit's position in the stream."""
    epoch = 0
    while max_epochs is None or epoch < max_epochs:
        if epoch == 0 and interleave and (max_epochs is None or max_epochs > 1):
            order = [(0, 0)]
            for chunk in range(1, num_chunks):
                order += [(0, chunk), (1, chunk - 1)]
            order.append((1, num_chunks - 1))
            yield [(e, chunk, position) for position, (e, chunk) in enumerate(order)]
            epoch = 2
            continue
        visit = list(range(num_chunks)) if epoch == 0 else epoch_order(num_chunks, seed=seed, epoch=epoch)
        yield [(epoch, chunk, epoch * num_chunks + step) for step, chunk in enumerate(visit)]
        epoch += 1


def epoch_id(conv_id: str, epoch: int) -> str:
    """The sample id of conversation ``conv_id`` in ``epoch``."""
    return conv_id if epoch == 0 else f"{conv_id}{EPOCH_MARK}{epoch}"


def id_epoch(sample_id: str) -> int:
    """The epoch of a sample id, as :func:`epoch_id` wrote it (``conv#e1``: 1; a conversation id: 0)."""
    head, mark, tail = sample_id.rpartition(EPOCH_MARK)
    return int(tail) if mark and head and tail.isdigit() else 0


# --------------------------------------------------------------------------- samples


@dataclass
class ProducedSample:
    """A sample ready for the wire, and the trainer it is assigned to."""

    dest: int
    sample_id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    aux: torch.Tensor  # [S, K*H_t]
    final: torch.Tensor  # [S, H_t]
    chunk_end: bool = False  # the last sample of its chunk sent to ``dest``
    chunk_last: bool = False  # the last sample of its chunk (on any link)
    dropped_ids: tuple[str, ...] = ()  # dropped by tokenisation (either reason) since the last sample

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _producers_named(split: SplitConfig) -> str:
    """What the producers are called in a message: target ranks, or tensor-parallel target groups."""
    tp = split.target_tensor_parallel
    return "target ranks" if tp == 1 else f"target groups ({tp} tensor-parallel ranks each)"


def launch_pin() -> str | None:
    """In a rank, what its launch found (``launch.ANSWERS_SOURCE_ENV``); None where it was not
    started by ``draftforge train`` on one node (each rank looks then)."""
    from draftforge.splitserve.launch import ANSWERS_SOURCE_ENV

    return os.environ.get(ANSWERS_SOURCE_ENV)


def load_source_conversations(cfg: RecipeConfig, *, pinned: str | None = None) -> tuple[list[Conversation], bool]:
    """The conversations to walk and whether their answers must be regenerated.

    ``data.regenerate`` with a regenerated file present (``data.regenerated_file``
    or ``<output_dir>/regenerated.jsonl``): its conversations, once the file is checked
    to answer exactly this recipe's prompts with its target and ``target.generation``
    settings (a stale file raises :class:`~draftforge.data.regenerate.RegenerationError`).
    ``data.regenerate`` without one: the prompts, regenerated on the fly.
    Otherwise: the conversations of ``data.train_files`` as they are. ``pinned`` (a rank's
    :func:`launch_pin`: what ``draftforge train`` found at its launch, "file" or "inline")
    decides whether the file is there, so that a file appearing after the launch is taken by
    the next launch, not by some of this job's ranks.
    """
    from draftforge.data.loading import (
        load_prompts,
        load_training_conversations,
        regenerated_path,
    )
    from draftforge.data.regenerate import RegenerationError, answers_path_problem, check_answers
    from draftforge.splitserve.target import target_name

    data = cfg.data
    if not data.regenerate:
        return load_training_conversations(data, cfg.train.output_dir).conversations, False
    path = regenerated_path(data, cfg.train.output_dir)
    if pinned == "inline" and data.regenerated_file is None:  # none at the launch: every rank answers
        return load_prompts(data).conversations, True
    if pinned == "file" and not path.is_file():
        raise InputError(f"{path}: the answers file this job's launch found is gone; rerun the command "
                         "(it answers the prompts during training when no file is there)")
    if not path.is_file():
        if data.regenerated_file is not None:  # named, so meant to exist: never answer silently
            problem = answers_path_problem(path)  # 'data regenerate' would refuse to write it
            if problem:
                raise InputError(problem)
            raise InputError(
                f"data.regenerated_file {path}: no such file. Write it first with 'draftforge data "
                "regenerate RECIPE' (same overrides), or leave data.regenerated_file unset to "
                "answer the prompts during training"
            )
        return load_prompts(data).conversations, True
    prompts = load_prompts(data.model_copy(update={"overlap_check": False})).conversations
    check_answers(path, prompts, cfg.target.generation, target_name(cfg.target))
    # the file may answer more prompts than this run's (written for a larger data.num_samples
    # or more train_files, which 'data regenerate' accepts): take this run's, in prompt order
    every = load_training_conversations(data.model_copy(update={"num_samples": None}),
                                        cfg.train.output_dir).conversations
    by_id = {c.id: c for c in every}
    missing = [p.id for p in prompts if p.id not in by_id]
    if missing:
        raise RegenerationError(
            f"{path} does not hold a readable answer to {len(missing)} of this run's "
            f"{len(prompts)} prompts (first: {missing[0]!r}; invalid rows skipped); rewrite it "
            "with 'draftforge data regenerate'"
        )
    return [by_id[p.id] for p in prompts], False


MARKOV_INIT_CONVERSATIONS = 20000  # the first ones: enough for a bigram table, quick to tokenise
NO_ANSWERS_FOR_MARKOV_INIT = (
    "train.markov_init: bigram counts the training answers before the first step, but with "
    "data.regenerate and no regenerated file they are only written during training; run "
    "'draftforge data regenerate RECIPE' first (training then reads that file), or set "
    "train.markov_init: random"
)


def markov_init_samples(cfg: RecipeConfig) -> tuple[list[list[int]], list[list[bool]]]:
    """Token ids and loss masks of the first training samples, tokenised as the producer
    does, for ``train.markov_init: bigram``. The answers must exist before training."""
    from draftforge.data.tokenize import tokenize_conversations
    from draftforge.splitserve.target import load_tokenizer

    data = cfg.data.model_copy(update={"overlap_check": False})  # the target ranks check it
    conversations, regenerate = load_source_conversations(cfg.model_copy(update={"data": data}),
                                                          pinned=launch_pin())
    if regenerate:
        raise InputError(NO_ANSWERS_FOR_MARKOV_INIT)
    settings = cfg.target.generation
    samples, _ = tokenize_conversations(
        conversations[:MARKOV_INIT_CONVERSATIONS],
        load_tokenizer(cfg.target),
        max_length=cfg.data.max_length,
        min_loss_tokens=cfg.data.min_loss_tokens,
        chat_template=settings.chat_template,
        enable_thinking=settings.enable_thinking,
    )
    return [s.input_ids for s in samples], [s.loss_mask for s in samples]


class SampleSource:
    """One producer's deterministic stream of samples (see the module docstring)."""

    def __init__(
        self,
        cfg: RecipeConfig,
        engine: TargetEngine,
        topology: Topology,
        producer: int,
        *,
        conversations: Sequence[Conversation],
        regenerate: bool,
        consumed: Mapping[str, int | None] | None = None,
        meter: Meter | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.topology = topology
        self.producer = producer
        self.dests = topology.dests(producer)
        self.conversations = list(conversations)
        self.regenerate = regenerate
        # the ids the trainers consumed (or were told were dropped), each with its sample's
        # tokens: 0 for a dropped id, None where the checkpoint did not record them
        self.consumed = dict(consumed or {})
        self.balance = PackedBalance(len(self.dests), cfg.split.token_budget)
        self._unknown_lengths_said = False
        self.meter = meter or Meter()
        self.should_stop = should_stop
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.chunk_size = cfg.target.generation.batch_size
        self.skipped_consumed = 0
        self.dropped_short = 0
        # dropped because an assistant reply's text holds a special token's text (data.tokenize),
        # and the first such (conversation id, token text), for the rank's note
        self.dropped_special = 0
        self.special_example: tuple[str, str] | None = None
        # dropped because the template rewrites a reply cut at max_new_tokens (data.tokenize)
        self.dropped_rewritten = 0
        self.rewritten_example: str | None = None
        self.truncated = 0  # cut to data.max_length: with a prompt that fills it, no reply is left
        self._tallied: set[int] = set()  # chunks whose conversations the counts above include
        self.context_turns = 0  # assistant turns the chat template rewrites later: not supervised
        self._answers: dict[int, list[Conversation]] = {}
        # split.reuse_features: epoch 0's features of each feature batch, by (chunk, first row),
        # until epoch 1 sends them again (with the batch's ids, which that batch must match)
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, TargetFeatures]] = {}
        self._dropped: list[str] = []  # ids tokenisation dropped (any reason), for the next sample
        if not self.conversations:
            raise InputError("no training conversations: data.train_files gave no rows")

    def share(self) -> list[int]:
        """Indices (into the conversation list) this producer serves, in order."""
        order = epoch_order(len(self.conversations), seed=self.cfg.data.shuffle_seed, epoch=0)
        return [index for n, index in enumerate(order) if self.topology.producer_of(n) == self.producer]

    def chunks(self) -> list[list[int]]:
        """The fixed chunks of the share (the unit of regeneration, features and assignment)."""
        share = self.share()
        return [share[i : i + self.chunk_size] for i in range(0, len(share), self.chunk_size)]

    def samples(self) -> Iterator[ProducedSample]:
        """The stream: every sample of this producer's share, epoch after epoch."""
        max_epochs = self.cfg.split.max_epochs
        chunks = self.chunks()
        if not chunks:  # the data, not the code: exit status 2, which the launcher does not restart
            raise InputError(
                f"target rank {self.producer} has no conversations to serve: "
                f"{len(self.conversations)} conversations for {len(self.topology.producers)} "
                f"{_producers_named(self.cfg.split)}; add data (data.num_samples) or use fewer target ranks"
            )
        try:
            yield from self._rounds(chunks, max_epochs)
        finally:
            self._kept.clear()  # a stopped stream holds no features through the links' last sends

    def _rounds(self, chunks: list[list[int]], max_epochs: int | None) -> Iterator[ProducedSample]:
        """The samples of :meth:`samples`, round after round (:func:`epoch_rounds`)."""
        rounds = epoch_rounds(len(chunks), seed=self.cfg.data.shuffle_seed, max_epochs=max_epochs,
                              interleave=self.cfg.split.keeps_features)
        for visits in rounds:
            produced = 0
            for epoch, chunk_index, rotation in visits:
                chunk = [self.conversations[i] for i in chunks[chunk_index]]
                ids = [epoch_id(c.id, epoch) for c in chunk]
                last_visit = max_epochs is not None and epoch == max_epochs - 1
                if all(i in self.consumed for i in ids):
                    self._assign(ids, {}, rotation)  # replayed from the recorded lengths
                    self.skipped_consumed += len(ids)
                    produced += len(ids)
                    if last_visit:  # answers an earlier visit regenerated after a resume
                        self._answers.pop(chunk_index, None)
                    continue
                if self.should_stop():
                    return
                samples, consumed_rows = self._chunk_samples(chunk_index, chunk, epoch, rotation)
                if last_visit:
                    # the chunk's last visit: no later epoch reads its answers (a single-pass
                    # run held every regenerated conversation until the stream ended)
                    self._answers.pop(chunk_index, None)
                if self.should_stop():  # the trainers stopped while the chunk was computed
                    return
                produced += consumed_rows
                for sample in samples:
                    produced += 1
                    if sample.sample_id in self.consumed:
                        self.skipped_consumed += 1
                        continue
                    sample.dropped_ids, self._dropped = tuple(self._dropped), []
                    yield sample
                    if self.should_stop():
                        return
                # the visit's samples are sent: not held (features and all) while the next
                # chunk is answered and computed
                samples = sample = None
            if produced == 0:
                cut = (f"; {self.truncated} were cut to data.max_length={self.cfg.data.max_length} "
                       "tokens, which leaves no room for a reply after a prompt that long: raise "
                       "data.max_length") if self.truncated else ""
                short = (f"fewer than data.min_loss_tokens={self.cfg.data.min_loss_tokens} "
                         f"supervised tokens{cut}")
                several = len(self.topology.producers) > 1
                # one rank's share: the others' may hold samples, and more data or fewer ranks helps
                whose = (f" of its share ({sum(map(len, chunks))} of the {len(self.conversations)} "
                         f"conversations, split among {len(self.topology.producers)} "
                         f"{_producers_named(self.cfg.split)})" if several else "")
                if self.dropped_special or self.dropped_rewritten:
                    why = f"every conversation{whose} was dropped: {self.dropped_short} had {short}{other_drops(self)}"
                else:
                    why = f"every conversation{whose} had {short}"
                hint = "; more data (data.num_samples) or fewer target ranks gives each rank samples" if several else ""
                raise InputError(f"target rank {self.producer}: epoch {visits[0][0]} produced no sample ({why}){hint}")

    def _assign(self, ids: Sequence[str], fresh: Mapping[str, int], rotation: int) -> dict[str, int]:
        """Give the samples of a chunk (``ids``: its sample ids, in chunk order) to the trainers;
        the index into :attr:`dests` of each sample given one (see the module docstring).

        A sample the trainers consumed counts with the tokens their checkpoint recorded (all
        a chunk consumed entirely has), any other with its ``fresh`` tokenised length; an id
        dropped for ``data.min_loss_tokens`` (recorded with 0 tokens, or absent from
        ``fresh``) is no sample; a consumed one whose tokens were not recorded is left out."""
        lengths: list[int] = []
        given: list[str] = []
        for i in ids:
            n = self.consumed[i] if i in self.consumed else fresh.get(i, 0)
            if n is None:
                self._unknown_lengths()
            elif n:
                lengths.append(n)
                given.append(i)
        return dict(zip(given, self.balance.assign(lengths, rotation=rotation), strict=True))

    def _unknown_lengths(self) -> None:
        if len(self.dests) > 1 and not self._unknown_lengths_said:
            self._unknown_lengths_said = True
            self.log(f"target rank {self.producer}: the checkpoint does not record the lengths of "
                     "some samples the trainers consumed (an earlier draftforge wrote it, or the "
                     "checkpoint its run resumed from), so the balance across the trainers leaves "
                     "them out: later samples go to other trainers than in a run that never met "
                     "such a checkpoint; no sample is lost or repeated")

    def _chunk_samples(
        self, chunk_index: int, chunk: list[Conversation], epoch: int, rotation: int
    ) -> tuple[list[ProducedSample], int]:
        """The chunk's samples, and how many of its samples were not computed because a resumed
        run's trainers consumed their whole feature batch (counted in ``skipped_consumed``).

        A chunk that holds a sample dropped for ``data.min_loss_tokens`` is not wholly
        consumed until the trainers record the drop (a checkpoint from before they took the
        sample carrying it, or one written without dropped ids); skipping whole feature
        batches keeps a resume from featurising every such chunk again, and keeps the other
        batches' rows, so their features are the ones the uninterrupted run computed."""
        from draftforge.data.formats import Conversation
        from draftforge.data.tokenize import tokenize_conversations

        cfg = self.cfg
        settings = cfg.target.generation
        if self.regenerate:
            if chunk_index not in self._answers:
                from draftforge.data.regenerate import answer_batch
                from draftforge.splitserve.sampling import DecodingStopped, stopping_when

                try:  # every trainer stopped: no reply more (a chunk's take tens of seconds on a CPU)
                    with self.meter.busy("generate"), stopping_when(self.should_stop):
                        messages, unfinished, generated = answer_batch(chunk, self.engine, settings)
                except DecodingStopped:
                    return [], 0
                # replies cut at max_new_tokens: their end-of-turn marker is not supervised; the
                # replies' ids as generated are supervised, not their text tokenised again
                self._answers[chunk_index] = [
                    Conversation(id=c.id, messages=m, source=c.source,
                                 extra={"unfinished_turns": cut, "reply_token_ids": ids})
                    for c, m, cut, ids in zip(chunk, messages, unfinished, generated, strict=True)
                ]
            chunk = self._answers[chunk_index]
        with self.meter.busy("tokenize"):
            tokenized, stats = tokenize_conversations(
                chunk,
                self.engine.tokenizer,
                max_length=cfg.data.max_length,
                min_loss_tokens=cfg.data.min_loss_tokens,
                chat_template=settings.chat_template,
                enable_thinking=settings.enable_thinking,
            )
        if chunk_index not in self._tallied:  # every epoch tokenises a chunk alike: counted once
            self._tallied.add(chunk_index)
            self.dropped_short += stats.num_dropped_short
            self.dropped_special += stats.num_dropped_special
            self.dropped_rewritten += stats.num_dropped_rewritten
            self.truncated += stats.num_truncated
        if stats.rewritten_example and not self.rewritten_example:
            self.rewritten_example = epoch_id(stats.rewritten_example, epoch)
        if stats.special_example and not self.special_example:
            conv_id, token = stats.special_example
            self.special_example = (epoch_id(conv_id, epoch), token)
        dropped = (epoch_id(conv_id, epoch) for conv_id in stats.dropped_ids)
        self._dropped += [i for i in dropped if i not in self.consumed]
        if stats.num_context_turns and not self.context_turns:
            self.log(f"target rank {self.producer}: the chat template rewrites earlier assistant turns "
                     "in later prompts (e.g. drops their reasoning); those turns are context, not "
                     "supervised; each conversation's last turn is")
        self.context_turns += stats.num_context_turns
        if not tokenized:
            return [], 0
        bins = self._assign([epoch_id(c.id, epoch) for c in chunk],
                            {epoch_id(t.id, epoch): len(t.input_ids) for t in tokenized}, rotation)
        out: list[ProducedSample] = []
        skipped = 0
        batch = cfg.split.feature_batch_size
        for start in range(0, len(tokenized), batch):
            if self.should_stop():  # every trainer stopped: no feature batch more (seconds each)
                break
            group = tokenized[start : start + batch]
            kept = self._kept.pop((chunk_index, start), None) if epoch == 1 else None
            if all(epoch_id(t.id, epoch) in self.consumed for t in group):
                skipped += len(group)
                continue
            longest = max(len(t.input_ids) for t in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for row, t in enumerate(group):
                ids[row, : len(t.input_ids)] = torch.tensor(t.input_ids)
                mask[row, : len(t.input_ids)] = 1
            if kept is not None and torch.equal(kept[0], ids):
                feats = kept[1]  # what this batch's forward gave in epoch 0
            else:  # epoch 0, a later epoch, or a resumed run that did not compute epoch 0's batch
                with self.meter.busy("features"):
                    feats = self.engine.features(ids, mask)
                    settle(feats.final.device)  # a GPU forward returns before it is done
                if (self.cfg.split.keeps_features and epoch == 0
                        and not all(epoch_id(t.id, 1) in self.consumed for t in group)):
                    self._kept[(chunk_index, start)] = (ids, feats)
            self.meter.add_tokens(int(mask.sum()))
            for row, t in enumerate(group):
                n = len(t.input_ids)
                out.append(
                    ProducedSample(
                        # one the trainers consumed is not sent: where it went does not matter
                        dest=self.dests[bins.get(epoch_id(t.id, epoch), 0)],
                        sample_id=epoch_id(t.id, epoch),
                        input_ids=ids[row, :n].clone(),
                        loss_mask=torch.tensor(t.loss_mask, dtype=torch.bool),
                        aux=feats.aux[row, :n].clone(),  # stays on the target's device
                        final=feats.final[row, :n].clone(),
                    )
                )
        for last in {sample.dest: i for i, sample in enumerate(out)}.values():
            out[last].chunk_end = True  # the chunk's last sample on each link
        if out:
            out[-1].chunk_last = True
        self.skipped_consumed += skipped
        return out, skipped


class PendingSamples:
    """The samples produced for each trainer and not yet sent (its link's credits are in use),
    in order, with the most tokens that ever waited here for one trainer: what the target's
    device holds beyond the links (bounded by the balance of :mod:`draftforge.splitserve.balance`)."""

    def __init__(self, dests: Sequence[int]) -> None:
        self._queues: dict[int, deque[ProducedSample]] = {dest: deque() for dest in dests}
        self._tokens = dict.fromkeys(dests, 0)
        self.max_tokens = 0

    def __getitem__(self, dest: int) -> deque[ProducedSample]:
        return self._queues[dest]  # read it; change it through the methods below

    def any(self) -> bool:
        return any(self._queues.values())

    def append(self, sample: ProducedSample) -> None:
        self._queues[sample.dest].append(sample)
        self._tokens[sample.dest] += sample.num_tokens
        self.max_tokens = max(self.max_tokens, self._tokens[sample.dest])

    def popleft(self, dest: int) -> ProducedSample:
        sample = self._queues[dest].popleft()
        self._tokens[dest] -= sample.num_tokens
        return sample

    def clear(self, dest: int) -> None:
        self._queues[dest].clear()
        self._tokens[dest] = 0


def embedding_dests(topology: Topology, rank: int) -> list[int]:
    """The trainers whose first producer is ``rank``: it sends them the embeddings."""
    return [dest for dest in topology.dests(rank) if topology.sources(dest)[0] == rank]


def send_embeddings(
    engine: TargetEngine, topology: Topology, rank: int, *, data_group, device="cpu",
    pulse: Pulse | None = None,
) -> None:
    """The frozen embedding and lm_head, to each trainer whose first producer is this rank
    (which then waits for nothing more on the link until it has built its draft: no beat)."""
    from draftforge.splitserve import transport as T

    embed, head = engine.embed_tokens_weight(), engine.lm_head_weight()
    for dest in embedding_dests(topology, rank):
        with pulse.lock if pulse is not None else contextlib.nullcontext():
            T.send_tensor(embed.detach().cpu().contiguous(), dest, group=data_group, device=device)
            T.send_tensor(head.detach().cpu().contiguous(), dest, group=data_group, device=device)
            if pulse is not None:
                pulse.waiting.discard(dest)


def run_producer(
    cfg: RecipeConfig,
    engine: TargetEngine,
    topology: Topology,
    rank: int,
    *,
    data_group,
    ack_group,
    device: torch.device | str = "cpu",
    log: Callable[[str], None],
    pulse: Pulse | None = None,
    hellos: AckListener | None = None,
) -> dict:
    """Serve this target rank's trainers until they all stop; returns the accounting summary.

    ``pulse``: the rank's heartbeat on the data links (one is started when None);
    ``hellos``: the rank's listener on the ack group, started with the rank (started
    here when None).
    """
    from draftforge.splitserve import transport as T

    dests = topology.dests(rank)
    split = cfg.split
    if pulse is None:
        pulse = T.Pulse(every_s=split.peer_timeout_s / 4, group=data_group, device=device)
    if hellos is None:
        hellos = T.AckListener(dests, group=ack_group)
    # the trainers' resume states; their heartbeats, and the stop of a trainer that already
    # has its steps, come meanwhile (the gate reads them from the same listener)
    consumed = hellos.result()
    credits = max(1, split.max_in_flight // len(topology.sources(dests[0])))
    gate = T.CreditGate(dests, credits, timeout_s=split.peer_timeout_s, listener=hellos)
    # A trainer fed by several producers receives from them in turn, so it may not be
    # receiving from this one: it gets no beat (a send would wait for its turn).
    lone = [dest for dest in dests if len(topology.sources(dest)) == 1]
    pulse.expect(lone, listens=gate.listens, on_error=gate.fail)
    meter = Meter()
    conversations, regenerate = load_source_conversations(cfg, pinned=launch_pin())
    source = SampleSource(
        cfg, engine, topology, rank, conversations=conversations, regenerate=regenerate,
        consumed=consumed, meter=meter, should_stop=gate.all_stopped, log=log,
    )
    if consumed:
        log(f"target rank {rank}: resuming; the trainers already consumed {len(consumed)} samples "
            "(or dropped them: too few supervised tokens, special-token text in a reply, or a "
            "cut reply the template rewrites)")
    seq = dict.fromkeys(dests, 0)
    # Each link keeps its own order, but links do not wait on each other: a trainer whose
    # link is full (it holds a step's data and waits in a collective for the others) must
    # not stop the samples of a trainer that needs them, or both wait forever.
    pending = PendingSamples(dests)

    def send_ready(block: bool) -> None:
        """Send what the links' credits allow, in each link's order; with ``block``,
        wait for at least one send (or for the waiting trainers to stop)."""
        while True:
            for dest in dests:
                if pending[dest] and gate.has_stopped(dest):
                    pending.clear(dest)  # that trainer has its steps: drop what it would get
            waiting = [dest for dest in dests if pending[dest]]
            if not waiting:
                return
            with meter.idle("credits"):
                dest = gate.acquire(waiting, block=block)
            if dest is None:  # blocking: every waiting trainer stopped (cleared above next)
                if block:
                    continue
                return
            sample = pending.popleft(dest)
            with pulse.lock:
                T.send_sample(
                    dest, sample.sample_id, sample.input_ids, sample.loss_mask,
                    sample.aux, sample.final, seq_no=seq[dest],
                    stats=meter.wire_stats(), chunk_end=sample.chunk_end,
                    dropped_ids=sample.dropped_ids, group=data_group, device=device, meter=meter,
                )
                gate.note_sent(dest)
            seq[dest] += 1
            block = False  # one send is progress; go on only while credits allow

    def finish_links() -> None:
        """Send each link the rest of its queue, then its END, links not waiting on each other:
        a trainer that has run out of samples needs its END to end its stream (and pack its last,
        partly filled micro-batch) while another, whose link is full, waits for it in a collective."""
        ended: set[int] = set()
        while len(ended) < len(dests):
            for dest in dests:
                if pending[dest] and gate.has_stopped(dest):
                    pending.clear(dest)
            for dest in dests:
                # END too needs the trainer receiving: a credit left, or its stop
                if dest not in ended and not pending[dest] and gate.listens(dest):
                    with pulse.lock:
                        T.send_end(dest, group=data_group, device=device)
                        pulse.waiting.discard(dest)
                    ended.add(dest)
            sent = sum(seq.values())
            send_ready(block=False)
            if len(ended) == len(dests) or sum(seq.values()) > sent:
                continue
            with meter.idle("credits"):  # nothing can go now: wait for a credit (or a stop)
                gate.acquire([dest for dest in dests if dest not in ended])

    meter.start()
    try:
        for sample in source.samples():
            pending.append(sample)
            send_ready(block=False)
            # Produce ahead only while some live trainer has nothing queued here (it may be
            # the one the others wait for); once every one has, wait for a credit.
            while all(pending[d] or gate.has_stopped(d) for d in dests) and pending.any():
                send_ready(block=True)
        if not gate.all_stopped():
            log(f"target rank {rank}: data finished (split.max_epochs={split.max_epochs})")
        finish_links()
        pulse.close()
        # The trainers still return credits for what they hold; their stop is the last message.
        # Counted as idle: the done line covers the serving to the trainers' stop.
        with meter.idle("stop"):
            gate.wait_all_stopped(split.peer_timeout_s)
    finally:
        meter.stop()
    gate.join(timeout=10.0)
    summary = meter.summary()
    summary["max_outstanding"] = gate.max_outstanding
    summary["max_pending_tokens"] = pending.max_tokens
    summary["credits"] = credits
    summary["skipped_consumed"] = source.skipped_consumed
    summary["dropped_short"] = source.dropped_short
    summary["dropped_special"] = source.dropped_special
    summary["dropped_rewritten"] = source.dropped_rewritten
    summary["truncated"] = source.truncated
    summary["context_turns"] = source.context_turns
    if source.dropped_short or source.truncated or source.dropped_special or source.dropped_rewritten:
        log(data_note(cfg, rank, source))  # counted, and said: the rank's last line says none of them
    return summary


def other_drops(source: SampleSource) -> str:
    """The samples ``source`` dropped for another reason than too few supervised tokens (special-
    token text in a reply, a cut reply the template rewrites), as ``", N dropped (...)"`` parts."""
    from draftforge.data.tokenize import rewritten_note, special_note

    return (special_note(source.dropped_special, source.special_example)
            + rewritten_note(source.dropped_rewritten, source.rewritten_example))


def data_note(cfg: RecipeConfig, rank: int, source: SampleSource) -> str:
    """What target rank ``rank``'s tokenisation left out of training: the samples it dropped for
    ``data.min_loss_tokens``, for special-token text in a reply or for a cut reply the template
    rewrites, and those it cut to ``data.max_length``: conversations, each counted once, however
    many epochs tokenise it (a resumed run counts the chunks it computes)."""
    return (f"target rank {rank}: {source.dropped_short} conversations dropped (fewer than "
            f"data.min_loss_tokens={cfg.data.min_loss_tokens} supervised tokens){other_drops(source)}, "
            f"{source.truncated} cut to data.max_length={cfg.data.max_length} tokens "
            "(each counted once, whatever the epochs that tokenised it)")

