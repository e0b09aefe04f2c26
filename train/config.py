"""Recipe sections owned by train/: the draft's architecture and the training loop."""

from __future__ import annotations

import math
import os
from typing import Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from draftforge.argtypes import MAX_SEED
from draftforge.precision import resolve_auto
from draftforge.section import Section


class DraftConfig(Section):
    """The DSpark draft. Names match the exported config.json fields."""

    hidden_size: int = Field(
        default=576, gt=0, le=65536, description="the draft's width: the target's (it shares its embedding)"
    )
    num_hidden_layers: int = Field(default=1, gt=0, le=256, description="decoder layers of the draft")
    num_attention_heads: int = Field(default=8, gt=0, le=4096, description="query heads per layer")
    num_key_value_heads: int = Field(
        default=8, gt=0, le=4096, description="key/value heads per layer; divides num_attention_heads"
    )
    head_dim: int | None = Field(default=None, gt=0, le=4096, description="default: hidden_size / heads")
    intermediate_size: int = Field(default=1536, gt=0, le=1 << 20, description="MLP width of each layer")
    target_layer_ids: list[int] = Field(
        default_factory=lambda: [1, 8, 15, 22, 28],
        description="target layers whose outputs feed the draft (layer i = HF hidden_states[i + "
        "1]); each below the target's last layer",
    )
    block_size: int = Field(default=8, ge=2, le=256, description="draft tokens per block (gamma)")
    mask_token_id: int = Field(default=16, ge=0, description="an existing, unused target token id")
    markov_rank: int = Field(default=64, ge=0, le=65536, description="0 disables the Markov head (DFlash)")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        default="vanilla",
        description="vanilla: a rank-r table of next-token scores given the previous token; "
        "gated: the same, gated by the slot's state; rnn: a recurrent state over the drafted tokens",
    )
    enable_confidence_head: bool = Field(
        default=True, description="a per-slot acceptance estimate (used by eval.verify threshold)"
    )
    confidence_head_with_markov: bool = Field(
        default=True, description="the confidence head also reads the Markov embedding"
    )
    rope_theta: float | None = Field(default=None, gt=0, description="default: the target's")
    rms_norm_eps: float = Field(default=1e-6, gt=0, description="epsilon of the RMS norms")
    max_position_embeddings: int | None = Field(
        default=None,
        gt=0,
        description="longest position the draft serves (the export's max_position_embeddings, "
        "the bound on eval's prompts); default: the target's, from its config.json or "
        "target.shape; a recipe whose target gives none must set it (at least data.max_length)",
    )
    attention_backend: Literal["sdpa", "flex"] = Field(
        default="sdpa", description="sdpa: dense mask, CPU and GPU; flex: block mask, GPU"
    )

    @property
    def has_markov_table(self) -> bool:
        """A Markov head that is a W1/W2 table (vanilla or gated, rank > 0): the head
        ``train.markov_init: bigram`` fills."""
        return self.markov_rank > 0 and self.markov_head_type != "rnn"


class LossConfig(Section):
    """The acceptance-aware objective (contract section 2)."""

    ce_weight: float = Field(default=0.1, ge=0, description="weight of the cross-entropy term")
    tv_weight: float = Field(
        default=0.9, ge=0, description="weight of the L1 distance to the target's distribution"
    )
    bce_weight: float = Field(
        default=1.0, ge=0, description="weight of the confidence head's BCE against c*"
    )
    kl_weight: float = Field(
        default=0.0, ge=0,
        description="weight of KL(target || draft) per slot: cross-entropy against the target's "
        "whole next-token distribution instead of the sampled token (not in the reference "
        "objective; 0 turns it off and skips its computation)",
    )
    decay: float = Field(default=4.0, gt=0, description="w_k = exp(-k / decay)")
    position_weighting: Literal["exp", "dpace"] = Field(
        default="exp",
        description="exp: exp(-k / decay); dpace: the probability that slot k is reached, "
        "prod of c*_i for i < k",
    )
    chunk_blocks: int = Field(default=64, gt=0, description="blocks per objective chunk")
    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="torch.compile the objective's elementwise vocabulary work (one kernel "
        "instead of ~20 passes); auto: on CUDA only. On CPU it needs a C++ compiler and costs "
        "a few seconds of compilation per process",
    )


