"""``draftforge bench split RECIPE [key=value ...] [--steps N]``: is the split well balanced?

One job with the recipe's split (started like draftforge train, loopback only) runs three phases:

1. **producer alone**: each target rank computes its first samples (enough
   tokens for ``N`` steps of its trainers) without sending anything;
2. **consumer alone**: those samples are moved to the trainers (untimed) and
   each trainer runs ``N`` steps from memory (after one untimed warm-up step);
3. **both**: the normal stream, producer and trainers together, ``N + 1`` steps
   timed from the start (an empty pipeline, like phase 1: timing only after a fill
   step lets the window consume samples produced before it and overstate the rate).

Rates are tokens per second summed over the group's ranks. It prints
``end-to-end / min(producer, consumer)``; the last line is machine-readable::

    split_efficiency=<ratio> trainer_idle=<share> target_idle=<share>

The idle shares are those of phase 3 (trainer: waiting for samples; target:
waiting for credits), as defined in :mod:`draftforge.splitserve.accounting`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from draftforge.splitserve import transport as T

RESULT_ENV = "DRAFTFORGE_BENCH_OUT"


# --------------------------------------------------------------------------- ranks


def _token_goal(ctx, dests: int, steps: int) -> int:
    train = ctx.cfg.train
    return (steps + 1) * train.grad_accum * ctx.cfg.split.token_budget * dests


def bench_target_rank(ctx, engine, bench: dict) -> None:
    """The target rank's side of the three phases."""
    from draftforge.splitserve.producer import producer_alone, run_producer

    steps = int(bench["steps"])
    dests = ctx.topology.dests(ctx.rank)
    ctx.log(f"bench phase 1: producer alone ({steps + 1} steps' worth of tokens)")
    _warm_up(ctx, engine)
    samples, tokens, seconds = producer_alone(ctx.cfg, engine, topology=ctx.topology, rank=ctx.rank,
                                              min_tokens=_token_goal(ctx, len(dests), steps))
    stats = torch.tensor([tokens, int(seconds * 1e6)])
    for dest in dests:
        T.send_tensor(stats, dest, group=ctx.data_group, device=ctx.device)
    ctx.log(f"  {tokens} tokens in {seconds:.1f} s (whole chunks); moving samples to the trainers")
    for seq_no, sample in enumerate(samples):
        T.send_sample(sample.dest, sample.sample_id, sample.input_ids, sample.loss_mask,
                      sample.aux, sample.final, seq_no=seq_no, group=ctx.data_group,
                      device=ctx.device)
    for dest in dests:
        T.send_end(dest, group=ctx.data_group, device=ctx.device)
    del samples
    ctx.log("bench phase 3: producer and trainers together")
    summary = run_producer(ctx.cfg, engine, ctx.topology, ctx.rank, data_group=ctx.data_group,
                           ack_group=ctx.ack_group, device=ctx.device, log=ctx.log)
    ctx.log(f"  target idle {summary['idle_share']:.1%}")


def _warm_up(ctx, engine) -> None:
    """One small untimed generate and features call: first-call costs (kernel selection,
    allocator growth) belong to neither phase."""
    if ctx.cfg.data.regenerate:
        settings = ctx.cfg.target.generation.model_copy(update={"max_new_tokens": 4})
        engine.generate([[{"role": "user", "content": "Hello"}]], settings)
    ids = torch.full((1, 16), 1, dtype=torch.long, device=ctx.device)
    engine.features(ids)


def _train_steps(trainer, batches, steps: int, grad_accum: int) -> tuple[int, float]:
    """Run ``steps`` optimizer steps from ``batches``; (real tokens, seconds)."""
    tokens = 0
    begin = time.perf_counter()
    for _ in range(steps):
        micro = [next(batches) for _ in range(grad_accum)]
        tokens += sum(s.num_tokens for batch in micro for s in batch)
        trainer.train_step(micro)
    return tokens, time.perf_counter() - begin


def _cycle(batches: list):
    while True:
        yield from batches


