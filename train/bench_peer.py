"""``draftforge bench peer``: SpecForge 0.2.0's DSpark trainer step, then draftforge's, back to back.

Issue 4 asks for draftforge's trainer step to run at least twice as many
tokens per second as the peer trainer's at the same shape on the same machine.
Timings on a shared CPU drift from minute to minute, so both steps are timed
in one process, one right after the other, and the ratio is what counts.

The shape is ``draftforge bench train``'s default (issue 4's peer shape:
hidden 576, 2 layers, 9/3 heads, FFN 1536, vocabulary 49,152, block 8,
Markov rank 64, 5 target layers, a confidence head that sees the Markov
embedding), 64 anchors on a 512-token sequence, bf16, 2 threads. The
SpecForge draft is built from the same :class:`DSparkConfig`, so the two
cannot disagree on a width.

The peer side is SpecForge's own code, unchanged: ``DSparkDraftModel`` (its
Qwen3-based DFlash backbone with the vanilla Markov head and the
acceptance-rate head), ``OnlineDSparkModel`` (anchors, the dense SDPA mask,
the chunked CE + L1 + confidence objective), ``DSparkTrainStrategy`` and
``TrainerCore`` for the step, and ``BF16Optimizer`` (AdamW over fp32 master
copies, gradient clipping). Only the training backend is a four-line local
one (``loss.backward()``, ``optimizer.step()``): what SpecForge's FSDP
backend does with an unwrapped module, without a process group.

Both sides get the same work: synthetic features of the same shapes with the same
loss mask (token ids, a loss mask with a short unsupervised prompt, auxiliary and
final hidden states, as ``bench train`` makes them; not the same values: both are
drawn from seed 0, but draftforge's side draws its embedding and lm_head first,
which changes nothing a step computes), the same anchors per sequence, block, vocabulary,
Markov rank, confidence head, position decay (``exp(-k / 4)``) and objective
chunk (``--chunk-blocks`` blocks, on both sides). Differences that remain,
each side's own design rather than a setting:

* attention: SpecForge runs ``sdpa`` (issue 4: its flex-attention path cannot
  run backward on CPU); draftforge runs its SDPA path too. Both use a dense boolean
  mask over context + block keys.
* optimizer: SpecForge keeps bf16 weights with fp32 master copies and steps
  torch's AdamW over the masters (clip norm 0.5, its default); draftforge keeps
  fp32 weights under bf16 autocast and steps fused AdamW (clip norm 1.0).
* objective backward: SpecForge checkpoints each objective chunk and
  recomputes it in backward; draftforge computes the chunk's gradients
  analytically in the forward.
* versions: SpecForge runs on draftforge's torch and transformers, not on its
  pins (torch 2.11.0, transformers 5.8.1); its code imports and runs on CPU
  without any shim.
* anchors: each side draws its own random anchors from the same loss mask
  (the same number; positions differ, the work does not, since both attend
  through a dense mask).

Each side runs ``--warmup`` untimed steps, then ``--steps`` timed ones:
SpecForge's first, then draftforge's, or with ``--interleave`` one of each in
turn, so that both sides see the same moments of a busy machine. With
``--rounds R`` that repeats R times (fresh models) and the medians are over
all timed steps of a side. The last line is
``peer_tokens_s=<x> draftforge_tokens_s=<y> speedup=<y/x>`` with tokens =
anchors x block per second of the median step.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

SPECFORGE_VERSION = "0.2.0"
#: The loss-weight decay over block positions: draftforge's default ``w_k = exp(-k / 4)``.
POSITION_DECAY = 4.0


def install_hint() -> str:
    """How to get SpecForge's source without installing it (or its torch pin) anywhere."""
    wheel = f"/tmp/specforge/specforge-{SPECFORGE_VERSION}-py3-none-any.whl"
    return (
        f"  pip download specforge=={SPECFORGE_VERSION} --no-deps -d /tmp/specforge\n"
        f"  python -m zipfile -e {wheel} /tmp/specforge/src\n"
        "  draftforge bench peer --specforge-path /tmp/specforge/src\n"
        "(never pip install it into draftforge's environment: it pins its own torch)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge bench peer",
        description="SpecForge's DSpark trainer step and draftforge's at the same shape, back to back: "
        "per-step time, tokens/s and the speedup.",
    )
    parser.add_argument("--specforge-path", metavar="DIR", default=None,
                        help="folder holding an unpacked specforge wheel (the one with specforge/ in it); "
                        "default: an importable specforge")
    parser.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    parser.add_argument("--anchors", type=int, default=64, help="anchors per sequence (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for both sides (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, per side (default 2)")
    parser.add_argument("--chunk-blocks", type=int, default=64,
                        help="objective chunk in blocks, on both sides (default 64)")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                        help="draftforge's train.loss.compile (torch.compile of its objective's "
                        "elementwise work; auto = CUDA only; default auto); SpecForge runs as it ships")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat SpecForge-then-draftforge this many times (medians over all timed "
                        "steps; default 1): on a shared machine both sides then see the same disturbances")
    parser.add_argument("--interleave", action="store_true",
                        help="alternate the two sides step by step instead of all of SpecForge's steps "
                        "first (a fairer ratio on a busy machine)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check the options; a bad value exits with status 2 and says which."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("seq", "anchors", "batch", "threads", "steps", "chunk_blocks", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.seq < 16:
        parser.error(f"--seq must be at least 16 (a prompt and supervised tokens), got {args.seq}")
    return args


def find_specforge(path: str | None) -> str | None:
    """Make SpecForge importable; return an error message, or None when it is.

    With ``path`` (an unpacked wheel), that folder must hold ``specforge/__init__.py``
    and goes first on ``sys.path``; without it, an installed ``specforge`` must exist.
    """
    if path is not None:
        root = Path(path).expanduser()
        if not (root / "specforge" / "__init__.py").is_file():
            return (f"--specforge-path {path}: no specforge/__init__.py under it; pass the folder the "
                    f"wheel was unpacked into. To get it:\n{install_hint()}")
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        importlib.invalidate_caches()
    if importlib.util.find_spec("specforge") is None:
        return f"SpecForge is not importable here and no --specforge-path was given. To get it:\n{install_hint()}"
    return None


def specforge_version() -> str:
    """The importable SpecForge's version, from its dist-info ("unknown" without one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specforge")
    except PackageNotFoundError:
        return "unknown"


def tokens_per_second(*, num_anchors: int, block_size: int, step_s: float) -> float:
    """Block tokens (anchors x block) one step trains, per second of step time."""
    if step_s <= 0:
        raise ValueError(f"step time must be positive, got {step_s}")
    return num_anchors * block_size / step_s


def summary_line(*, peer_tokens_s: float, draftforge_tokens_s: float) -> str:
    """The machine-readable last line."""
    return (f"peer_tokens_s={peer_tokens_s:.1f} draftforge_tokens_s={draftforge_tokens_s:.1f} "
            f"speedup={draftforge_tokens_s / peer_tokens_s:.2f}")


def specforge_draft_config(cfg):
    """SpecForge's draft config (a transformers ``Qwen3Config``) at the widths of ``cfg``
    (a draftforge :class:`DSparkConfig`), with sdpa attention."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

    config = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        layer_types=["full_attention"] * cfg.num_hidden_layers, tie_word_embeddings=False,
    )
    config.num_target_layers = cfg.num_target_layers
    config.block_size = cfg.block_size
    config.dflash_config = {
        "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
    }
    config._attn_implementation = "sdpa"
    return config


def build_specforge_step(cfg, args):
    """SpecForge's training model and its one-step function at ``cfg``'s shape, in bf16.

    Returns ``(model, step)``; ``step(batch)`` runs ``TrainerCore.train_step`` (forward,
    objective, backward, clipping, AdamW) on a SpecForge ``TrainBatch``.
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flash_attn is not found" from an unrelated draft module
        from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel
        from specforge.modeling.draft.dspark import DSparkDraftModel
        from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.backend import TrainingBackend
        from specforge.training.controller import TrainerCore
        from specforge.training.strategies.base import DSparkTrainStrategy

    config = specforge_draft_config(cfg)
    draft = DSparkDraftModel(config)
    target = TargetEmbeddingsAndHead(config)  # random frozen embeddings and lm_head
    target.requires_grad_(False)
    model = OnlineDSparkModel(
        draft_model=draft, target_lm_head=target.lm_head, target_embed_tokens=target.embed_tokens,
        mask_token_id=cfg.mask_token_id, block_size=cfg.block_size, attention_backend="sdpa",
        num_anchors=args.anchors, loss_decay_gamma=POSITION_DECAY, objective_chunk_blocks=args.chunk_blocks,
    ).to(dtype=torch.bfloat16)
    model.train()
    optimizer = BF16Optimizer(model.draft_model, lr=1e-4, total_steps=args.warmup + args.steps + 1,
                              warmup_ratio=0.0)

    class LocalBackend(TrainingBackend):
        """SpecForge's FSDP backend on an unwrapped module: backward, then its optimizer's step."""

        name = "local"

        def prepare_model(self, module):
            return module

        def backward(self, loss, *, is_boundary=True):
            loss.backward()

        def step(self):
            return optimizer.step()

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            del state

    core = TrainerCore(DSparkTrainStrategy(model), LocalBackend())
    return model, core.train_step


def specforge_batch(samples):
    """draftforge's synthetic :class:`Sample`s as the tensors SpecForge's DSpark step reads."""
    from specforge.runtime.contracts import TrainBatch

    from draftforge.train.sample import collate

    batch = collate(samples)
    return TrainBatch(sample_ids=list(batch.sample_ids), strategy="dspark", tensors={
        "input_ids": batch.input_ids, "loss_mask": batch.loss_mask.float(),
        "hidden_states": batch.aux, "target_last_hidden_states": batch.final,
    })


def anchors_per_step(loss_mask, num_anchors: int) -> int:
    """Anchors one step trains on both sides: per sequence, ``num_anchors`` or fewer when
    fewer positions p have loss_mask[p] and loss_mask[p + 1] (both sides' rule)."""
    candidates = (loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()).sum(dim=1)
    return int(candidates.clamp(max=num_anchors).sum())


def specforge_steps(cfg, args, batch):
    """Build SpecForge's step and run ``args.warmup + args.steps`` steps on ``batch``,
    yielding ``(seconds, loss)`` after each."""
    with warnings.catch_warnings():
        # Its LR scheduler reads get_lr() inside step(); torch warns about that each time.
        warnings.filterwarnings("ignore", message="To get the last learning rate")
        _, step = build_specforge_step(cfg, args)
        for _ in range(args.warmup + args.steps):
            start = time.perf_counter()
            result = step(batch)
            seconds = time.perf_counter() - start
            yield seconds, float(result.metrics["loss"])


def step_schedule(num_steps: int, *, interleave: bool) -> list[str]:
    """The order of one round's steps: all of SpecForge's then all of draftforge's, or
    (``interleave``) one of each in turn, so that both see the same moments of a busy machine."""
    if interleave:
        return ["SpecForge", "draftforge"] * num_steps
    return ["SpecForge"] * num_steps + ["draftforge"] * num_steps


def run_round(cfg, recipe, args, train_args, batch) -> tuple[list[float], list[float], int]:
    """One round: both sides' steps in :func:`step_schedule` order, each printed. Returns the
    timed seconds of SpecForge and of draftforge and the anchors draftforge trained per step."""
    from draftforge.train.bench_train import train_steps

    sides = {"SpecForge": specforge_steps(cfg, args, batch), "draftforge": train_steps(cfg, recipe, train_args)}
    timed: dict[str, list[float]] = {name: [] for name in sides}
    done = dict.fromkeys(sides, 0)
    trained_anchors = 0
    try:
        for name in step_schedule(args.warmup + args.steps, interleave=args.interleave):
            seconds, loss, *anchors = next(sides[name])  # draftforge's also say which anchors
            done[name] += 1
            warm_up = done[name] <= args.warmup
            if not warm_up:
                timed[name].append(seconds)
            if anchors:
                trained_anchors = sum(len(a) for a in anchors[0])
            print(f"  {name:<10} step {done[name]}: {seconds:.3f} s  loss {loss:.4f}"
                  f"{'  (warm-up)' if warm_up else ''}", flush=True)
    finally:
        for steps in sides.values():
            steps.close()
    return timed["SpecForge"], timed["draftforge"], trained_anchors


def _train_args(args) -> argparse.Namespace:
    """The same run as ``draftforge bench train`` options: peer shapes, bf16, no recipe."""
    from draftforge.train.bench_train import _parser as train_parser

    return train_parser().parse_args([
        "--seq", str(args.seq), "--anchors", str(args.anchors), "--batch", str(args.batch),
        "--threads", str(args.threads), "--dtype", "bfloat16", "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--chunk-blocks", str(args.chunk_blocks),
        "--compile", args.compile, "--device", "cpu",  # SpecForge's side runs on the CPU too
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = find_specforge(args.specforge_path)
    if problem is not None:
        sys.stderr.write(f"draftforge bench peer: {problem}\n")
        return 2
    import torch

    from draftforge.train.bench_train import _model_config, _synthetic_samples

    torch.set_num_threads(args.threads)
    train_args = _train_args(args)
    cfg, recipe = _model_config(train_args)
    found = specforge_version()
    print(
        f"bench peer: H={cfg.hidden_size} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} FFN={cfg.intermediate_size} V={cfg.vocab_size} block={cfg.block_size} "
        f"Markov rank={cfg.markov_rank} aux layers={len(cfg.target_layer_ids)}, confidence head with Markov; "
        f"batch {args.batch} x seq {args.seq}, {args.anchors} anchors, objective chunk {args.chunk_blocks} "
        f"blocks, bfloat16, {args.threads} threads; draftforge's objective compile: {args.compile}",
        flush=True,
    )
    print("not the same on the two sides (each side's own design): SpecForge keeps bf16 weights + fp32 "
          "AdamW masters and recomputes the objective chunk in backward; draftforge keeps fp32 weights "
          "under bf16 autocast with fused AdamW and analytic objective gradients; anchors are drawn by "
          "each side (same count), and so are the synthetic features' values (same shapes and loss "
          "mask)", flush=True)
    if found != SPECFORGE_VERSION:
        print(f"note: SpecForge {found} found; the issue's figure is for {SPECFORGE_VERSION}", flush=True)
    batch = specforge_batch(_synthetic_samples(cfg, train_args, torch.Generator().manual_seed(0)))
    num_anchors = anchors_per_step(batch.tensors["loss_mask"], args.anchors)
    peer_times: list[float] = []
    our_times: list[float] = []
    for round_index in range(args.rounds):
        order = "interleaved" if args.interleave else "SpecForge's steps, then draftforge's"
        print(f"round {round_index + 1} of {args.rounds} ({order}); SpecForge {found} with sdpa attention:",
              flush=True)
        peer, ours, trained = run_round(cfg, recipe, args, train_args, batch)
        peer_times += peer
        our_times += ours
        if trained != num_anchors:
            raise RuntimeError(f"draftforge trained {trained} anchors a step, SpecForge {num_anchors}: "
                               "the two sides did not do the same work")
    peer_s, ours_s = statistics.median(peer_times), statistics.median(our_times)
    peer_rate = tokens_per_second(num_anchors=num_anchors, block_size=cfg.block_size, step_s=peer_s)
    ours_rate = tokens_per_second(num_anchors=num_anchors, block_size=cfg.block_size, step_s=ours_s)
    tokens = num_anchors * cfg.block_size
    print(f"SpecForge   step {peer_s:.3f} s (median of {len(peer_times)}), {tokens} block tokens -> "
          f"{peer_rate:.0f} tokens/s")
    print(f"draftforge  step {ours_s:.3f} s (median of {len(our_times)}), {tokens} block tokens -> "
          f"{ours_rate:.0f} tokens/s")
    print(summary_line(peer_tokens_s=peer_rate, draftforge_tokens_s=ours_rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
