"""Recipe section owned by eval/: speculative-decoding evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftforge.section import Section


class EvalConfig(Section):
    """Workloads and decoding settings for the lossless verifier."""

    workloads: list[Literal["humaneval", "mtbench", "gsm8k"]] = Field(
        default_factory=lambda: ["humaneval", "mtbench", "gsm8k"]
    )
    num_prompts: int | None = Field(default=None, gt=0, description="per workload; default all")
    temperature: float = Field(default=0.0, ge=0)
    max_new_tokens: int = Field(default=256, gt=0)
    verify: Literal["full", "threshold"] = "full"
    confidence_threshold: float = Field(default=0.5, ge=0, le=1)
    baselines: list[Literal["none", "ngram"]] = Field(default_factory=lambda: ["none", "ngram"])
    seed: int = 0
