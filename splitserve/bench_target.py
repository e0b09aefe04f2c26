"""``draftforge bench target``: tokens per second of the target's ``features`` and ``generate``.

Measures the transformers backend on this machine for each dtype and batch
size, prints a table, and ends with one machine-readable line:

    features_tok_s=<best> generate_tok_s=<best>
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from pydantic import ValidationError

from draftforge import argtypes
from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig, TargetConfig
from draftforge.splitserve.target import build_target

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "A train travels 180 km in 2.5 hours. What is its average speed? Show your work.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Describe three ways to reduce food waste at home.",
    "What are the main differences between a virus and a bacterium?",
    "Write a polite email asking a colleague to review a report by Friday.",
    "Summarise the water cycle in a paragraph.",
]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge bench target", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="smollm2-135m-instruct",
        help="registered name or local HF folder (default smollm2-135m-instruct)"
    )
    parser.add_argument(
        "--dtypes", type=argtypes.names(("bfloat16", "float32")), default="bfloat16,float32",
        help="comma-separated: bfloat16,float32 (default both)"
    )
    parser.add_argument("--batch-sizes", type=argtypes.positive_ints, default="1,8",
                        help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--seq-len", type=argtypes.positive_int, default=128,
                        help="tokens per sequence for features (default 128)")
    parser.add_argument("--new-tokens", type=argtypes.positive_int, default=32,
                        help="max new tokens for generate (default 32)")
    parser.add_argument(
        "--temperature", type=argtypes.non_negative_float, default=0.0,
        help="0 = greedy (default); above 0, sampling with the reference top-p/top-k "
        f"({GenerationConfig().top_p}/{GenerationConfig().top_k}) as regeneration does",
    )
    parser.add_argument(
        "--threads", type=argtypes.positive_int, default=TargetConfig().num_threads,
        help=f"intra-op threads (default {TargetConfig().num_threads})"
    )
    parser.add_argument("--layers", type=argtypes.non_negative_ints, default="1,14,27",
                        help="comma-separated auxiliary layer ids to capture (default 1,14,27)")
    parser.add_argument("--cache-dir", default=None,
                        help="draftforge conversion cache (default $DRAFTFORGE_CACHE, else "
                        "~/.cache/draftforge)")
    return parser


def _feature_batch(engine, batch_size: int, seq_len: int) -> torch.Tensor:
    """Chat-formatted real text, repeated to ``seq_len`` tokens per row."""
    rows = []
    for i in range(batch_size):
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
        rows.append((ids * (seq_len // len(ids) + 1))[:seq_len])
    return torch.tensor(rows)


def _time(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _bench_engine(
    engine, dtype: str, batch_sizes: list[int], seq_len: int, new_tokens: int, temperature: float
) -> list[tuple[str, str, int, int, float, float]]:
    """Rows (op, dtype, batch, tokens, seconds, tok/s) for one loaded engine."""
    engine.features(_feature_batch(engine, 1, 16))  # warm-up: kernel selection, allocator
    warm = GenerationConfig(temperature=0.0, max_new_tokens=2, batch_size=1)
    engine.generate([[{"role": "user", "content": "Hi"}]], warm)
    rows = []
    for batch_size in batch_sizes:
        input_ids = _feature_batch(engine, batch_size, seq_len)
        # best of two: the machines are shared and noisy
        seconds = min(_time(lambda ids=input_ids: engine.features(ids))[0] for _ in range(2))
        rows.append(
            ("features", dtype, batch_size, input_ids.numel(), seconds, input_ids.numel() / seconds)
        )
        print(f"  features b={batch_size}: {rows[-1][-1]:.0f} tok/s", file=sys.stderr, flush=True)

        settings = GenerationConfig(
            temperature=temperature, max_new_tokens=new_tokens, batch_size=batch_size
        )
        conversations = [
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(batch_size)
        ]
        seconds, replies = _time(
            lambda c=conversations, s=settings: engine.generate_token_ids(c, s)
        )
        tokens = sum(len(reply) for reply in replies)
        rows.append(("generate", dtype, batch_size, tokens, seconds, tokens / seconds))
        print(f"  generate b={batch_size}: {rows[-1][-1]:.0f} tok/s", file=sys.stderr, flush=True)
    return rows


def _target_config(args: argparse.Namespace, dtype: str) -> TargetConfig:
    """The target section the options describe; what it refuses (``--model random``, which
    needs a declared shape that only a recipe gives) is an error naming the option."""
    try:
        return TargetConfig(
            model=args.model, dtype=dtype, num_threads=args.threads, cache_dir=args.cache_dir
        )
    except ValidationError as exc:
        why = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
        raise InputError(f"--model {args.model}: {why}; bench target measures a real model: "
                         "a registered name or a local HF folder") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table and the summary line; returns the exit code."""
    args = _parse(argv)
    dtypes, batch_sizes = args.dtypes, args.batch_sizes
    layers = args.layers
    rows: list[tuple[str, str, int, int, float, float]] = []
    print(
        f"target {args.model}: features on {args.seq_len}-token rows, "
        f"{'greedy' if args.temperature <= 0 else f'sampled (temperature {args.temperature})'} generate of up to "
        f"{args.new_tokens} tokens, {args.threads} thread(s), torch {torch.__version__}",
        flush=True,
    )
    for dtype in dtypes:
        cfg = _target_config(args, dtype)
        try:
            load_s, engine = _time(lambda cfg=cfg: build_target(cfg, layers))
        except InputError as exc:  # it names the recipe's keys; these are the options that set them
            raise InputError(f"--model {args.model} --layers {','.join(map(str, layers))}: {exc}") from exc
        packed = getattr(engine, "packed_linears", 0)
        print(f"loaded {engine.name} in {dtype} in {load_s:.1f}s"
              + (f"; {packed} linear weights packed for oneDNN" if packed else ""), file=sys.stderr, flush=True)
        rows.extend(_bench_engine(engine, dtype, batch_sizes, args.seq_len, args.new_tokens,
                                  args.temperature))
        del engine  # free it before loading the next dtype

    print(f"{'op':<9} {'dtype':<9} {'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>9}")
    for op, dtype, batch_size, tokens, seconds, rate in rows:
        print(f"{op:<9} {dtype:<9} {batch_size:>5} {tokens:>7} {seconds:>8.2f} {rate:>9.1f}")
    best_features = max(r[-1] for r in rows if r[0] == "features")
    best_generate = max(r[-1] for r in rows if r[0] == "generate")
    print(f"features_tok_s={best_features:.1f} generate_tok_s={best_generate:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