_EMPTY_ADVICE = {"output_dir": "give the run directory's path",
                 "resume": "give auto, never or a checkpoint's path"}


class TrainConfig(Section):
    """Optimisation, parallelism, checkpoints and logging."""

    strategy: Literal["fsdp2", "deepspeed", "single"] = Field(
        default="fsdp2",
        description="fsdp2: fully_shard per layer, then the root; deepspeed: ZeRO (zero_stage); "
        "single: one trainer rank, no sharding",
    )
    zero_stage: Literal[2, 3] = Field(
        default=2,
        description="ZeRO stage of strategy deepspeed (2: gradients and optimizer state sharded; "
        "3: the parameters too); the other strategies ignore it, and a 3 there is noted at start "
        "and in the dry run",
    )
    dtype: Literal["bfloat16", "float32", "auto"] = Field(
        default="auto",
        description="auto: bfloat16 on CUDA or a CPU with native bf16 matmuls (AMX, "
        "AVX512-BF16, Arm BF16), float32 elsewhere; resolved when the recipe loads",
    )
    num_anchors: int = Field(default=512, gt=0, description="random anchors per sequence")
    steps: int = Field(default=1000, gt=0, description="optimiser updates")
    lr: float = Field(default=6e-4, gt=0, description="peak learning rate of AdamW")
    warmup_ratio: float = Field(
        default=0.04, ge=0, lt=1, description="linear warmup, as a fraction of steps; then cosine"
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="cosine floor, as a fraction of lr")
    weight_decay: float = Field(
        default=0.0, ge=0,
        description="AdamW weight decay, of every trainable parameter (norm gains included: "
        "one parameter group, which checkpoints hold)",
    )
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW beta2")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient clipping by global norm")
    grad_accum: int = Field(default=1, gt=0, description="micro-batches per optimiser update")
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="seeds the draft's initialisation and the anchors")
    num_threads: int = Field(default=1, gt=0, description="intra-op threads per trainer on CPU")
    _auto_dtype: bool = PrivateAttr(default=False)  # dtype was auto, resolved for this machine
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: the local CUDA device when there is one, else cpu"
    )
    markov_init: Literal["random", "bigram"] = Field(
        default="random",
        description="bigram: start the Markov head as a rank-r bigram of the training samples "
        "(needs the answers before training: data regenerated ahead, or data.regenerate false)",
    )
    init_from: str | None = Field(
        default=None,
        description="an exported DSpark folder (draftforge export's, or another in the same format) "
        "whose weights start the draft, for further training: the draft section must describe the "
        "same draft; the optimiser and schedule start afresh. A resumed run loads its checkpoint instead",
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    output_dir: str = Field(
        default="runs/default", description="run directory: checkpoints, metrics, records (a "
        "leading ~ is the home folder)"
    )
    checkpoint_interval: int = Field(
        default=200, gt=0, description="steps between checkpoints (and one at the end)"
    )
    keep_last: int = Field(default=2, gt=0, description="checkpoints kept; older ones are removed")
    resume: str = Field(default="auto", description="auto (the newest complete checkpoint, if any), never, or a "
                        "checkpoint path; never and a path are refused where output_dir holds later checkpoints")
    log_interval: int = Field(
        default=10, gt=0, description="steps between progress lines and accounting reports"
    )
    wandb: bool = Field(default=False, description="also log metrics to wandb (draftforge[wandb])")
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        default="offline", description="wandb's mode; online uploads"
    )
    tensorboard: bool = Field(
        default=False, description="also write TensorBoard scalars to <output_dir>/tensorboard"
    )
    max_bad_steps: int = Field(
        default=10, ge=0, description="steps of one run skipped for a non-finite loss or gradient before it stops"
    )

    @field_validator("output_dir", "resume")
    @classmethod
    def _not_empty(cls, value: str, info: ValidationInfo) -> str:
        # '' would train into the current directory, or read the checkpoint '.'
        if not value.strip():
            raise ValueError(f"is empty: {_EMPTY_ADVICE[info.field_name]}")
        return value

    @field_validator("init_from")
    @classmethod
    def _a_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("is empty: give an exported draft's folder, or leave it out")
        return os.path.expanduser(value)

    @field_validator("output_dir", "resume")
    @classmethod
    def _expand_home(cls, value: str) -> str:
        # one folder for every reader: the trainer wrote a literal "./~/run" while export,
        # eval and the demo, which expand "~" in the paths they are given, looked in the home
        return os.path.expanduser(value)

    @model_validator(mode="after")
    def _resolve_dtype(self) -> TrainConfig:
        if self.dtype == "auto":  # re-validates once with the resolved value
            self._auto_dtype = True
            self.dtype = resolve_auto(self.dtype, self.device)
        return self


