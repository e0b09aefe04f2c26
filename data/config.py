"""Recipe section owned by data/: where prompts come from and how samples are built."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from draftforge.argtypes import MAX_SEED
from draftforge.section import Section

# the data sets shipped with draftforge, named in data.train_files as builtin:NAME (their files
# are data/prompts/NAME.jsonl.gz: data.loading.BUILTINS)
BUILTIN_DATA_SETS = ("train-prompts",)


def unknown_builtin(*specs: str) -> str | None:
    """Why ``specs`` (data.train_files entries) name data sets that are not shipped; None
    where each is one, or a local path."""
    unknown = [spec for spec in specs if spec.startswith("builtin:")
               and spec.removeprefix("builtin:") not in BUILTIN_DATA_SETS]
    if not unknown:
        return None
    return (f"unknown builtin data set{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; valid: "
            + ", ".join(f"builtin:{name}" for name in BUILTIN_DATA_SETS))


class DataConfig(Section):
    """Prompts or conversations, and how they become token / loss-mask samples."""

    train_files: list[str] = Field(
        default_factory=lambda: ["builtin:train-prompts"],
        min_length=1,
        description="local jsonl/json/parquet files, or builtin:train-prompts",
    )
    format: Literal["auto", "messages", "sharegpt", "prompt"] = Field(
        default="auto",
        description="row form of train_files: messages (OpenAI), sharegpt (conversations), "
        "prompt (a string or list of user turns), each with an optional top-level 'system' "
        "string; auto picks per row by its keys",
    )
    max_length: int = Field(default=2048, gt=1, description="tokens per sample after truncation")
    min_loss_tokens: int = Field(
        default=8, ge=1, description="drop samples with fewer supervised tokens"
    )
    skip_invalid: bool = Field(
        default=False,
        description="count and skip rows that are no valid conversation (bad JSON, missing or "
        "mistyped fields); a conversation the chat template refuses still stops the run, "
        "naming its file and line",
    )
    regenerate: bool = Field(default=True, description="answer prompts with the target itself")
    regenerated_file: str | None = Field(
        default=None,
        description="jsonl written by 'draftforge data regenerate', read with data.regenerate "
        "true; default: <train.output_dir>/regenerated.jsonl",
    )
    num_samples: int | None = Field(default=None, gt=0, description="use the first N prompts")
    shuffle_seed: int = Field(default=0, ge=0, le=MAX_SEED, description="seeds the order of samples in every epoch")
    overlap_check: bool = Field(
        default=True, description="refuse training prompts that overlap the eval workloads"
    )
    overlap_threshold: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="near-duplicate score (character 5-gram Jaccard or containment) refused",
    )

    @field_validator("train_files")
    @classmethod
    def _no_empty_path(cls, value: list[str]) -> list[str]:
        if any(not path.strip() for path in value):
            raise ValueError(f"holds an empty path ({value!r}): give each file's path")
        unknown = unknown_builtin(*value)
        if unknown is not None:  # found here, at the recipe's line, not when the run loads its data
            raise ValueError(unknown)
        return value

    @field_validator("regenerated_file")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("is empty: give a .jsonl path, or leave it out for <train.output_dir>/regenerated.jsonl")
        return value
