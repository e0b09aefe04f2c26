"""``draftforge bench train [RECIPE] [key=value ...]``: the trainer step alone, on synthetic features.

Runs :meth:`Trainer.train_step` (strategy ``single``: forward, the fused
objective, backward, clipping, AdamW) on random features at the draft's
shapes and reports its achieved FLOP/s against the matmul peak of the step's
dtype (bf16 or float32) measured in the same process, on the same threads.

Shapes come from the recipe (``draft`` section, target shape); without a
recipe, the peer comparison of issue 4: hidden 576, 2 layers, 9/3 heads, FFN
1536, vocabulary 49,152, block 8, Markov rank 64, 5 target layers. Sequence
length and anchors per sequence are options (512 and 64).

Device: ``--device`` (default: the recipe's ``train.device``, where ``auto``
means the local CUDA device when there is one; the CPU without a recipe). On
CUDA the steps and the peak are timed with the device synchronised, the peak
uses 8192-wide bf16 matmuls, the synthetic samples sit on the GPU (where
samples received over NCCL arrive), and the report adds the step's peak allocated
memory next to the dry run's per-trainer-rank estimate for the same shapes
(strategy ``single``, one rank), so the estimate can be checked on a GPU.

Threads: the recipe's ``train.num_threads`` (what its trainer rank runs with), 2
without a recipe; ``--threads`` overrides. The peak is re-measured after every
timed step, and each step's MFU uses the higher of the
peaks measured just before and just after it, so a machine whose speed drifts
during the run (a shared VM) neither flatters nor penalises the ratio; the
reported MFU is the median over the timed steps.

FLOP count of one step (multiply-adds count 2), N = anchors x block query
tokens, S context positions, visible keys of block a = p_a + block:

* backbone matmuls: fc over the context (2 S F H), per layer q/o projections
  and the MLP on the N block tokens, k/v projections on the block and on the
  context;
* attention: QK^T and PV over the keys each query may see (context before its
  anchor plus its own block), not the masked-out part a dense kernel also computes;
* vocabulary: the draft's logits, base and Markov (2 N V (H + r));
* heads: the Markov head's gate (gated) or recurrence (rnn) projection and the
  confidence head, as the draft configures them.

Forward + backward = 3 x that forward count. For the backbone: input and
weight gradients, except ``fc``, whose input (the target's features) needs no
gradient: 2 x. Attention counts the useful work, the keys each query may see;
a dense SDPA mask makes the kernel compute scores for every key (about 3.6 x
that at the CPU recipe's shapes), which this count leaves out. For the vocabulary, what the fused objective executes is
exactly 3 x: draft and Markov logits, the target's logits (no backward), the
hidden-state and Markov-latent gradients and the W2 gradient (tests check it
against torch's FLOP counter). The last line is
``train_mfu=<ratio> step_tokens_s=<rate>`` with tokens = anchors x block per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from draftforge import argtypes
from draftforge.errors import InputError
from draftforge.precision import resolve_auto

PEER_SHAPES = dict(
    hidden=576, layers=2, heads=9, kv_heads=3, ffn=1536, vocab=49152, block=8, markov_rank=64,
    target_layers=30, num_aux_layers=5,
)


def _seq(text: str) -> int:
    value = argtypes.positive_int(text)
    if value < 2:  # else no anchor: a step without a block to train, and figures of nothing
        raise argparse.ArgumentTypeError(f"must be at least 2 (an anchor and the token it predicts), got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from draftforge.train.config import LossConfig

    parser = argparse.ArgumentParser(
        prog="draftforge bench train",
        description="Step time, tokens/s and MFU of one trainer step on synthetic features.",
    )
    parser.add_argument("recipe", nargs="?", help="recipe YAML (default: issue 4's peer shapes)")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="overrides of the recipe, e.g. train.num_threads=4 (with a recipe only)")
    parser.add_argument("--seq", type=_seq, default=512,
                        help="sequence length (default 512, issue 4's peer shape; not the recipe's data.max_length)")
    parser.add_argument("--anchors", type=argtypes.positive_int, default=64,
                        help="anchors per sequence (default 64, the peer shape; not the recipe's train.num_anchors)")
    parser.add_argument("--batch", type=argtypes.positive_int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--threads", type=argtypes.positive_int, default=None,
                        help="intra-op threads for the steps and the peak (default: the recipe's "
                        "train.num_threads; 2 without a recipe)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "auto"],
                        help="default: the recipe's train.dtype; auto without a recipe (bfloat16 "
                        "on CUDA or a CPU with native bf16 matmuls, else float32)")  # fmt: skip
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                        help="where the step runs (default: the recipe's train.device, auto = CUDA "
                        "when available; cpu without a recipe)")
    parser.add_argument("--steps", type=argtypes.positive_int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=argtypes.non_negative_int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--chunk-blocks", type=argtypes.positive_int, default=None,
                        help="blocks per objective chunk (default: the recipe's "
                        f"train.loss.chunk_blocks; {LossConfig().chunk_blocks} without a recipe)")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default=None,
                        help="torch.compile the objective's elementwise work (default: the recipe's "
                        f"train.loss.compile; {LossConfig().compile} without a recipe; auto = CUDA "
                        "only); compilation happens in the warm-up steps")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step")
    return parser


def _model_config(args):
    from draftforge.train.model import DSparkConfig

    if args.recipe is not None and "=" in args.recipe and not Path(args.recipe).exists():
        # the first positional is the recipe: an override alone lands there
        raise InputError(
            f"{args.recipe!r} is an override, and overrides apply to a recipe: give it first "
            "(draftforge bench train RECIPE key=value ...); without one the bench runs issue 4's "
            "peer shapes, which take no overrides")
    if args.recipe is None:
        p = PEER_SHAPES
        layer_ids = [1, 8, 15, 22, 28][: p["num_aux_layers"]]
        return DSparkConfig(
            vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
            num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
            intermediate_size=p["ffn"], target_hidden_size=p["hidden"],
            num_target_layers=p["target_layers"], target_layer_ids=layer_ids, block_size=p["block"],
            mask_token_id=16, markov_rank=p["markov_rank"], enable_confidence_head=True,
            confidence_head_with_markov=True, rope_theta=100000.0, max_position_embeddings=8192,
        ), None
    from draftforge.config import load_recipe
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    recipe = load_recipe(args.recipe, args.overrides)
    shape = resolve_target_shape(recipe.target)
    if shape is None:
        raise InputError(f"{args.recipe}: the target shape is unknown; declare target.shape")
    return build_dspark_config(recipe.draft, shape), recipe


def step_flops(cfg, *, seq: int, anchors: list[list[int]]) -> dict[str, float]:
    """Forward FLOPs of one step by part (see the module docstring), and the step's: x3 for
    forward + backward, except ``fc``, whose input (the target's features) needs no
    gradient, so its backward is the weight gradient alone (x2)."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    block = cfg.block_size
    num_seqs = len(anchors)
    queries = sum(len(a) for a in anchors) * block
    context = num_seqs * seq
    per_layer = (
        2 * queries * hidden * (q_width + 2 * kv_width)  # q, k, v on the block
        + 2 * context * hidden * 2 * kv_width  # k, v on the context
        + 2 * queries * q_width * hidden  # o_proj
        + 3 * 2 * queries * hidden * cfg.intermediate_size  # SwiGLU
    )
    visible = sum((p + block) * block for seq_anchors in anchors for p in seq_anchors)
    attention = cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * head_dim * visible
    fc = 2 * context * cfg.num_context_features * hidden
    backbone = fc + cfg.num_hidden_layers * per_layer
    vocab = 2 * queries * cfg.vocab_size * (hidden + cfg.markov_rank)
    heads = head_flops(cfg, queries)
    forward = backbone + attention + vocab + heads
    return {"backbone": backbone, "attention": attention, "vocab": vocab, "heads": heads,
            "forward": forward, "step": 3 * forward - fc}


def head_flops(cfg, queries: int) -> int:
    """Forward FLOPs of the heads' own projections on ``queries`` block tokens, as configured:
    the Markov head's ``gate_proj`` (gated) or ``joint_proj`` (rnn) (vanilla is a table
    look-up; W2 is in the vocabulary count), and the confidence head, which reads
    ``[h; W1[prev]]`` or ``h`` alone."""
    hidden, rank = cfg.hidden_size, cfg.markov_rank
    markov = 0
    if rank and cfg.markov_head_type == "gated":
        markov = 2 * queries * (hidden + rank) * rank
    elif rank and cfg.markov_head_type == "rnn":
        markov = 2 * queries * (2 * rank + hidden) * 3 * rank
    confidence = 0
    if cfg.enable_confidence_head:
        confidence = 2 * queries * (hidden + (rank if cfg.confidence_head_with_markov else 0))
    return markov + confidence


# the best of several: on an avx512_bf16 EPYC one thread ran 768 at about 218 GFLOP/s and 2048-3072
# at 198-205, while AMX's tiles peak on the large ones; the peak is the best any size reaches
CPU_PEAK_SIZES = (512, 768, 1024, 2048, 3072)
CUDA_PEAK_SIZES = (8192,)  # large enough to reach a data-centre GPU's bf16 matmul peak


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(*, dtype, device="cpu", sizes=None, repeats: int = 5) -> float:
    """FLOP/s of square matmuls in ``dtype`` on ``device`` (on the CPU, this process's
    threads): the median of ``repeats`` runs per size (robust to a lucky or a disturbed
    run), the best size. Random operands: a GPU multiplies zeros measurably faster."""
    import torch

    cuda = torch.device(device).type == "cuda"
    best = 0.0
    for n in sizes or (CUDA_PEAK_SIZES if cuda else CPU_PEAK_SIZES):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b
        synchronize(device)
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            synchronize(device)
            rates.append(2 * n**3 / (time.perf_counter() - start))
        best = max(best, statistics.median(rates))
        del a, b
    return best


def resolve_device(args, recipe) -> str:
    """``cpu`` or ``cuda``: ``--device``, else the recipe's ``train.device``, else cpu."""
    from draftforge.train.trainer import device_kind

    setting = args.device or (recipe.train.device if recipe is not None else "cpu")
    try:
        return device_kind(setting)
    except RuntimeError:
        raise InputError(
            f"device {setting!r} (--device, else the recipe's train.device), but "
            "torch sees no CUDA device; use --device cpu"
        ) from None


def estimate_for_bench(recipe, args, loss=None):
    """The dry run's trainer-rank estimate (strategy ``single``, one rank) at the bench's
    shapes: ``data.max_length`` = ``--seq``, ``train.num_anchors`` = ``--anchors``,
    ``split.token_budget`` = batch x seq, ``train.grad_accum`` = 1, ``train.device`` = the
    bench's, and ``train.loss`` = ``loss``, the objective's settings the steps ran with
    (:func:`_loss_config`; the recipe's when None), less the received queue (the bench has
    none). None without a recipe."""
    if recipe is None:
        return None
    from draftforge.splitserve.dry_run import Estimate, draft_parameter_counts, trainer_estimate

    cfg = recipe.model_copy(deep=True)
    if loss is not None:  # --chunk-blocks sets the objective chunk the estimate counts
        cfg.train.loss = loss
    cfg.data.max_length = args.seq
    cfg.train.num_anchors = args.anchors
    cfg.train.strategy = "single"
    cfg.train.dtype = args.dtype
    cfg.split.token_budget = args.batch * args.seq
    cfg.train.grad_accum = 1  # a bench step is one micro-batch
    # where the steps ran (resolved by then: cpu or cuda; a CUDA step has no CPU-only buffers)
    cfg.train.device = getattr(args, "device", None) or cfg.train.device
    with_emb, without_emb = draft_parameter_counts(cfg)
    estimate = trainer_estimate(cfg, with_emb, without_emb)
    return Estimate([(name, value) for name, value in estimate.items if not name.startswith("received queue")])


def _synthetic_samples(cfg, args, generator):
    import torch

    from draftforge.train.sample import Sample

    samples = []
    for index in range(args.batch):
        ids = torch.randint(0, cfg.vocab_size, (args.seq,), generator=generator)
        mask = torch.ones(args.seq, dtype=torch.bool)
        mask[: min(16, args.seq // 8)] = False  # a short unsupervised prompt
        aux = torch.randn(args.seq, cfg.num_context_features, generator=generator).to(torch.bfloat16)
        final = torch.randn(args.seq, cfg.target_hidden_size, generator=generator).to(torch.bfloat16)
        samples.append(Sample(f"bench{index}", ids, mask, aux, final))
    # Where a trainer rank gets them: over NCCL samples arrive on its GPU (over gloo, on
    # the CPU, and each step then also pays the host-to-device copy of the batch).
    return [Sample(s.sample_id, *(t.to(args.device) for t in (s.input_ids, s.loss_mask, s.aux, s.final)))
            for s in samples]


def _loss_config(recipe, args):
    """The objective's settings: the recipe's (or the defaults), then --chunk-blocks and --compile."""
    from draftforge.train.config import LossConfig

    loss = recipe.train.loss.model_dump() if recipe is not None else LossConfig().model_dump()
    if args.chunk_blocks:
        loss["chunk_blocks"] = args.chunk_blocks
    if args.compile is not None:
        loss["compile"] = {"on": True, "off": False}.get(args.compile, "auto")
    return LossConfig(**loss)


def train_steps(cfg, recipe, args):
    """Build a :class:`Trainer` (strategy ``single``) at ``cfg`` on synthetic features and run
    ``args.warmup + args.steps`` steps, yielding ``(seconds, loss, anchors)`` after each
    (anchors: that step's positions per sequence); with ``args.profile``, a profiled step
    follows. ``args`` holds this module's options (:func:`_parser`)."""
    import torch

    from draftforge.train.blocks import sample_anchors
    from draftforge.train.config import TrainConfig
    from draftforge.train.sample import collate
    from draftforge.train.trainer import Trainer, anchor_seed

    loss = _loss_config(recipe, args)
    train = TrainConfig(strategy="single", dtype=args.dtype, num_anchors=args.anchors,
                        steps=args.warmup + args.steps + 1, num_threads=args.threads,
                        device=args.device,
                        warmup_ratio=0.0, loss=loss, resume="never")
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02
    samples = _synthetic_samples(cfg, args, generator)
    # The trainer's anchors (for the FLOP count) come from the same host copy of the padded
    # loss mask it draws them from; no second batch stays on the device during the steps.
    loss_mask = collate(samples).loss_mask.cpu()
    with tempfile.TemporaryDirectory(prefix="draftforge-bench-train-") as run_dir:
        trainer = Trainer(model_config=cfg, train=train, embeddings=(embed, lm_head),
                          run_dir=Path(run_dir))
        for _ in range(args.warmup + args.steps):
            gen = torch.Generator().manual_seed(
                anchor_seed(seed=train.seed, step=trainer.step, micro_step=0, rank=0))
            chosen, valid = sample_anchors(loss_mask, args.anchors, gen)
            synchronize(trainer.device)
            start = time.perf_counter()
            record = trainer.train_step([samples])
            synchronize(trainer.device)
            seconds = time.perf_counter() - start
            yield seconds, record["loss"], [row[v].tolist() for row, v in zip(chosen, valid, strict=True)]
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            cuda = trainer.device.type == "cuda"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                trainer.train_step([samples])
                synchronize(trainer.device)
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=25))


def time_train_steps(cfg, recipe, args, *, dtype) -> list[dict]:
    """Run :func:`train_steps`, printing each; return one record per timed (post-warm-up) step:
    ``seconds``, ``anchors``, ``flops`` and ``peak``, the higher of the matmul peaks measured
    just before and just after the step (:func:`matmul_peak` runs between steps)."""
    import torch

    records: list[dict] = []
    cuda = args.device == "cuda"
    # The first timed step's "before" peak: after the last warm-up step (below), not before the
    # warm-up, the trainer's build and any compilation, minutes earlier on a drifting machine.
    peak_before = matmul_peak(dtype=dtype, device=args.device) if args.warmup == 0 else None
    if cuda:  # each step's own peak memory, not the matmul peak's operands
        torch.cuda.reset_peak_memory_stats()
    for index, (seconds, loss, step_anchors) in enumerate(train_steps(cfg, recipe, args)):
        timed = index >= args.warmup
        memory = torch.cuda.max_memory_allocated() if cuda else None
        note = ""
        if timed:
            peak_after = matmul_peak(dtype=dtype, device=args.device)
            flops = step_flops(cfg, seq=args.seq, anchors=step_anchors)["step"]
            peak = max(peak_before, peak_after)
            records.append({"seconds": seconds, "anchors": step_anchors, "flops": flops, "peak": peak,
                            "memory": memory})
            note = f"  {flops / seconds / 1e9:.0f} GFLOP/s, peak {peak / 1e9:.0f}, MFU {flops / seconds / peak:.3f}"
            peak_before = peak_after
        print(f"  step {index + 1}: {seconds:.3f} s  loss {loss:.4f}"
              f"{note if timed else '  (warm-up)'}", flush=True)
        if index == args.warmup - 1:
            peak_before = matmul_peak(dtype=dtype, device=args.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
    return records


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    import torch

    cfg, recipe = _model_config(args)
    args.device = resolve_device(args, recipe)
    if args.threads is None:
        args.threads = recipe.train.num_threads if recipe is not None else 2
    if args.dtype is None:
        args.dtype = recipe.train.dtype if recipe is not None else "auto"
    args.dtype = resolve_auto(args.dtype, args.device)
    torch.set_num_threads(args.threads)
    loss = _loss_config(recipe, args)
    print(
        f"bench train: H={cfg.hidden_size} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} FFN={cfg.intermediate_size} V={cfg.vocab_size} block={cfg.block_size} "
        f"Markov rank={cfg.markov_rank} aux layers={len(cfg.target_layer_ids)}; batch {args.batch} x "
        f"seq {args.seq}, up to {args.anchors} anchors a sequence (as its supervised positions allow), "
        f"{args.dtype}, {_where(args)}; objective "
        f"chunk {loss.chunk_blocks} blocks, compile {loss.compile} (auto = CUDA only)",
        flush=True,
    )
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    records = time_train_steps(cfg, recipe, args, dtype=dtype)
    step_s = statistics.median(r["seconds"] for r in records)
    mfu = statistics.median(r["flops"] / r["seconds"] / r["peak"] for r in records)
    last = records[-1]
    flops = step_flops(cfg, seq=args.seq, anchors=last["anchors"])
    tokens = sum(len(a) for a in last["anchors"]) * cfg.block_size
    tokens_s = tokens / step_s
    cold = ("; no warm-up: the first step's first-call costs and any compilation are in it"
            if args.warmup == 0 else "")
    print(f"step {step_s:.3f} s (median of {len(records)}{cold}), {tokens} block tokens -> {tokens_s:.0f} tokens/s")
    print(f"FLOPs per step {flops['step'] / 1e9:.1f} G (forward: backbone {flops['backbone'] / 1e9:.2f} G, "
          f"attention {flops['attention'] / 1e9:.2f} G, vocabulary {flops['vocab'] / 1e9:.2f} G, heads "
          f"{flops['heads'] / 1e9:.2f} G; x3, fc x2)")
    print(f"achieved {flops['step'] / step_s / 1e9:.1f} GFLOP/s at the median step, {args.dtype} matmul "
          f"peak {statistics.median(r['peak'] for r in records) / 1e9:.1f} GFLOP/s ({_where(args)}); "
          f"MFU is the median of the per-step ratios")
    if args.device == "cuda":
        _print_memory(recipe, args, max(r["memory"] for r in records))
    print(f"train_mfu={mfu:.3f} step_tokens_s={tokens_s:.1f}")
    return 0


def _where(args) -> str:
    if args.device == "cuda":
        import torch

        return f"on {torch.cuda.get_device_name()}"
    return f"{args.threads} thread{'' if args.threads == 1 else 's'}"


def _print_memory(recipe, args, peak_bytes: int) -> None:
    """The timed steps' peak allocated CUDA memory against the dry run's estimate."""
    from draftforge.splitserve.dry_run import GIB

    measured = peak_bytes / GIB
    line = f"CUDA memory: peak allocated {measured:.2f} GiB over the timed steps"
    estimate = estimate_for_bench(recipe, args, _loss_config(recipe, args))
    if estimate is not None:
        line += (f"; dry-run estimate for one trainer rank at these shapes (strategy single) "
                 f"{estimate.total / GIB:.2f} GiB, measured/estimate {peak_bytes / estimate.total:.2f}")
    print(line)


if __name__ == "__main__":
    sys.exit(main())
