"""``draftforge bench objective``: peak memory and time of one objective forward+backward.

Each path runs in a fresh child process. The figure reported is the peak
*added* by the objective: the child's peak resident memory (``VmHWM``, reset
when the inputs exist) minus its resident memory once the inputs and weights
exist (lm_head, Markov head, hidden states, target states). Not ``ru_maxrss``:
after ``exec`` it also holds the peak of the process that started the child.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import subprocess
import sys
import time

from draftforge import argtypes
from draftforge.errors import last_lines

GIB = 1024**3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) over from its current one, where the
    kernel allows it (Linux 4.0+); else the peak since exec, which is at least the baseline."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    """This process's own peak resident memory (VmHWM). Not ``ru_maxrss``: the kernel carries
    the peak of the process that forked (or vforked) this one into it at exec, so a child
    started by a larger process reads that process's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(args: argparse.Namespace) -> dict:
    import torch

    from draftforge.train.model import DSparkConfig, DSparkDraft
    from draftforge.train.objective import dspark_objective, w2_group_buffers, w2_group_rows

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    cfg = DSparkConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=1,
        num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128, head_dim=128,
        intermediate_size=128, target_hidden_size=args.hidden, num_target_layers=6,
        target_layer_ids=[1], block_size=args.block, mask_token_id=0, markov_rank=args.markov_rank,
        enable_confidence_head=True, confidence_head_with_markov=True,
    )
    with torch.device("meta"):
        model = DSparkDraft(cfg)
    # Materialise in place (no fp32 transient that would pollute the peak).
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    rows = args.anchors
    hidden = torch.empty(rows, args.block, args.hidden, dtype=dtype).normal_(generator=gen).requires_grad_()
    target_hidden = torch.empty(rows, args.block, args.hidden, dtype=dtype).normal_(generator=gen)
    labels = torch.randint(0, args.vocab, (rows, args.block), generator=gen)
    prev = torch.randint(0, args.vocab, (rows, args.block), generator=gen)
    valid = torch.ones(rows, args.block, dtype=torch.bool)
    # One block first: what the objective builds once and keeps between steps (the chunked
    # path's joined [lm_head | W2] head and, on a CPU, its packed lm_head) is built here, so
    # that the measured step adds what every step adds; its size is reported apart. So is, on
    # a CPU, W2's gradient group buffer, sized by a call's rows (one block builds none): it is
    # made here at the step's size, touched, as the first step of a training makes it.
    before_caches = _rss_bytes()
    kept_rows = w2_group_rows(args.vocab, torch.empty((), dtype=dtype).element_size(),
                              chunk_rows=args.chunk_blocks * args.block, total_rows=rows * args.block,
                              on_cpu=True) if args.path == "chunked" and args.markov_rank else 0
    if kept_rows:
        for buffer in w2_group_buffers(kept_rows, args.vocab, args.markov_rank, dtype):
            buffer.zero_()
    warm = dspark_objective(model, hidden[:1].detach().requires_grad_(), prev[:1], labels[:1], valid[:1],
                            target_hidden[:1], chunked=args.path == "chunked", chunk_blocks=args.chunk_blocks)
    warm.loss.backward()
    del warm
    model.zero_grad(set_to_none=True)
    _reset_peak_rss()
    baseline = _rss_bytes()
    start = time.perf_counter()
    out = dspark_objective(
        model, hidden, prev, labels, valid, target_hidden,
        chunked=args.path == "chunked", chunk_blocks=args.chunk_blocks,
    )
    out.loss.backward()
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    return {
        "path": args.path,
        "peak_added_gib": (peak - baseline) / GIB,
        "cached_gib": max(0, baseline - before_caches) / GIB,
        "baseline_gib": baseline / GIB,
        "seconds": seconds,
        "loss": out.loss.item(),
    }


def _failure(proc: subprocess.CompletedProcess) -> str:
    """Why a path's child failed: its exit status and last lines, or the signal that killed it
    (SIGKILL with no output is how the kernel's out-of-memory killer ends it)."""
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        why = f"killed by {name}{hint}"
    else:
        why = f"exit {proc.returncode}"
    tail = last_lines(proc.stderr, 3)
    return f"{why}: {tail}" if tail else why


def _hidden(text: str) -> int:
    value = argtypes.positive_int(text)
    if value % 128:
        raise argparse.ArgumentTypeError(f"must be a multiple of 128 (the head width), got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge bench objective",
        description="Peak memory and time of one objective forward+backward, chunked vs unchunked "
        "(defaults: Ling-3.0-flash scale).",
    )
    parser.add_argument("--vocab", type=argtypes.positive_int, default=157_184,
                        help="vocabulary size V (default 157,184, Ling-3.0-flash's)")
    parser.add_argument("--hidden", type=_hidden, default=2560,
                        help="hidden size H, a multiple of 128 (the head width; default 2560)")
    parser.add_argument("--anchors", type=argtypes.positive_int, default=512,
                        help="blocks (anchors) in the step (default 512)")
    parser.add_argument("--block", type=argtypes.block_size, default=8, help="block size (default 8)")
    parser.add_argument("--markov-rank", type=argtypes.positive_int, default=256,
                        help="Markov head rank r (default 256)")
    parser.add_argument("--chunk-blocks", type=argtypes.positive_int, default=16,
                        help="blocks per objective chunk (default 16)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="default bfloat16")
    parser.add_argument("--threads", type=argtypes.positive_int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--paths", type=argtypes.names(("chunked", "unchunked")), default="chunked,unchunked",
                        help="comma-separated subset of chunked,unchunked (default both)")
    parser.add_argument("--path", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.path:
        from draftforge.allocator import tune_malloc

        # started with python -m, not through the CLI: the allocator settings of every draftforge
        # process, a trainer rank's too, are this child's own to apply
        tune_malloc()
        print(json.dumps(_child(args)))
        return 0
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    threads = f"{args.threads} thread{'' if args.threads == 1 else 's'}"
    print(
        f"objective forward+backward: V={args.vocab} H={args.hidden} {args.anchors} anchors x "
        f"{args.block} slots, Markov rank {args.markov_rank}, {args.dtype}, {threads}",
        flush=True,
    )
    results = {}
    for path in args.paths:
        print(f"  running {path} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "draftforge.train.bench_objective", *base, "--path", path],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            print(f"  {path}: failed ({_failure(proc)})", flush=True)
            results[path] = None
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results[path] = result
        print(
            f"  {path:10s} peak added {result['peak_added_gib']:7.2f} GiB   time {result['seconds']:7.2f} s"
            f"   loss {result['loss']:.4f}   kept between steps {result['cached_gib']:5.2f} GiB",
            flush=True,
        )

    def fmt(path, key="peak_added_gib"):
        return "nan" if not results.get(path) else f"{results[path][key]:.2f}"

    # what each path keeps between steps too (the chunked path's joined and packed weights and W2's
    # gradient buffer, sized by the step's rows): a step's peak alone would flatter the chunked path
    print(f"objective_peak_gib={fmt('chunked')} unchunked_peak_gib={fmt('unchunked')} "
          f"objective_kept_gib={fmt('chunked', 'cached_gib')} unchunked_kept_gib={fmt('unchunked', 'cached_gib')}")
    if any(results.get(path) is None for path in args.paths):
        return 1  # a path failed (its error is above): the line's nan is not a measurement
    return 0


if __name__ == "__main__":
    sys.exit(main())
