"""Recipe section owned by eval/: speculative-decoding evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftforge.argtypes import MAX_SEED
from draftforge.section import Section

# Which earlier occurrence of the suffix n-gram the n-gram baseline copies from.
NGRAM_MATCHES = ("latest", "earliest")

# The lossless check's default near-tie tolerance (how far below the target's own choice, in
# logits, a greedy divergence's token may lie and still count as numerical, not a bug), per
# target dtype. Batched
# verification and one-token decoding compute the same logits in another order; on
# SmolLM2 (CPU, 5 prompts, 41 positions each, the largest difference over the vocabulary)
# they differed by at most 1e-4 in float32 and by up to 0.94 in bfloat16, where a logit
# near 40 has a step of 0.25. An H200 run in bfloat16 stopped at a divergence with margin
# 0.125. Each default leaves headroom over its dtype's measured noise; in bfloat16 the
# check therefore only catches divergences where the target prefers its token by a logit.
TIE_TOLERANCES = {"float32": 1e-3, "bfloat16": 1.0}


def tie_tolerance_for(dtype: str, given: float | None) -> float:
    """``given`` when set, else the default near-tie tolerance for a target in ``dtype``."""
    return TIE_TOLERANCES[dtype] if given is None else given


class EvalConfig(Section):
    """Workloads and decoding settings for the lossless verifier."""

    workloads: list[Literal["humaneval", "mtbench", "gsm8k"]] = Field(
        default_factory=lambda: ["humaneval", "mtbench", "gsm8k"],
        min_length=1,
        description="held-out workloads, from the offline evaluation packages",
    )
    num_prompts: int | None = Field(default=None, gt=0, description="per workload; default all")
    temperature: float = Field(
        default=0.0,
        ge=0,
        description="0: greedy, every output checked identical to plain greedy decoding; above "
        "0: rejection sampling",
    )
    top_k: int = Field(
        default=0,
        ge=0,
        description="sampling only: draw from the top_k most likely tokens; 0 keeps every token",
    )
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="sampling only: then from the smallest set of those whose probability reaches "
        "top_p; 1 keeps every token. Both cut the target's distribution, and the draft's when "
        "draft_sampling is sample; target.generation holds the settings the training answers "
        "were sampled with",
    )
    draft_sampling: Literal["greedy", "sample"] = Field(
        default="greedy",
        description="sampling only: greedy, the draft proposes its most likely tokens and each is "
        "accepted with the target's probability of it (how llama.cpp verifies); sample, it draws "
        "them from its own distribution (cut alike), accepted with min(1, p_t/p_d) (how SGLang's "
        "DSPARK verifies sampled requests, from the draft's temperature-scaled distribution; "
        "some SGLang versions cut it by top-k and top-p as this does, others do not)",
    )
    max_new_tokens: int = Field(
        default=256, ge=2,
        description="tokens generated per prompt (the first comes from the prefill, so at least 2 for one verification round)",
    )
    verify: Literal["full", "threshold"] = Field(
        default="full",
        description="full: verify the whole block; threshold: cut it at the first slot whose "
        "confidence is below confidence_threshold (the contract's static rule; SGLang serves no "
        "static threshold: it ranks the cumulative product of the confidences against a token "
        "budget, so threshold-mode figures do not predict its served acceptance)",
    )
    confidence_threshold: float = Field(
        default=0.5, ge=0, le=1, description="the cut of verify threshold"
    )
    baselines: list[Literal["none", "ngram"]] = Field(
        default_factory=lambda: ["none", "ngram"],
        description="measured on the same prompts: none = the target alone, ngram = prompt lookup",
    )
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED, description="seeds sampling (temperature above 0) and the tau estimate's anchors"
    )