class ExportConfig(Section):
    """The Hugging Face folder that SGLang and llama.cpp load as it is."""

    arch: Literal["Qwen3DSparkModel", "LingDSparkModel"] = Field(
        default="Qwen3DSparkModel", description="architectures entry of the exported config.json"
    )
    with_embeddings: bool = Field(default=False, description="also write embed_tokens / lm_head")
    max_shard_size_mb: int | float = Field(default=4096, gt=0, description="shard above this size, in megabytes of 10^6 bytes as huggingface_hub counts them (fractions taken)")
    out_dir: str | None = Field(default=None, description="default: <output_dir>/export")

    @field_validator("out_dir")
    @classmethod
    def _out_named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():  # '' exported into the current directory
            raise ValueError("is empty: give a folder, or leave it out for <train.output_dir>/export")
        return value


def build_dspark_config(draft: DraftConfig, target_shape, *, vocab_size: int | None = None):
    """The model's :class:`~draftforge.train.model.DSparkConfig` from the draft section and the
    target's shape (a :class:`~draftforge.splitserve.config.TargetShape`)."""
    from draftforge.train.model import DSparkConfig

    fields = draft.model_dump()
    fields["rope_theta"] = fields["rope_theta"] or target_shape.rope_theta
    fields["max_position_embeddings"] = (
        fields["max_position_embeddings"] or target_shape.max_position_embeddings
    )
    return DSparkConfig(
        vocab_size=vocab_size or target_shape.vocab_size,
        target_hidden_size=target_shape.hidden_size,
        num_target_layers=target_shape.num_hidden_layers,
        **fields,
    )


def ignored_zero_stage_note(train: TrainConfig) -> str | None:
    """train.zero_stage 3 under another strategy than deepspeed changes nothing: a note saying
    so (not a refusal: a recipe resolved under deepspeed and switched to fsdp2 keeps the key).
    Stage 2 is the default and says nothing."""
    if train.zero_stage == 2 or train.strategy == "deepspeed":
        return None
    what = {"fsdp2": "FSDP2 shards parameters, gradients and optimizer state anyway, as ZeRO-3 does",
            "single": "one trainer rank shards nothing"}[train.strategy]
    return (f"train.zero_stage {train.zero_stage} is ignored: it is the ZeRO stage of "
            f"train.strategy deepspeed, and this run's strategy is {train.strategy} ({what})")


def warmup_steps(train: TrainConfig) -> int:
    """Warmup updates: ``warmup_ratio * steps`` rounded up, after rounding away float noise
    (0.07 * 100 is 7.000000000000001 in binary, which is 7 steps, not 8)."""
    return math.ceil(round(train.warmup_ratio * train.steps, 9))
