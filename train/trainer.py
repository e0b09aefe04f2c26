"""The training loop: a draft, AdamW with warmup + cosine, a parallel strategy, exact resume.

The trainer sees an iterator of micro-batches (lists of :class:`Sample`) and
never knows where they came from. Each optimizer step consumes
``train.grad_accum`` items. All collectives run on the trainer group, which
may be a subgroup of the world.

Determinism: the anchors of micro-step ``m`` of step ``s`` on trainer rank
``r`` come from a fresh generator seeded by ``(train.seed, s, m, r)``, the
learning rate is a pure function of the step, and a checkpoint restores
weights, AdamW moments and RNG, so a resumed run repeats an uninterrupted
one step for step (given the same batches).

Non-finite steps: when the loss or the gradient norm is not finite on any
rank, the step is skipped (no update, its samples count as consumed) and
counted; more than ``train.max_bad_steps`` skipped steps stop the run with a
checkpoint of the last good weights. A step without any supervised slot on any rank
(no anchor) has nothing to learn from: it changes no weight and no AdamW moment (a
zero-gradient AdamW update would still move the weights by momentum and weight
decay), but, like a skipped step, takes its place in the schedule and its samples
count as consumed; it is not counted as skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from draftforge.errors import InputError
from draftforge.train import checkpoint as ckpt
from draftforge.train import distributed as D
from draftforge.train.blocks import build_layout, sample_anchors
from draftforge.train.config import TrainConfig, warmup_steps
from draftforge.train.metrics import (
    METRICS_FILE,
    NO_PLOT,
    PLOT_FILE,
    RUN_FILE,
    SUMMARY_FILE,
    MetricsLog,
    Progress,
    format_summary,
    read_summary,
    record_segment_summary,
    recorded_summary,
    write_line,
    write_run_records,
    write_summary,
)
from draftforge.train.model import DSparkConfig, DSparkDraft, count_parameters
from draftforge.train.objective import exp_weights
from draftforge.train.recipe_changes import resume_note
from draftforge.train.sample import Sample, collate

# A step's summed scalars: loss, ce, tv, bce, tau sum, blocks, tokens, block tokens,
# non-finite flag, kl; then c* sums and valid counts per slot.
STEP_SCALARS = 10


@dataclass
class ResumeInfo:
    """Where a resumed run continues: the step and the data already consumed."""

    step: int
    consumed_ids: list[str]  # this trainer rank's
    # every trainer rank's consumed ids with their samples' tokens, and the ids their samples
    # said were dropped (0 tokens); None where the checkpoint did not record the tokens
    all_consumed: dict[str, int | None]
    extra: dict
    path: Path
    schedule_change: str = ""  # non-empty when this run's schedule differs from the resumed step on
    optimizer_change: str = ""  # non-empty when the checkpoint's AdamW settings were replaced


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` did; the per-step lists cover this call's steps, this rank's timings."""

    step: int
    steps_run: int
    skipped_steps: int
    # "steps_done", "data_exhausted" or "max_bad_steps"; "interrupted" in the summary of a segment
    # a signal stopped (Ctrl-C, SIGTERM: fit() raises, and returns no result)
    stopped_reason: str
    checkpoint: Path | None
    # data_exhausted: samples the trainer ranks took for a last step that no rank could fill
    # (a rank short of micro-batches while another has a full step fills its own with ones
    # that supervise nothing); not trained, not consumed: a rerun with a higher
    # split.max_epochs trains them
    untrained: int = 0
    losses: list[float] = field(default_factory=list)
    sample_ids: list[list[str]] = field(default_factory=list)  # per step, every rank's, rank order
    wait_s: list[float] = field(default_factory=list)  # waiting for the next batch (iterator next)
    compute_s: list[float] = field(default_factory=list)  # forward, backward, optimizer, metrics
    summary: dict = field(default_factory=dict)


def lr_at(step: int, *, train: TrainConfig) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio * lr``."""
    warmup = warmup_steps(train)
    if step < warmup:
        return train.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, train.steps - warmup))
    floor = train.min_lr_ratio
    return train.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def anchor_seed(*, seed: int, step: int, micro_step: int, rank: int) -> int:
    """A generator seed unique to (seed, step, micro-step, trainer rank)."""
    digest = hashlib.sha256(f"{seed}:{step}:{micro_step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def device_kind(setting: str) -> str:
    """``cpu`` or ``cuda`` for a ``train.device`` setting (cpu, cuda or auto); ``cuda``
    where torch sees no CUDA device is refused with a RuntimeError."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available; use train.device=cpu")
    return "cuda"


