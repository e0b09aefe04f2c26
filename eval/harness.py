"""Run the draft and the baselines on the same prompts and aggregate what users compare.

Per workload and method (``dspark``, ``ngram``, ``none``): mean acceptance
length over rounds, per-position conditional acceptance (accepted / reached),
tokens verified per round, wall time and tokens per second. Greedy runs are
checked lossless against plain decoding, prompt by prompt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

from draftforge.errors import InputError
from draftforge.eval.baselines import NgramProposer, NoDraft
from draftforge.eval.calibration import round_outcomes, round_samples
from draftforge.eval.config import NGRAM_MATCHES
from draftforge.eval.estimate import check_target_layers, train_time_estimate
from draftforge.eval.speculative import (
    DecodeResult,
    DecodeSettings,
    DraftProposer,
    TargetSession,
    check_lossless,
    speculative_decode,
    target_context,
)
from draftforge.eval.uncertainty import prompt_digest

METHODS = ("dspark", "ngram", "none")


def prompt_seed(seed: int, workload: str, index: int) -> int:
    """The generator seed of prompt ``index`` of ``workload`` under ``--seed seed``: the same for
    every method (their sampled draws are common random numbers, as paired comparisons want),
    and unrelated across prompts and across workloads. (``seed * 1_000_003 + index`` gave the
    prompts at one index of every workload the same stream: the same prompt there decoded the
    same, and the workloads' acceptance lengths were correlated, where the macro interval
    resamples each workload as independent of the others.)"""
    import hashlib

    digest = hashlib.sha256(f"{seed}\0{workload}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63, as torch takes


@dataclass
class EvalSettings:
    """Decoding settings shared by every method of one run."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # sampling only: 0 keeps every token
    top_p: float = 1.0  # sampling only: 1 keeps every token
    draft_sampling: str = "greedy"  # sampling only: the draft proposes its argmax (greedy) or draws (sample)
    verify: str = "full"
    threshold: float = 0.5
    seed: int = 0
    baselines: Sequence[str] = ("none", "ngram")
    ngram_max: int = 3
    ngram_match: str = "latest"  # which earlier match of the n-gram: latest or earliest (vLLM's)
    tie_tolerance: float = 1e-3
    estimate: bool = True
    estimate_anchors: int = 64

    def __post_init__(self) -> None:
        # a misspelt baseline would be left out of every report without a word (the CLI checks
        # --baselines; a library caller's tuple, or a bare string, is checked here)
        known = tuple(m for m in METHODS if m != "dspark")
        baselines = self.baselines
        if isinstance(baselines, str) or not isinstance(baselines, Collection) or not all(m in known for m in baselines):
            raise InputError(
                f"EvalSettings.baselines must be a sequence of names out of {', '.join(known)}, "
                f"got {self.baselines!r}"
            )
        # the rest as the recipe's eval section bounds them (a library caller bypasses it):
        # top_p 0 gave NaN probabilities, a misspelt verify or ngram_match a silent default
        wrong = [f"{name} must be {rule}, got {getattr(self, name)!r}" for name, rule, ok in (
            ("max_new_tokens", "an integer of at least 2", _whole(self.max_new_tokens, 2)),
            ("temperature", "a finite number of at least 0", _number(self.temperature, 0, math.inf)),
            ("top_k", "an integer of at least 0", _whole(self.top_k, 0)),
            ("top_p", "a number above 0 and at most 1", _number(self.top_p, 0, 1) and self.top_p > 0),
            ("draft_sampling", "'greedy' or 'sample'", self.draft_sampling in ("greedy", "sample")),
            ("verify", "'full' or 'threshold'", self.verify in ("full", "threshold")),
            ("threshold", "a number from 0 to 1", _number(self.threshold, 0, 1)),
            ("ngram_max", "an integer of at least 1", _whole(self.ngram_max, 1)),
            ("ngram_match", f"one of {NGRAM_MATCHES}", self.ngram_match in NGRAM_MATCHES),
            ("tie_tolerance", "a finite number of at least 0", _number(self.tie_tolerance, 0, math.inf)),
            ("estimate_anchors", "an integer of at least 1", _whole(self.estimate_anchors, 1)),
        ) if not ok]  # fmt: skip
        if wrong:
            raise InputError(f"EvalSettings: {'; '.join(wrong)}")


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value, low: float, high: float) -> bool:
    """A real number in ``[low, high]`` (finite unless ``high`` is infinite; NaN never)."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


@dataclass
class WorkloadResult:
    """Everything measured on one workload."""

    name: str
    num_prompts: int
    methods: dict[str, dict] = field(default_factory=dict)
    estimate: dict | None = None
    near_ties: int = 0
    confidence_samples: list[tuple[int, float, float]] = field(default_factory=list)
    confidence_prompts: list[int] = field(default_factory=list)  # each sample's prompt index
    # rounds whose every draft's outcome is known: (confidence logits, drafts accepted), and each
    # one's prompt index (--calibrate-rule survival)
    confidence_rounds: list[tuple[list[float], int]] = field(default_factory=list)
    confidence_round_prompts: list[int] = field(default_factory=list)
    prompt_digest: str = ""  # fingerprint of the prompts' token ids (paired comparisons across reports)


def summarize(results: Sequence[DecodeResult], block_size: int) -> dict:
    """Aggregate the rounds and timings of one method over a workload's prompts."""
    rounds = [r for res in results for r in res.rounds]
    tokens = sum(len(res.tokens) for res in results)
    wall = sum(res.wall_s for res in results)
    reached = [0] * block_size
    accepted = [0] * block_size
    for r in rounds:
        for k in range(min(r.num_verified, r.num_accepted + 1, block_size)):
            reached[k] += 1
            accepted[k] += int(k < r.num_accepted)
    return {
        "acceptance_length": (sum(r.acceptance_length for r in rounds) / len(rounds)) if rounds else float("nan"),
        "position_acceptance": [a / n if n else None for a, n in zip(accepted, reached, strict=True)],
        "position_reached": reached,
        "tokens_verified_per_round": (sum(r.tokens_run for r in rounds) / len(rounds)) if rounds else float("nan"),
        "drafts_proposed_per_round": (sum(r.num_proposed for r in rounds) / len(rounds)) if rounds else float("nan"),
        "rounds": len(rounds),
        # per prompt, for the bootstrap intervals (draftforge.eval.uncertainty)
        "prompt_rounds": [len(res.rounds) for res in results],
        "prompt_al_sum": [sum(r.acceptance_length for r in res.rounds) for res in results],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
    }