def bench_trainer_rank(ctx, trainer, bench: dict) -> None:
    """A trainer rank's side of the three phases; the first trainer rank writes the result."""
    from draftforge.splitserve.accounting import ConsumerAccounting
    from draftforge.splitserve.consumer import ConsumerStream, stream_pack
    from draftforge.train.sample import Sample, pack

    cfg, steps = ctx.cfg, int(bench["steps"])
    grad_accum = cfg.train.grad_accum
    sources = ctx.topology.sources(ctx.rank)
    prod_tokens, prod_wall = 0.0, 0.0
    samples = []
    for src in sources:
        stats = T.recv_tensor(src, group=ctx.data_group, device=ctx.device).tolist()
        if ctx.topology.dests(src)[0] == ctx.rank:  # count each producer once
            prod_tokens += stats[0]
            prod_wall = max(prod_wall, stats[1] / 1e6)
        while (wire := T.recv_sample(src, group=ctx.data_group, device=ctx.device)) is not None:
            samples.append(Sample(wire.sample_id, wire.input_ids, wire.loss_mask, wire.aux,
                                  wire.final))
    if not samples:
        raise RuntimeError(f"trainer rank {ctx.rank} received no sample in phase 1; add data")
    ctx.log(f"bench phase 2: trainer alone from memory ({len(samples)} samples, {steps} steps)")
    memory = _cycle(pack(samples, cfg.split.token_budget))
    trainer.model.train()
    _train_steps(trainer, memory, 1, grad_accum)  # warm-up, untimed
    cons_tokens, cons_wall = _train_steps(trainer, memory, steps, grad_accum)
    del samples, memory

    for src in sources:
        T.send_hello(set(), src, group=ctx.ack_group)
    credits = max(1, cfg.split.max_in_flight // len(sources))
    accounting = ConsumerAccounting(world=ctx.world, num_target=len(cfg.split.target_ranks),
                                    credits=credits)
    receiver = T.SampleReceiver(sources, credits=credits, group=ctx.data_group,
                                device=ctx.device)
    stream = ConsumerStream(receiver, ack_group=ctx.ack_group, accounting=accounting,
                            heartbeat_s=cfg.split.peer_timeout_s / 4)
    batches = stream_pack(stream.samples(), cfg.split.token_budget)
    # Timed from an empty pipeline, as phase 1 is: leaving the fill step out would let the
    # timed steps eat samples produced before the window and read faster than the producer.
    wait_before = accounting.wait_s
    both_tokens, both_wall = _train_steps(trainer, batches, steps + 1, grad_accum)
    trainer_wait = accounting.wait_s - wait_before
    producer = accounting.snapshot()["producer"]
    stream.stop(timeout_s=cfg.split.peer_timeout_s)

    values = torch.tensor([prod_tokens, prod_wall, cons_tokens, cons_wall, both_tokens, both_wall,
                           trainer_wait, producer["idle_share"]], dtype=torch.float64)
    group = ctx.trainer_group if len(cfg.split.trainer_ranks) > 1 else None
    if group is not None:
        sums = values.clone()
        dist.all_reduce(sums, group=group)
        maxes = values.clone()
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        values = torch.stack([sums[0], maxes[1], sums[2], maxes[3], sums[4], maxes[5],
                              sums[6] / len(cfg.split.trainer_ranks), maxes[7]])
    if ctx.rank != cfg.split.trainer_ranks[0]:
        return
    p_tok, p_wall, c_tok, c_wall, e_tok, e_wall, wait, target_idle = values.tolist()
    result = {
        "steps": steps,
        "producer_tok_s": p_tok / max(p_wall, 1e-9),
        "consumer_tok_s": c_tok / max(c_wall, 1e-9),
        "end_to_end_tok_s": e_tok / max(e_wall, 1e-9),
        "trainer_idle": wait / max(e_wall, 1e-9),
        "target_idle": target_idle,
    }
    result["split_efficiency"] = result["end_to_end_tok_s"] / max(
        1e-9, min(result["producer_tok_s"], result["consumer_tok_s"])
    )
    out = os.environ.get(RESULT_ENV)
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)


# --------------------------------------------------------------------------- command


def report(result: dict) -> str:
    """The human-readable lines and the final machine-readable one."""
    faster = "producer" if result["producer_tok_s"] >= result["consumer_tok_s"] else "consumer"
    return "\n".join([
        f"producer alone : {result['producer_tok_s']:10.1f} tok/s",
        f"consumer alone : {result['consumer_tok_s']:10.1f} tok/s (from memory)",
        f"both together  : {result['end_to_end_tok_s']:10.1f} tok/s ({result['steps'] + 1} steps from an empty pipeline)",
        f"faster side    : {faster}",
        f"end-to-end / min(producer, consumer) = {result['split_efficiency']:.3f}",
        f"split_efficiency={result['split_efficiency']:.3f} "
        f"trainer_idle={result['trainer_idle']:.3f} target_idle={result['target_idle']:.3f}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """``draftforge bench split RECIPE [key=value ...] [--steps N]``."""
    parser = argparse.ArgumentParser(
        prog="draftforge bench split",
        description="Producer alone, consumer alone (fed from memory) and both together in one "
        "job of the recipe's split; prints end-to-end / min(producer, consumer).",
    )
    parser.add_argument("recipe", help="path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. split.max_in_flight=8")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per phase")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps <= 0:
        parser.error("--steps must be positive")

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import launch_env
    from draftforge.splitserve.multinode import rank_command
    from draftforge.splitserve.roles import check_split
    from draftforge.splitserve.supervisor import run_ranks

    with tempfile.TemporaryDirectory(prefix="draftforge-bench-split-") as tmp:
        overrides = [*args.overrides, f"train.output_dir={tmp}/run", "train.resume=never"]
        cfg = load_recipe(args.recipe, overrides)
        check_split(cfg)
        out = Path(tmp) / "result.json"
        command = rank_command(args.recipe, overrides)
        command += ["--bench-split", json.dumps({"steps": args.steps})]
        env = dict(launch_env(), **{RESULT_ENV: str(out)})
        print(f"draftforge bench split: {cfg.split.world_size} ranks of {' '.join(command[1:])}",
              file=sys.stderr, flush=True)
        status = run_ranks(command, nproc=cfg.split.world_size, env=env, prefix="draftforge bench split")
        if status != 0 or not out.is_file():
            print(f"draftforge bench split: the job failed (exit status {status})", file=sys.stderr)
            return status or 1
        result = json.loads(out.read_text())
    sys.stdout.write(report(result) + "\n")
    return 0