def _pick_device(setting: str) -> torch.device:
    if device_kind(setting) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class Trainer:
    """Builds the draft for one trainer rank and trains it; see the module docstring."""

    def __init__(
        self,
        *,
        model_config: DSparkConfig,
        train: TrainConfig,
        embeddings: tuple[torch.Tensor, torch.Tensor],
        run_dir: Path,
        group: dist.ProcessGroup | None = None,
        recipe_yaml: str | None = None,
        init_draft: Callable[[DSparkDraft], str] | None = None,
        run_details: dict | None = None,
    ) -> None:
        self.train = train
        self._init_draft = init_draft
        self.run_dir = Path(run_dir)
        if group is None and train.strategy != "single" and dist.is_initialized():
            group = dist.group.WORLD
        if train.strategy != "single" and group is None:
            raise RuntimeError(
                f"train.strategy={train.strategy!r} needs torch.distributed: start with torchrun "
                "(or draftforge train), or set train.strategy=single"
            )
        if train.strategy == "single" and D.group_size(group=group) > 1:
            raise ValueError(
                f"train.strategy=single runs one trainer process, the trainer group has "
                f"{D.group_size(group=group)}; use fsdp2 or deepspeed"
            )
        if train.loss.position_weighting == "dpace" and train.grad_accum > 1:
            # the recipe refuses it too; a library caller's TrainConfig bypasses that check
            raise InputError(
                f"train.grad_accum={train.grad_accum} with train.loss.position_weighting=dpace: "
                "D-PACE weights depend on the draft's own acceptance, so the step's weight sum is "
                "known only after every micro-batch's forward, and each micro-batch would be "
                "normalised alone (a loss and gradient about grad_accum times the step's); use "
                "position_weighting exp, or grad_accum 1 with larger micro-batches"
            )
        self.group = group
        self.rank = D.group_rank(group=group)
        self.world = D.group_size(group=group)
        self.is_main = self.rank == 0
        self.device = _pick_device(train.device)
        if self.device.type == "cpu":
            torch.set_num_threads(train.num_threads)
        self.bf16 = train.dtype == "bfloat16"
        self.model_config = model_config
        self.recipe_yaml = recipe_yaml

        self.model, self.optimizer, self.engine = self._build(model_config, embeddings)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.reduce_sum = D.reduce_sum_fn(group=group)
        self.objective = train.loss.model_dump()
        self.step = 0
        self._resume_checked = False  # resume() looked at the run's checkpoints (fit() checks otherwise)
        self.skipped_steps = 0
        self.consumed_ids: list[str] = []
        self.consumed_tokens: list[int] = []  # each consumed sample's, for the producers' balance
        # ids of conversations their producer dropped (too few supervised tokens, or special-token
        # text in a reply), recorded with the sample that told of them: a resumed producer
        # counts them as consumed
        self.dropped_ids: list[str] = []
        self.resumed: ResumeInfo | None = None
        self._output_dir_checked = False
        self._segment = 0  # this fit()'s number in run.json's segments (trainer rank 0)
        # Written when training starts, after resume() accepted the run directory: a rerun it
        # refuses (another trainer count, strategy or draft) leaves the run's records as they were.
        self._run_details = {
            "strategy": train.strategy, "trainer_ranks": self.world, "device": str(self.device),
            "dtype": train.dtype, "trainable_parameters": self.num_trainable,
            "model_config": model_config.to_dict(), **(run_details or {}),
        }

    def _build(self, model_config: DSparkConfig, embeddings):
        """The draft (same initial weights on every rank), placed and wrapped for the
        strategy, and AdamW over its trainable parameters only (never the frozen
        embedding and lm_head)."""
        train, group = self.train, self.group
        model = DSparkDraft(model_config)
        model.init_weights(seed=train.seed)
        model.load_target_embeddings(*embeddings)
        if self._init_draft is not None:  # before sharding: every rank holds the whole draft
            message = self._init_draft(model)
            if self.rank == 0:
                write_line(f"[trainer] {message}")
        self.num_trainable = count_parameters(model, with_embeddings=False)  # before sharding
        model.to(self.device)
        if self.bf16:
            # Frozen, so no fp32 master copy is needed: bf16 avoids casting the
            # vocabulary-sized matrices on every autocast matmul (fsdp2 leaves them unsharded).
            model.embed_tokens.to(torch.bfloat16)
            model.lm_head.to(torch.bfloat16)
        if train.strategy == "fsdp2":
            mesh = D.device_mesh(group=group, device_type=self.device.type)
            D.shard_fsdp2(model=model, mesh=mesh,
                          param_dtype=torch.bfloat16 if self.bf16 else torch.float32)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=lr_at(0, train=train),
            betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
            weight_decay=train.weight_decay,
            # One fused kernel per step on plain tensors; FSDP2/DeepSpeed keep their default.
            fused=True if train.strategy == "single" else None,
        )
        engine = None
        if train.strategy == "deepspeed":
            config = D.deepspeed_config(zero_stage=train.zero_stage, bf16=self.bf16,
                                        max_grad_norm=train.max_grad_norm)
            # under bf16 DeepSpeed casts the module to bf16 and builds its fp32 masters from
            # those copies: the initial weights are put back into the masters exactly
            initial = ({id(p): p.detach().to("cpu", torch.float32, copy=True)
                        for p in model.parameters() if p.requires_grad} if self.bf16 else {})
            engine, optimizer = D.init_deepspeed(model=model, optimizer=optimizer, group=group,
                                                 config=config)
            if initial:
                D.set_deepspeed_masters(model, initial)
        return model, optimizer, engine

    # -- resume ------------------------------------------------------------------------

    def resume(self) -> ResumeInfo | None:
        """Load the checkpoint ``train.resume`` selects (``auto``: newest complete one), if any."""
        self._check_shared_output_dir()
        self._claim_output_dir()
        path = self._find_resume(self.train.resume)
        if path is None:
            return None
        # the target's embedding and lm_head as its rank sent them for this segment: a checkpoint
        # holds the earlier segment's (another revision of the target, another dtype)
        with self._frozen_gathered(modifier=False):
            sent = {name: p.detach().to("cpu", copy=True) for name, p in self._frozen()}
        state = ckpt.load_checkpoint(path=Path(path), strategy=self.train.strategy, model=self.model,
                                     optimizer=self.optimizer, engine=self.engine, group=self.group,
                                     model_config=self.model_config.to_dict())
        with self._frozen_gathered(modifier=True), torch.no_grad():
            for name, p in self._frozen():
                p.copy_(sent.pop(name))
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        per_rank = state["consumed_ids"]
        self.consumed_ids = list(per_rank[self.rank])
        # consumed_tokens, dropped_ids and extra_per_rank are absent from older checkpoints
        tokens = state.get("consumed_tokens", [[None] * len(ids) for ids in per_rank])
        self.consumed_tokens = list(tokens[self.rank])
        dropped = state.get("dropped_ids", [[]] * self.world)
        self.dropped_ids = list(dropped[self.rank])
        extra = state.get("extra_per_rank", [{}] * self.world)[self.rank]
        everyone = {i: 0 for ids in dropped for i in ids}
        everyone.update((i, n) for ids, counts in zip(per_rank, tokens, strict=True)
                        for i, n in zip(ids, counts, strict=True))
        self.resumed = ResumeInfo(
            step=self.step, consumed_ids=list(self.consumed_ids), all_consumed=everyone, extra=extra,
            path=Path(path),
            schedule_change=self._schedule_change(state.get("schedule", {})),
            optimizer_change=self._restore_optimizer_settings(),
        )
        if self.resumed.optimizer_change and self.is_main:
            write_line(f"[trainer] note: {self.resumed.optimizer_change}")
        unfinished = ckpt.unfinished_saves(self.run_dir) if self.is_main else []
        if unfinished:  # said, not dropped without a word: the run resumes from an earlier step
            write_line(f"[trainer] note: {', '.join(p.name for p in unfinished)} in {unfinished[0].parent} "
                       f"{'is' if len(unfinished) == 1 else 'are'} left by a save that did not finish "
                       f"(never resumed from; removed at the next checkpoint): resuming from "
                       f"{Path(path).name}")
        saved_seed = state.get("seed")
        if saved_seed is not None and saved_seed != self.train.seed and self.is_main:
            # anchors are drawn from (seed, step, micro-step, rank): the rest of the run differs
            write_line(f"[trainer] note: train.seed {saved_seed} -> {self.train.seed}: the steps from "
                       f"{self.step + 1} on draw their anchors from the new seed, so this run no longer "
                       "repeats the checkpointed one's")
        changed = resume_note(Path(path), self.recipe_yaml, next_step=self.step + 1) if self.is_main else ""
        if changed:
            write_line(f"[trainer] note: {changed}")
        return self.resumed

    def _restore_optimizer_settings(self) -> str:
        """Put this recipe's weight_decay, betas and eps back into every param group, and under
        DeepSpeed its gradient clipping (loading a checkpoint replaces them with the checkpointed
        run's); what changed, or ""."""
        train = self.train
        wanted = {"weight_decay": train.weight_decay, "betas": (train.adam_beta1, train.adam_beta2),
                  "eps": train.adam_eps}
        before: dict[str, object] = {}
        for group in self.optimizer.param_groups:  # DeepSpeed's: its wrapped AdamW's groups
            for key, value in wanted.items():
                old = tuple(group[key]) if key == "betas" else group[key]
                if old != value:
                    before.setdefault(key, old)
                group[key] = value
        notes = []
        if before:
            changes = ", ".join(f"{key} {before[key]} -> {wanted[key]}" for key in before)
            notes.append(f"AdamW's {changes}: this recipe's values (train.weight_decay, adam_beta1, "
                         f"adam_beta2, adam_eps) replace the checkpointed run's from step {self.step + 1}")
        # DeepSpeed's ZeRO-1/2 optimizer clips by its own clip_grad, which its checkpoint restores
        # (ZeRO-3, fsdp2 and single clip by train.max_grad_norm at every step)
        clip = getattr(self.optimizer, "clip_grad", None) if self.engine is not None else None
        if clip is not None and clip != train.max_grad_norm:
            self.optimizer.clip_grad = train.max_grad_norm
            notes.append(f"gradient clipping {clip} -> {train.max_grad_norm}: this recipe's "
                         f"train.max_grad_norm replaces the checkpointed run's from step {self.step + 1}")
        return "; ".join(notes)

    def _check_shared_output_dir(self) -> None:
        """Refuse, before any step, a trainer group whose ranks do not share train.output_dir
        (node-local storage): rank 0 writes a marker there and every rank looks for it.
        Collective; once per trainer, nothing to do for one rank."""
        if self._output_dir_checked or self.world == 1:
            return
        self._output_dir_checked = True
        comm = self._comm_device()
        ranks = D.job_ranks(group=self.group)  # the names the launcher and the logs use
        name = f".shared-check-{uuid.uuid4().hex}"
        written = ""
        if self.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / name).write_text(f"written by trainer rank {ranks[0]}\n")
                written = str((self.run_dir / name).absolute())
            except OSError as exc:
                written = f"error:{exc}"
        written = D.broadcast_string(written, group=self.group, device=comm)
        if written.startswith("error:"):
            raise ckpt.CheckpointError(
                f"train.output_dir {self.run_dir}: trainer rank {ranks[0]} cannot write there ({written[6:]})")
        marker = (self.run_dir / Path(written).name).absolute()
        problem = "" if marker.is_file() else str(marker)
        problems = D.all_gather_strings([problem], group=self.group, device=comm)
        if self.is_main:
            (self.run_dir / name).unlink(missing_ok=True)
        missing = [(rank, p[0]) for rank, p in zip(ranks, problems, strict=True) if p[0]]
        if missing:
            unseen = "; ".join(f"trainer rank {rank} does not see {path}" for rank, path in missing)
            raise InputError(
                f"train.output_dir {self.run_dir} must be on storage shared by all trainer ranks "
                f"({unseen}, which trainer rank {ranks[0]} wrote as {written}); point train.output_dir at a "
                "shared file system")

    def _claim_output_dir(self) -> None:
        """Refuse a train.output_dir that another run is training in: trainer rank 0 holds its
        lock (:func:`checkpoint.claim_run_dir`) until fit() ends. Collective."""
        taken = ""
        if self.is_main:
            try:
                ckpt.claim_run_dir(self.run_dir)
            except ckpt.CheckpointError as exc:
                taken = str(exc)
        if self.world > 1:
            taken = D.broadcast_string(taken, group=self.group, device=self._comm_device())
        if taken:
            raise ckpt.CheckpointError(taken)

    def _schedule_settings(self) -> dict:
        """What the learning rate of every step depends on (stored with each checkpoint)."""
        train = self.train
        return {"lr": train.lr, "steps": train.steps, "warmup_ratio": train.warmup_ratio,
                "warmup_steps": warmup_steps(train), "min_lr_ratio": train.min_lr_ratio}

    def _schedule_change(self, saved: dict) -> str:
        """What a resume with another train.lr, steps, warmup_ratio or min_lr_ratio does to the
        learning rates from the next update on, or "" when the schedule continues as it was;
        where train.steps leaves no step to train, that instead."""
        if self.step >= self.train.steps:  # fit() trains nothing: no rate of a later step applies
            return (f"train.steps is {self.train.steps} and the checkpoint is at step {self.step}: "
                    "there is no step left to train; raise train.steps to train further")
        train, step = self.train, self.step + 1
        before, now = saved.get("lr"), lr_at(self.step, train=train)
        old, new = saved.get("settings"), self._schedule_settings()  # absent from older checkpoints
        schedule = (f"this recipe's schedule (train.lr {train.lr:g}, steps {train.steps}, warmup_ratio "
                    f"{train.warmup_ratio:g}, min_lr_ratio {train.min_lr_ratio:g})")
        if old and before is not None and self.step >= old["steps"]:  # an extended, finished run
            warmup, end = new["warmup_steps"], train.lr * train.min_lr_ratio
            if self.step < warmup:
                then = (f"within its warmup: the rate rises to {train.lr:.3e} at step {warmup} (the warmup "
                        f"goes on from step {step}, it does not start again), then follows the cosine")
            else:
                ended = f"its warmup ended at step {warmup}" if warmup else "it has none"
                then = f"with no warmup again ({ended}), and the rate follows the cosine"
            # steps are counted from 1 here, and step n trains at lr_at(n - 1): the cosine's end value
            # comes after the last step, which trains just above it
            finished = train.model_copy(update={key: old[key] for key in ("lr", "steps", "warmup_ratio",
                                                                        "min_lr_ratio") if key in old})
            return (f"the checkpointed run had finished its learning-rate schedule (train.steps "
                    f"{old['steps']}): its last step trained at {lr_at(old['steps'] - 1, train=finished):.3e}, "
                    f"its cosine ending at {before:.3e}; under {schedule} step {step} trains at {now:.3e}, "
                    f"{then} down to {lr_at(train.steps - 1, train=train):.3e} at step {train.steps}, its "
                    f"last (the cosine ends at {end:.3e})")
        if before is not None and not math.isclose(before, now, rel_tol=1e-9, abs_tol=0.0):
            return (f"the learning rate of step {step} is {now:.3e} under {schedule}, where the "
                    f"checkpointed run's would have been {before:.3e}; training continues on the new schedule")
        if not old or all(old.get(key) == new[key] for key in ("lr", "steps", "warmup_steps", "min_lr_ratio")):
            return ""
        changed = ", ".join(f"train.{key} {old.get(key)} -> {new[key]}"
                            for key in ("lr", "steps", "warmup_ratio", "min_lr_ratio") if old.get(key) != new[key])
        return (f"this recipe's learning-rate schedule differs from the checkpointed run's ({changed}): "
                f"step {step} keeps the learning rate {now:.3e}, the steps after it follow "
                "the new schedule")

    # -- one optimizer step ------------------------------------------------------------

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _autocast(self):
        if self.train.strategy == "single" and self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _prepare(self, samples: list[Sample], micro: int):
        """A micro-batch collated, with its anchors: drawn from a host copy of the loss mask
        (one small copy, not a sync per sequence when the batch arrived on the GPU)."""
        batch = collate(samples)
        generator = torch.Generator().manual_seed(
            anchor_seed(seed=self.train.seed, step=self.step, micro_step=micro, rank=self.rank))
        anchors, anchor_valid = sample_anchors(batch.loss_mask.cpu(), self.train.num_anchors, generator)
        return batch, anchors.to(batch.loss_mask.device), anchor_valid.to(batch.loss_mask.device)

    def _step_denominator(self, prepared) -> torch.Tensor | None:
        """The objective's weight sum over every micro-batch of this step and every trainer
        rank, so that accumulated micro-batches weigh each supervised slot alike (the
        contract's sums, not a mean of per-micro-batch means). Exp weights depend only on
        which slots are supervised, so it is known before any forward: one all-reduce per
        step. D-PACE weights need the forward; the recipe and __init__ refuse them with accumulation,
        and each micro-batch's forward sums them over the ranks instead (``None``)."""
        loss = self.train.loss
        if loss.position_weighting != "exp":
            return None
        total = torch.zeros((), dtype=torch.float32, device=self._comm_device())
        for batch, anchors, anchor_valid in prepared:
            valid = build_layout(batch.input_ids, batch.loss_mask, anchors, anchor_valid,
                                 self.model_config.block_size).valid
            total += exp_weights(valid, loss.decay).sum().to(total.device)
        D.all_reduce(total, group=self.group)
        return total.clamp(min=1e-6).to(self.device)

    def _micro_step(self, prepared, micro: int, sums: torch.Tensor, denominator: torch.Tensor | None,
                    *, counted: bool = True) -> None:
        """Forward + backward of one micro-batch; adds its metrics (a non-finite loss as a
        flag) to ``sums``; its tokens only where ``counted`` (not a filler's).

        Nothing here waits for the device: the non-finite flag stays a device tensor
        until the optimizer step reads ``sums``.
        """
        batch, anchors, anchor_valid = prepared
        batch = batch.to(self.device)
        model = self.engine if self.engine is not None else self.model
        with self._autocast():
            out = model(batch.input_ids, batch.loss_mask, batch.aux, batch.final,
                        anchors.to(self.device), anchor_valid.to(self.device),
                        objective=self.objective, reduce_sum=self.reduce_sum, denominator=denominator)
        out = D.as_objective_output(out)
        loss = out.loss.float()  # already divided by the whole step's weight sum
        nonfinite = (~torch.isfinite(loss)).float()
        scaled = loss * D.loss_scale(group=self.group)
        if self.engine is None:
            # Backward even when non-finite: every rank must join the gradient
            # collectives; the optimizer step then discards the gradients.
            scaled.backward()
        else:
            self._deepspeed_backward(scaled, sums[8] + nonfinite.to(sums.device),
                                     sums[7] + out.valid.sum().float().to(sums.device), micro)
        valid = out.valid.float()
        gamma = valid.shape[1]
        blocks = out.valid[:, 0]
        # masked by multiplication, not boolean indexing (a host sync on the GPU)
        tau_sum = ((1.0 + torch.cumprod(out.c_star, dim=-1).sum(-1)) * blocks).sum()
        # float64: the counts (tokens, slots) of a large step are exact past float32's 2^24
        parts = torch.cat([
            torch.stack([loss.detach(), out.ce, out.tv, out.bce, tau_sum.float(), blocks.sum().float(),
                         torch.tensor(float(batch.num_tokens if counted else 0), device=loss.device,
                                      dtype=torch.float64), valid.sum(),
                         nonfinite, out.kl if out.kl is not None else torch.zeros_like(out.ce)]).double(),
            (out.c_star * valid).sum(0).double(), valid.sum(0).double(),
        ]).to(sums.device)
        sums[: STEP_SCALARS + 2 * gamma] += parts.detach()

    def _deepspeed_backward(self, scaled: torch.Tensor, bad_so_far: torch.Tensor,
                            supervised_so_far: torch.Tensor, micro: int) -> None:
        """DeepSpeed backward of one micro-batch; ``bad_so_far`` (a device scalar) is > 0 when this
        rank's loss was not finite at this or an earlier micro-batch of the step,
        ``supervised_so_far`` counts this rank's supervised slots of the step so far.

        DeepSpeed reduces and accumulates gradients inside backward and cannot discard them
        afterwards; what it can do is drop an update whose gradient norm is not finite, and
        then clear everything it accumulated for the step (ZeRO-2 and ZeRO-3 alike). So every
        micro-batch runs its backward (every rank joins every collective), and at the last one
        the ranks agree whether any loss of the step was non-finite: if so, every rank
        backwards that micro-batch's loss times NaN, which makes the step's gradient
        non-finite everywhere, and :meth:`_optimizer_step` lets ``engine.step()`` drop it. A
        finite step is multiplied by exactly 1.0 (bit for bit the same). A step without any
        supervised slot on any rank is dropped the same way (its zero gradient would still
        move the weights through AdamW's moments and weight decay). The vote is one small
        all-reduce a step on a device tensor: nothing waits for the host.
        """
        last = micro == self.train.grad_accum - 1
        if last:
            votes = torch.stack([bad_so_far.detach().float(), supervised_so_far.detach().float()])
            D.all_reduce(votes, group=self.group, op=dist.ReduceOp.MAX)
            drop = (votes[0] > 0) | (votes[1] == 0)
            scaled = scaled * torch.where(drop, float("nan"), 1.0).to(scaled.device)
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(scaled, scale_wrt_gas=False)

    def _zero_grad(self) -> None:  # single and fsdp2; DeepSpeed clears its own in engine.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, sums: torch.Tensor) -> tuple[float, bool]:
        """Clip and step unless a rank saw a non-finite loss or the norm is not finite
        (then ``(norm, False)``: a skipped step), or no rank had a supervised slot (then
        ``(0.0, True)`` with no update: the gradient is zero, and AdamW would still move
        the weights by its moments and weight decay). ``sums`` are all ranks'."""
        loss_bad = sums[8].item() > 0
        unsupervised = not loss_bad and sums[7].item() == 0
        if self.engine is not None:
            # Always through DeepSpeed: it drops an update whose norm is not finite and clears
            # the step's accumulated gradients. A step with a non-finite loss or without any
            # supervised slot arrives here with a non-finite gradient (see _deepspeed_backward).
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
            if (loss_bad or unsupervised) and math.isfinite(norm):
                raise RuntimeError(
                    f"internal error at step {self.step + 1}: "
                    + ("a rank's loss was not finite" if loss_bad else "no rank had a supervised slot")
                    + f", but DeepSpeed reported a finite gradient norm ({norm}) and applied the update"
                )
            if unsupervised:
                return 0.0, True
            return (float("nan"), False) if loss_bad else (norm, math.isfinite(norm))
        if loss_bad:
            self._zero_grad()
            return float("nan"), False
        if unsupervised:
            self._zero_grad()
            return 0.0, True
        norm = D.clip_grad_norm(parameters=self.parameters, max_norm=self.train.max_grad_norm).item()
        if not math.isfinite(norm):
            self._zero_grad()
            return norm, False
        self.optimizer.step()
        self._zero_grad()
        return norm, True

    def _filler_sample(self) -> Sample:
        """A sample that supervises nothing (loss mask all False, zero features): what a rank
        short of micro-batches at the end of the data forwards and backwards so that it joins
        its step's collectives, adding nothing to the loss, the gradient or the counts."""
        cfg = self.model_config
        length = cfg.block_size + 1
        return Sample("(filler)", torch.zeros(length, dtype=torch.long, device=self.device),
                      torch.zeros(length, dtype=torch.bool, device=self.device),
                      torch.zeros(length, cfg.num_context_features, dtype=torch.bfloat16, device=self.device),
                      torch.zeros(length, cfg.target_hidden_size, dtype=torch.bfloat16, device=self.device))

    def _empty_sample(self, micro_batches: list[list[Sample]]) -> str | None:
        """Why the step's micro-batches cannot train (a sample without tokens), or None."""
        for micro, samples in enumerate(micro_batches):
            empty = next((s.sample_id for s in samples if s.num_tokens == 0), None)
            if empty is not None:
                return (f"sample {empty!r} (micro-batch {micro} of step {self.step + 1}) has no tokens: "
                        "nothing in it can be trained, and a checkpoint records each consumed sample "
                        "with its positive token count; leave empty samples out of the batches")
        return None

    def train_step(self, micro_batches: list[list[Sample]], *, wait_s: float = 0.0, fillers: int = 0) -> dict:
        """One optimizer step over ``grad_accum`` micro-batches (collective); returns its record.
        The last ``fillers`` micro-batches are :meth:`_filler_sample` ones: not consumed, not
        counted."""
        problem = self._empty_sample(micro_batches)  # before any collective of the step
        if problem is not None:  # it trained, then resume refused every checkpoint as corrupt
            raise InputError(problem)
        gamma = self.model_config.block_size
        comm = self._comm_device()
        compute_start = time.perf_counter()
        self._set_lr(lr_at(self.step, train=self.train))
        sums = torch.zeros(STEP_SCALARS + 2 * gamma, dtype=torch.float64, device=comm)
        prepared = [self._prepare(samples, micro) for micro, samples in enumerate(micro_batches)]
        denominator = self._step_denominator(prepared)
        real = len(micro_batches) - fillers
        for micro, batch in enumerate(prepared):
            self._micro_step(batch, micro, sums, denominator, counted=micro < real)
        D.all_reduce(sums, group=self.group)
        norm, applied = self._optimizer_step(sums)
        micro_batches = micro_batches[:real]
        step_ids = [s.sample_id for samples in micro_batches for s in samples]
        gathered = D.all_gather_strings(step_ids, group=self.group, device=comm)
        self.consumed_ids.extend(step_ids)
        self.consumed_tokens.extend(s.num_tokens for samples in micro_batches for s in samples)
        self.dropped_ids.extend(i for samples in micro_batches for s in samples
                                for i in s.provenance.get("dropped_ids", ()))
        if not applied:
            self.skipped_steps += 1
        self.step += 1
        compute_s = time.perf_counter() - compute_start
        return self._record(sums, gamma, norm, applied, gathered, wait_s, compute_s)

    # -- the loop ----------------------------------------------------------------------

    def _find_resume(self, mode: str, *, advice: str = "") -> str | None:
        """The checkpoint :func:`~draftforge.train.checkpoint.find_resume` selects for ``mode``
        (its files and draft shape checked), decided on the main rank and told to every rank;
        its refusal (followed by ``advice``) raised on every rank, so that no rank waits forever."""
        message = ""
        if self.is_main:
            try:
                found = ckpt.find_resume(self.run_dir, mode)
                if found is not None:  # its files and its draft shape, before any collective
                    ckpt.read_checked_state(found, model_config=self.model_config.to_dict(),
                                            strategy=self.train.strategy, trainer_ranks=self.world,
                                            zero_stage=self.train.zero_stage,
                                            dtype="bfloat16" if self.bf16 else "float32")
                message = "" if found is None else f"path:{found}"
            except (OSError, ValueError) as exc:
                message = f"error:{exc}{advice}"
        message = D.broadcast_string(message, group=self.group, device=self._comm_device())
        if message.startswith("error:"):
            raise ckpt.CheckpointError(message[len("error:"):])
        self._resume_checked = True
        return message[len("path:"):] or None

    def _check_fresh_start(self) -> None:
        """Refuse a fit() from step 0, resume() never called, in a folder holding another run's
        complete checkpoints (a library caller's; the job calls resume()): its checkpoints would
        sit below them, export and train.resume=auto would keep picking theirs, and pruning to
        keep_last would delete its own (``find_resume`` with ``never``)."""
        self._find_resume("never", advice="; to continue that run, call Trainer.resume() before fit()")

    def fit(
        self,
        batches: Iterable[list[Sample]],
        *,
        extra_state: Callable[[], dict] | None = None,
        on_step: Callable[[dict], None] | None = None,
        on_end: Callable[[FitResult], None] | None = None,
        on_interrupt: Callable[[int], None] | None = None,
    ) -> FitResult:
        """Train until ``train.steps`` optimizer steps or the end of ``batches``.

        ``extra_state()`` (JSON-serialisable, per rank) is stored in every
        checkpoint and comes back as :attr:`ResumeInfo.extra`. ``on_step(record)``
        runs on every rank after each step with that rank's record (the accounting hook);
        ``on_end(result)`` on every rank after the summary, while rank 0 still holds the run
        folder's lock, so that a next run in the folder cannot write between them;
        ``on_interrupt(step)`` on rank 0 where Ctrl-C or SIGTERM stops a segment that ran a step,
        after its interrupted summary, under the lock too (an error in it is printed, and the
        interrupt goes on). Call :meth:`resume` first to continue a run.
        """
        train = self.train
        self._check_shared_output_dir()
        self._claim_output_dir()
        if not self._resume_checked and self.step == 0:
            self._check_fresh_start()
        comm = self._comm_device()
        result = FitResult(step=self.step, steps_run=0, skipped_steps=self.skipped_steps,
                           stopped_reason="steps_done", checkpoint=None)
        log = progress = None
        logged: dict | None = None
        window: list[dict] = []
        first_slots: list[float] | None = None
        if self.is_main:
            self._segment = write_run_records(self.run_dir, recipe_yaml=self.recipe_yaml,
                                              details={**self._run_details, "start_step": self.step})
            log = MetricsLog(self.run_dir, train=train, recipe_yaml=self.recipe_yaml,
                             resume_step=self.step)
            progress = Progress(total=train.steps, initial=self.step)
            # A resumed run's summary covers the same last steps as an uninterrupted run's.
            earlier, log.earlier = log.earlier, []  # read once here, not held for the whole run
            applied = [r for r in earlier if not r.get("skipped") and "slot_acceptance" in r]
            # for a summary rebuilt from the log (a segment stopped before writing its own)
            logged = {key: sum(r.get(key) or 0 for r in earlier) for key in ("tokens", "wait_s", "compute_s")}
            del earlier
            window = applied[-train.log_interval:]
            # the first steps' acceptance: of the first step that supervised anything
            measured = [r for r in applied if r.get("block_tokens", 1)]
            first_slots = measured[0]["slot_acceptance"] if measured else None
        iterator = iter(batches)
        started = time.perf_counter()
        elapsed = 0.0  # to the end of the last step: the clock of the bar's and the summary's tokens/s
        total_tokens = 0
        bad_at_start = self.skipped_steps  # max_bad_steps counts this run's: a resumed run starts afresh
        self.model.train()
        try:
            while self.step < train.steps:
                wait_start = time.perf_counter()
                micro_batches = []
                for _ in range(train.grad_accum):
                    try:
                        micro_batches.append(next(iterator))
                    except StopIteration:
                        break
                # A step runs where some rank has a full one; ranks short of micro-batches at the
                # end of the data fill theirs with micro-batches that supervise nothing (every
                # rank joins every collective). Several target ranks can feed the trainers
                # unevenly (each producer balances only its own samples), and a step only where
                # every rank was full left the excess of the better-fed trainers untrained.
                # with a flag for a sample that cannot train: refused on every rank alike, where
                # the rank holding it alone would leave the others waiting in the step's collectives
                # (a last step no rank can fill trains nothing, so it refuses nothing either)
                problem = self._empty_sample(micro_batches)
                have = torch.tensor([float(len(micro_batches)), float(problem is not None)], device=comm)
                D.all_reduce(have, group=self.group, op=dist.ReduceOp.MAX)
                full = have[0].item() >= train.grad_accum
                if full and have[1].item():
                    raise InputError(problem or f"step {self.step + 1}: another trainer rank holds a sample "
                                     "without tokens, which cannot be trained (that rank names it)")
                # waiting here for another trainer's data is waiting for data too: counted as
                # neither busy nor idle, it left several trainers' idle shares short
                wait_s = time.perf_counter() - wait_start
                if not full:
                    result.stopped_reason = "data_exhausted"
                    left = torch.tensor([float(sum(len(batch) for batch in micro_batches))], device=comm)
                    D.all_reduce(left, group=self.group)  # every rank is here: none had a full step
                    result.untrained = int(left.item())
                    break
                fillers = train.grad_accum - len(micro_batches)
                micro_batches += [[self._filler_sample()] for _ in range(fillers)]
                record = self.train_step(micro_batches, wait_s=wait_s, fillers=fillers)
                elapsed = time.perf_counter() - started
                compute_s = record["compute_s"]
                applied = not record["skipped"]
                total_tokens += record["tokens"]
                result.losses.append(record["loss"])
                result.sample_ids.append(record["sample_ids"])
                result.wait_s.append(wait_s)
                result.compute_s.append(compute_s)
                result.steps_run += 1
                if first_slots is None and applied and record["block_tokens"]:
                    first_slots = record["slot_acceptance"]
                if applied:
                    window = (window + [record])[-train.log_interval:]
                if self.is_main:
                    log.log(record)
                    if result.steps_run == 1:  # an earlier segment's summary no longer describes the run
                        (self.run_dir / SUMMARY_FILE).unlink(missing_ok=True)
                        (self.run_dir / PLOT_FILE).unlink(missing_ok=True)  # nor its plot
                    progress.update(loss=record["loss"], tau=record["tau"], tokens=record["tokens"], elapsed_s=elapsed)
                    if self.step % train.log_interval == 0 or not applied:
                        progress.write(self._log_line(record))
                if on_step is not None:
                    on_step(record)
                bad = self.skipped_steps - bad_at_start
                stop = not applied and bad > train.max_bad_steps
                if stop:
                    result.stopped_reason = "max_bad_steps"
                    if self.is_main:
                        progress.write(
                            f"stopping: {bad} steps of this run had a non-finite loss or gradient "
                            f"(train.max_bad_steps={train.max_bad_steps}); the checkpoint holds the "
                            "last good weights. Check the data and lower train.lr."
                        )
                    break
                if self.step % train.checkpoint_interval == 0 and self.step < train.steps:
                    if log is not None:
                        log.sync()
                    result.checkpoint = self.save(extra_state=extra_state)
            done = ckpt.checkpoint_path(self.run_dir, self.step)
            if result.checkpoint == done or (result.steps_run == 0 and ckpt.is_complete(done)):
                result.checkpoint = done  # nothing new since that checkpoint
            else:
                if log is not None:
                    log.sync()
                result.checkpoint = self.save(extra_state=extra_state)
        except BaseException as stop:
            if self.is_main:
                try:
                    if isinstance(stop, KeyboardInterrupt) and result.steps_run:
                        if progress is not None:
                            progress.close()
                        self._stopped_summary(result, window, first_slots, total_tokens, elapsed, logged)
                        if on_interrupt is not None:
                            try:
                                on_interrupt(self.step)
                            except Exception as exc:  # the interrupt is what goes on
                                write_line(f"[trainer] warning: at the interrupt: {type(exc).__name__}: {exc}",
                                           sys.stderr)
                finally:
                    ckpt.release_run_dir(self.run_dir)
            raise
        finally:
            if progress is not None:
                progress.close()
            if log is not None:
                log.close()
        try:
            result.step = self.step
            result.skipped_steps = self.skipped_steps
            result.summary = self._summary(result, window, first_slots, total_tokens, elapsed, logged)
            if on_end is not None:
                on_end(result)
        finally:
            if self.is_main:  # another run may continue from here: its summary is written
                ckpt.release_run_dir(self.run_dir)
        return result

    def _record(self, sums, gamma, norm, applied, gathered, wait_s, compute_s) -> dict:
        values = sums.tolist()
        first = STEP_SCALARS
        slot_num, slot_den = values[first:first + gamma], values[first + gamma:first + 2 * gamma]
        tokens = int(values[6])
        # No supervised slot on any rank (no anchor had a supervised next token): the objective
        # is 0 by its clamped denominator, a loss measured on nothing; not-a-number like tau, so
        # that the log shows it and the summary's means leave the step out.
        measured = values[:4] + [values[9]] if values[7] else [float("nan")] * 5
        return {
            "step": self.step,
            "lr": lr_at(self.step - 1, train=self.train),
            **dict(zip(("loss", "ce", "tv", "bce", "kl"), measured, strict=True)),
            "tau": values[4] / values[5] if values[5] else float("nan"),
            "slot_acceptance": [n / d if d else float("nan") for n, d in zip(slot_num, slot_den, strict=True)],
            "tokens": tokens,
            "block_tokens": int(values[7]),
            "tokens_s": tokens / max(compute_s + wait_s, 1e-9),
            "grad_norm": norm,
            "skipped": not applied,
            "skipped_steps": self.skipped_steps,
            "wait_s": wait_s,
            "compute_s": compute_s,
            "sample_ids": [i for ids in gathered for i in ids],
        }

    @staticmethod
    def _log_line(record: dict) -> str:
        flag = "  SKIPPED (non-finite)" if record["skipped"] else ""
        return (f"step {record['step']:>6}  loss {record['loss']:.4f}  ce {record['ce']:.4f}  "
                f"tv {record['tv']:.4f}  bce {record['bce']:.4f}  "
                + (f"kl {record['kl']:.4f}  " if record.get("kl") and math.isfinite(record["kl"]) else "")
                + f"tau {record['tau']:.3f}  "
                f"lr {record['lr']:.2e}  |g| {record['grad_norm']:.3f}  "
                f"{record['tokens_s']:.0f} tok/s  wait {record['wait_s']:.2f}s{flag}")

    # -- checkpoints and the end of the run --------------------------------------------

    def save(self, *, extra_state: Callable[[], dict] | None = None) -> Path:
        """Write a checkpoint of the current step (collective over the trainer group)."""
        comm = self._comm_device()
        per_rank = D.all_gather_strings(self.consumed_ids, group=self.group, device=comm)
        tokens = D.all_gather_strings([json.dumps(self.consumed_tokens)], group=self.group, device=comm)
        dropped = D.all_gather_strings(self.dropped_ids, group=self.group, device=comm)
        extra = extra_state() if extra_state is not None else {}
        extras = D.all_gather_strings([json.dumps(extra)], group=self.group, device=comm)
        state = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "strategy": self.train.strategy,
            "schedule": {"next_step": self.step, "lr": lr_at(self.step, train=self.train),
                         "settings": self._schedule_settings()},
            "consumed_ids": per_rank,
            "consumed_tokens": [json.loads(t[0]) for t in tokens],
            "dropped_ids": dropped,
            "extra_per_rank": [json.loads(e[0]) for e in extras],
            "seed": self.train.seed,
        }
        # Sharded strategies also gather the full model once (kept on trainer rank 0, which
        # writes it), so that export needs no torchrun.
        full = self.full_state_dict(every_rank=False) if self.train.strategy != "single" else None
        return ckpt.save_checkpoint(
            run_dir=self.run_dir, step=self.step, strategy=self.train.strategy, model=self.model,
            optimizer=self.optimizer, engine=self.engine, state=state, group=self.group,
            keep_last=self.train.keep_last, model_config=self.model_config.to_dict(),
            full_state=full, recipe_yaml=self.recipe_yaml,
        )

    def full_state_dict(self, *, every_rank: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state on CPU (collective): the trainable weights are the
        fp32 masters under every strategy; the frozen embedding and lm_head are in the training
        dtype (bf16 under bf16: they have no master).

        Every trainer rank gets it, or with ``every_rank=False`` trainer rank 0 only (the
        others join the gather and return ``{}``: no full CPU copy on ranks that discard it).
        """
        keep = every_rank or self.is_main

        def on_cpu(state, *, fresh: bool = False) -> dict[str, torch.Tensor]:
            # live parameters are cloned; freshly gathered tensors need no second copy
            if not keep:
                return {}
            return {k: v.detach().cpu() if fresh else v.detach().cpu().clone() for k, v in state.items()}

        if self.train.strategy == "fsdp2":
            return D.full_state_fsdp2(self.model, keep=keep)
        if self.engine is not None:
            return self._deepspeed_full_state(on_cpu)
        return on_cpu(self.model.state_dict())

    def _frozen(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The frozen parameters (the target's embedding and lm_head), by name."""
        return [(name, p) for name, p in self.model.named_parameters() if not p.requires_grad]

    def _frozen_gathered(self, *, modifier: bool):
        """A context in which the frozen parameters are whole: under ZeRO-3 gathered (and, with
        ``modifier``, what rank 0 writes into them partitioned again); elsewhere they are."""
        if self.engine is None or self.train.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([p for _, p in self._frozen()],
                                                 modifier_rank=0 if modifier else None)

    def _deepspeed_full_state(self, on_cpu) -> dict[str, torch.Tensor]:
        """The frozen weights as the module holds them, the trainable ones from the optimizer's
        fp32 masters (under bf16 the module holds only bf16 copies of them). One collective
        per trainable parameter, in the same order on every rank (ZeRO-2 and ZeRO-3); each
        gathered master (a full fp32 tensor on the trainer's device) goes to the CPU, or is
        dropped on a rank that keeps nothing, before the next is gathered."""
        from deepspeed.utils import safe_get_full_fp32_param

        masters: dict[str, torch.Tensor | None] = {}
        by_id: dict[int, torch.Tensor | None] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            if id(param) not in by_id:
                full = safe_get_full_fp32_param(param)
                if full is None:
                    raise RuntimeError(f"internal error: DeepSpeed holds no fp32 master weight for {name}")
                by_id[id(param)] = on_cpu({name: full}, fresh=True).get(name)
                del full
            masters[name] = by_id[id(param)]
        with self._frozen_gathered(modifier=False):  # under ZeRO-3 the frozen weights are partitioned too
            state = on_cpu({k: v for k, v in self.model.state_dict().items() if k not in masters})
        state.update((name, master) for name, master in masters.items() if master is not None)
        return state

    def _summary(self, result: FitResult, window: list[dict], first_slots, tokens: int, elapsed: float,
                 logged: dict | None = None, *, draw: bool = True) -> dict:
        def mean(key):
            values = [r[key] for r in window if r[key] == r[key]]
            return sum(values) / len(values) if values else float("nan")

        gamma = self.model_config.block_size
        slots = []
        for k in range(gamma):
            values = [r["slot_acceptance"][k] for r in window if r["slot_acceptance"][k] == r["slot_acceptance"][k]]
            slots.append(sum(values) / len(values) if values else float("nan"))
        summary = {
            "step": self.step, "total_steps": self.train.steps, "steps_this_run": result.steps_run,
            "skipped_steps": self.skipped_steps, "stopped_reason": result.stopped_reason,
            "loss": mean("loss"), "tau": mean("tau"), "slot_acceptance": slots,
            # tokens_s: this run's tokens over its wall time from its start to the end of its last
            # step (the checkpoints saved between steps included, the final one not): what the
            # progress bar shows at that step, so the printed figures and summary.json agree. A
            # step's own rate (metrics.jsonl, the step lines) is its tokens over its wait and compute.
            "tokens": tokens, "elapsed_s": elapsed, "tokens_s": tokens / max(elapsed, 1e-9),
            "wait_s": sum(result.wait_s), "compute_s": sum(result.compute_s),
            "untrained_at_end": result.untrained,
            "checkpoint": str(result.checkpoint) if result.checkpoint else None,
            "trainer_ranks": self.world, "strategy": self.train.strategy,
        }
        # A segment that trained nothing keeps a summary that still describes the run (a rerun
        # of a finished run: its step, train.steps and stop); one that finds none (stopped
        # between its last checkpoint and the summary, or removed to draw a plot again) takes
        # the one the segment that wrote it recorded in run.json, whose wall time and tokens/s
        # no log holds; one that finds neither, or one of another step, train.steps or stop
        # (data that ran out at once under a longer recipe), writes it from the logged steps.
        # One that finds no plot (it failed, or was deleted) draws it from them, keeping the
        # summary with the figures of the steps it describes. A plot that cannot be drawn is
        # recorded in the summary (no_plot: why), so that a rerun of the finished run starts no
        # rank to try again (splitserve.launch). Every summary written is kept in run.json too.
        if not self.is_main:
            return summary
        held = restored = None
        if not result.steps_run:
            held = self._held_summary(summary)
            if held is None:
                held = restored = recorded_summary(self.run_dir, summary)
        write = held is None
        if write and not result.steps_run and logged and logged["tokens"]:
            # rebuilt: this process trained nothing, so the throughput is the logged steps' (every
            # segment's), over their own time; not zero tokens in the few milliseconds it ran
            summary.update(tokens=logged["tokens"], wait_s=logged["wait_s"], compute_s=logged["compute_s"],
                           elapsed_s=logged["wait_s"] + logged["compute_s"], rebuilt_from=METRICS_FILE)
            summary["tokens_s"] = summary["tokens"] / max(summary["elapsed_s"], 1e-9)
        if draw and (write or not (self.run_dir / PLOT_FILE).exists()):
            why = self._plot(window, slots, first_slots, summary["tau"])
            if write and why:
                summary[NO_PLOT] = why
            elif not write and (restored or held.get(NO_PLOT) != why):  # it says whether it is drawn now
                held.pop(NO_PLOT, None)
                write_summary(self.run_dir, {**held, **({NO_PLOT: why} if why else {})})
        elif restored:  # its plot is there now
            held.pop(NO_PLOT, None)
            write_summary(self.run_dir, held)
        if restored:
            write_line(f"[trainer] {SUMMARY_FILE} written again from {RUN_FILE}, where the segment that "
                       f"wrote it kept it (its wall time and tokens/s included)")
        if write:
            write_summary(self.run_dir, summary)
            record_segment_summary(self.run_dir, self._segment, summary)
            write_line(format_summary(summary))
        return summary

    def _stopped_summary(self, result: FitResult, window: list[dict], first_slots, tokens: int,
                         elapsed: float, logged: dict | None) -> None:
        """Trainer rank 0, a signal (Ctrl-C, SIGTERM) stopping fit() after this segment trained a
        step: the summary of its steps so far, stop ``interrupted``, as a stop of its own writes
        one. The first step removed the earlier segment's summary (it no longer described the
        run), which left the folder with none. Its checkpoint is the newest this run can resume
        from; the plot is left to a run that ends (the ranks have seconds to stop). A failure
        here is said, not raised over the interrupt."""
        result.stopped_reason = "interrupted"
        result.step, result.skipped_steps = self.step, self.skipped_steps
        if result.checkpoint is None and self.resumed is not None:
            result.checkpoint = self.resumed.path
        try:
            result.summary = self._summary(result, window, first_slots, tokens, elapsed, logged, draw=False)
        except Exception as exc:  # noqa: BLE001 - the interrupt is what stops the run
            write_line(f"[trainer] warning: no {SUMMARY_FILE} for the interrupted run ({type(exc).__name__}: "
                       f"{exc})")

    def _held_summary(self, summary: dict) -> dict | None:
        """The run folder's summary.json where it gives ``summary``'s step, train.steps and stop,
        else None."""
        written = read_summary(self.run_dir)  # none, or unreadable: written again
        holds = bool(written) and all(
            written.get(key) == summary[key] for key in ("step", "total_steps", "stopped_reason"))
        return written if holds else None

    def _plot(self, window: list[dict], slots: list[float], first_slots, tau: float) -> str | None:
        """Draw the run's plot; None, or why it could not be drawn (said here)."""
        from draftforge.train.plots import plot_slot_acceptance

        if not window:
            why = (f"no applied step with a per-slot acceptance, in this run or in {METRICS_FILE}, to "
                   "draw (every step was skipped as non-finite, or the log holds none)")
        else:
            try:
                plot_slot_acceptance(self.run_dir / PLOT_FILE, final=slots, first=first_slots, tau=tau)
                return None
            except Exception as exc:  # noqa: BLE001 - a trained run does not fail on its picture
                why = f"{type(exc).__name__}: {exc}"
        write_line(f"[trainer] warning: could not draw {self.run_dir / PLOT_FILE} ({why}); the figures are "
                   f"in {SUMMARY_FILE}, which records why as {NO_PLOT}; to try again, remove {SUMMARY_FILE} "
                   f"and rerun the same command (it comes back from {RUN_FILE}, which keeps it, and the plot "
                   f"is drawn from {METRICS_FILE})")
        return why