def check_prompt_lengths(prompts: Sequence[Sequence[int]], max_new_tokens: int, limit: int,
                         where: Callable[[int], str], *, option: str = "max_new_tokens",
                         whose: str = "draft's") -> None:
    """Refuse a prompt that, with ``max_new_tokens`` more, runs past ``limit`` positions: the
    draft's ``max_position_embeddings`` (it would draft at positions it never trained on) or the
    target's (``whose="target's"``: the output would come from past its context); ``where(index)``
    names the prompt, ``option`` the setting in the message. An empty prompt is refused too:
    decoding starts from the prefill of at least one token."""
    for index, ids in enumerate(prompts):
        if not len(ids):
            raise InputError(
                f"{where(index)}: an empty prompt (no token ids): decoding starts from the "
                "target's prefill of at least one token; leave the prompt out"
            )
        if len(ids) + max_new_tokens > limit:
            room = limit - len(ids)  # 2 new tokens at least: the prefill's, then one round's
            fix = (f"lower {option} to {room} or less, or leave the prompt out" if room >= 2 else
                   "the prompt alone leaves no room for a verification round: leave it out")
            raise InputError(
                f"{where(index)}: {len(ids)} prompt tokens + {option} {max_new_tokens} exceed the "
                f"{whose} max_position_embeddings {limit}; {fix}"
            )


def run_workload(
    name: str,
    prompts: Sequence[Sequence[int]],
    draft,
    target,
    settings: EvalSettings,
    *,
    eos_token_ids: Sequence[int] = (),
    progress: Callable[[str], None] = print,
) -> WorkloadResult:
    """Decode every prompt with the draft and the baselines; greedy outputs are checked lossless."""
    gamma = draft.config.block_size
    check_prompt_lengths(prompts, settings.max_new_tokens, draft.config.max_position_embeddings,
                         lambda index: f"workload {name!r}, prompt {index}")
    target_limit = target_context(target.model)
    if target_limit is not None:
        check_prompt_lengths(prompts, settings.max_new_tokens, target_limit,
                             lambda index: f"workload {name!r}, prompt {index}", whose="target's")
    # an id the target's embedding has no row for fails inside its forward with a bare
    # "index out of range" (a device-side assert on a GPU), naming no prompt
    from draftforge.splitserve.target import check_token_ids

    rows = target.model.get_input_embeddings().num_embeddings
    for index, ids in enumerate(prompts):
        check_token_ids(torch.as_tensor([list(ids)]), rows, f"workload {name!r}, prompt {index}")
    if settings.estimate:  # before minutes of decoding, not after
        check_target_layers(draft, target)
    decode = DecodeSettings(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        verify=settings.verify,
        threshold=settings.threshold,
        eos_token_ids=tuple(eos_token_ids),
    )
    # the baselines have no confidence head: a threshold applies to the draft alone
    settings_for = {m: decode if m == "dspark" else replace(decode, verify="full") for m in ("dspark", "ngram", "none")}
    with_features = TargetSession(target.model, draft.config.target_layer_ids)
    plain_session = TargetSession(target.model, None)
    proposers = {
        "dspark": (with_features, lambda g: DraftProposer(draft, temperature=settings.temperature, generator=g,
                                                          top_k=settings.top_k, top_p=settings.top_p,
                                                          draft_sampling=settings.draft_sampling)),
        "ngram": (plain_session, lambda g: NgramProposer(gamma, max_ngram=settings.ngram_max,
                                                         match=settings.ngram_match)),
        "none": (plain_session, lambda g: NoDraft()),
    }
    # Plain decoding always runs when greedy: it is the lossless reference (and the estimate's data).
    methods = ["none"] if settings.temperature <= 0 or "none" in settings.baselines else []
    methods += ["dspark"] + [m for m in ("ngram",) if m in settings.baselines]
    outputs: dict[str, list[DecodeResult]] = {m: [] for m in methods}
    result = WorkloadResult(name=name, num_prompts=len(prompts), prompt_digest=prompt_digest(prompts))
    if prompts:
        warm_up(proposers, methods, settings_for, prompts[0], gamma)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        for method in methods:
            session, make = proposers[method]
            generator = torch.Generator().manual_seed(prompt_seed(settings.seed, name, index))
            outputs[method].append(
                speculative_decode(session, prompt, make(generator), settings_for[method], generator=generator)
            )
        if settings.temperature <= 0:
            for method in methods:
                if method != "none":
                    result.near_ties += check_lossless(
                        outputs[method][-1], outputs["none"][-1],
                        tie_tolerance=settings.tie_tolerance, label=f"{name} prompt {index} ({method})",
                    )  # fmt: skip
        done = outputs["dspark"][-1]
        so_far = summarize(outputs["dspark"], gamma)["acceptance_length"]
        progress(
            f"  {name} {index + 1}/{len(prompts)}: {len(done.tokens)} tokens, "
            f"AL {done.mean_acceptance_length:.2f} this prompt, {so_far:.2f} so far "
            f"({time.perf_counter() - started:.1f}s)"
        )
    for method in methods:
        result.methods[method] = summarize(outputs[method], gamma)
    for index, res in enumerate(outputs["dspark"]):
        samples = round_samples(res.rounds)
        result.confidence_samples += samples
        result.confidence_prompts += [index] * len(samples)
        outcomes = round_outcomes(res.rounds, gamma)
        result.confidence_rounds += outcomes
        result.confidence_round_prompts += [index] * len(outcomes)
    if settings.estimate:
        reference = outputs["none"] if "none" in outputs else outputs["dspark"]
        result.estimate = train_time_estimate(
            draft, target, [(p, res.tokens) for p, res in zip(prompts, reference, strict=True)],
            max_anchors=settings.estimate_anchors, seed=settings.seed, max_ngram=settings.ngram_max,
            ngram_match=settings.ngram_match,
            temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
            draft_sampling=settings.draft_sampling, eos_token_ids=eos_token_ids,
        )  # fmt: skip
    return result


def warm_up(proposers: dict, methods: Sequence[str], settings_for: dict, prompt: Sequence[int],
            gamma: int) -> None:
    """One short decode per method, untimed and discarded: a process's first forward passes
    at new shapes pay one-off costs (kernel and primitive selection, the allocator growing)
    that would otherwise be charged to the wall time of whichever method decodes first.
    Fresh proposers and generators, so nothing carries over into the counted decodes."""
    for method in methods:
        session, make = proposers[method]
        generator = torch.Generator().manual_seed(0)
        full = settings_for[method]  # no longer than the counted decode: its positions checked
        short = replace(full, max_new_tokens=min(full.max_new_tokens, 2 * (gamma + 1)))
        speculative_decode(session, prompt, make(generator), short, generator=generator)


def macro(results: Sequence[WorkloadResult], method: str, key: str = "acceptance_length") -> float:
    """Unweighted mean of one metric over workloads (NaN when a workload lacks the method)."""
    values = [r.methods[method][key] for r in results if method in r.methods]
    return sum(values) / len(values) if values and len(values) == len(results) else float("nan")
