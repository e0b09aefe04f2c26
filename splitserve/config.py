"""Recipe sections owned by splitserve: the target engine and the process split."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from draftforge.argtypes import MAX_SEED
from draftforge.precision import resolve_auto
from draftforge.section import Section

GpuId = Annotated[int, Field(ge=0)]  # a CUDA device index: 0, 1, ...


class TargetShape(Section):
    """The target's shape, declared in the recipe.

    Required for ``model: random`` (it defines the random target) and for dry
    runs without the target's weights; for a named or local model it is
    checked against the real config when given.
    """

    num_hidden_layers: int = Field(gt=0, le=4096, description="decoder layers of the target")
    hidden_size: int = Field(gt=0, le=1 << 17, description="hidden size of the target")
    vocab_size: int = Field(gt=0, le=1 << 24, description="vocabulary size (rows of embed_tokens)")
    num_attention_heads: int = Field(default=4, gt=0, le=4096, description="attention heads of the target")
    num_key_value_heads: int = Field(default=2, gt=0, le=4096, description="key/value heads of the target")
    intermediate_size: int = Field(default=128, gt=0, le=1 << 20, description="MLP width of the target")
    max_position_embeddings: int = Field(
        default=2048,
        gt=0,
        description="longest position the target supports (the default is taken as the "
        "target's only for model: random)",
    )
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base of the target")
    head_dim: int | None = Field(
        default=None,
        gt=0,
        description="width of one attention head, where it is not hidden_size / "
        "num_attention_heads (Qwen3-4B: 128, where that is 80); read from the target's "
        "config.json when it gives one; used by --dry-run's weights and KV cache, and by "
        "model: random",
    )
    tie_word_embeddings: bool = Field(
        default=False,
        description="whether the target's lm_head is its embedding matrix (SmolLM2, Qwen3-4B); "
        "read from its config.json when it says; --dry-run's dense estimate then counts the "
        "matrix once",
    )
    num_parameters: int | None = Field(
        default=None,
        gt=0,
        description="total parameters of the target, every expert of a MoE included; used by "
        "--dry-run for the weights' memory (default: estimated from the dense shape above, "
        "which undercounts MoE and hybrid-attention targets)",
    )


REQUIRED_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")


class GenerationConfig(Section):
    """Sampling settings used to regenerate responses (distribution-aligned data)."""

    temperature: float = Field(default=0.7, ge=0.0, description="0 means greedy")
    top_p: float = Field(
        default=0.8, gt=0.0, le=1.0,
        description="nucleus sampling; 1 disables it. Backend hf (and draftforge eval) cuts it after "
        "top_k, on the renormalised top_k tokens, as transformers does; SGLang cuts both on the "
        "whole distribution (a note says so)")
    top_k: int = Field(default=20, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(default=256, gt=0, description="longest reply per assistant turn")
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED,
        description="sampling seed; each batch is reseeded from it, its prompt ids and the turn, "
        "so a resumed regeneration writes the same answers (backend hf; SGLang seeds its engine "
        "from it once and applies per-batch seeds only in its deterministic inference mode)",
    )
    enable_thinking: bool = Field(
        default=False, description="passed to the chat template; must match serving"
    )
    chat_template: str | None = Field(
        default=None,
        description="the Jinja text of a template replacing the tokenizer's own (its text, not a "
        "file path: a value without {{ or {% is refused)",
    )
    batch_size: int = Field(default=8, gt=0, description="conversations generated together")

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        # a file path (SGLang's --chat-template takes one) is no template: rendered as it
        # stands, it is every conversation's prompt, and regeneration answers the path
        if value is not None and "{{" not in value and "{%" not in value:
            shown = value if len(value) <= 60 else value[:57] + "..."
            raise ValueError(
                f"{shown!r} has no Jinja markup ({{{{ or {{%): the option takes the template's "
                "Jinja text (e.g. as a YAML block scalar, chat_template: |), not a file path "
                "or a template name"
            )
        return value


class TargetConfig(Section):
    """The target model and the engine that runs it."""

    model: str = Field(
        default="smollm2-135m-instruct",
        description="a registered name (smollm2-135m-instruct), 'random' (a seeded random Llama of "
        "target.shape; its tokenizer is SmolLM2's cut to shape.vocab_size, which needs 252 <= "
        "vocab_size <= 49152) or a local HF folder",
    )
    backend: Literal["hf", "sglang"] = Field(
        default="hf",
        description="hf: transformers in the target rank's process (CPU or GPU); sglang: an SGLang "
        "engine per target group (GPU, needs draftforge[sglang])",
    )
    sglang_mem_fraction: float = Field(
        default=0.8,
        gt=0.0,
        lt=1.0,
        description="backend sglang on a GPU: the share of the target GPU's memory that SGLang's "
        "generation engine and feature runner hold together as static memory (each a copy of "
        "the weights and its KV pool), split evenly between the two; the rest is left to "
        "activations, CUDA graphs and CUDA contexts. Unused by backend hf and on CPU",
    )
    dtype: Literal["bfloat16", "float32", "auto"] = Field(
        default="auto",
        description="auto: bfloat16 on CUDA or a CPU with native bf16 matmuls (AMX, "
        "AVX512-BF16, Arm BF16), float32 elsewhere; resolved when the recipe loads",
    )
    trust_remote_code: bool = Field(
        default=False, description="let a local HF folder run its own modelling code"
    )
    cache_dir: str | None = Field(
        default=None, description="conversion cache; default $DRAFTFORGE_CACHE, else ~/.cache/draftforge"
    )
    num_threads: int = Field(default=1, gt=0, description="intra-op threads per process on CPU "
                             "(draftforge data regenerate takes its own --threads)")
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="seed of the random target (model: random)")
    shape: TargetShape | None = Field(
        default=None,
        description="the target's shape: required for model random and for dry runs without "
        "the weights; checked against the real config when given",
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)

    _auto_dtype: bool = PrivateAttr(default=False)  # dtype was auto, resolved for CUDA if any

    @model_validator(mode="before")
    @classmethod
    def _shape_completed_from_the_target(cls, data: object) -> object:
        """A shape declared in part for a registered or local target (only its
        ``max_position_embeddings`` or ``num_parameters``, as errors and the dry run advise)
        takes the fields it must have from the target's own config, where that can be read;
        a random target, or one whose config cannot be read, must still declare them."""
        if not isinstance(data, dict) or not isinstance(data.get("shape"), dict):
            return data
        model = data.get("model", cls.model_fields["model"].default)
        missing = [name for name in REQUIRED_SHAPE_FIELDS if name not in data["shape"]]
        if model == "random" or not missing or not isinstance(model, str):
            return data
        from draftforge.splitserve.registry import _known_shape

        try:
            known = _known_shape(model, strict=False)
        except (OSError, ValueError):  # an unreadable config.json: the target's own check says so
            known = None
        if known is None:
            return data
        return {**data, "shape": {**{name: getattr(known, name) for name in missing}, **data["shape"]}}

    @model_validator(mode="after")
    def _resolve_dtype(self) -> TargetConfig:
        if self.dtype == "auto":  # the target runs on CUDA wherever there is one
            self._auto_dtype = True
            self.dtype = resolve_auto(self.dtype)
        return self

    def dtype_on(self, device: str) -> str:
        """The dtype for a target placed on ``device``: an ``auto`` dtype resolved there (a
        target put on the CPU of a CUDA machine takes the CPU's rule), else the recipe's."""
        return resolve_auto("auto", "cpu" if device == "cpu" else "cuda") if self._auto_dtype else self.dtype

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        if not value.strip():  # '' was looked up as a folder and blamed the draft's derived fields
            raise ValueError("is empty: give a registered name (smollm2-135m-instruct), 'random' "
                             "or a local HF folder")
        return value

    @field_validator("cache_dir")
    @classmethod
    def _cache_named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():  # '' converted the target into the current directory
            raise ValueError("is empty: give a folder, or leave it out for $DRAFTFORGE_CACHE "
                             "(else ~/.cache/draftforge)")
        return value

    @field_validator("shape")
    @classmethod
    def _random_shape_given_null(cls, shape: TargetShape | None, info: ValidationInfo) -> TargetShape | None:
        # shape: null (or target.shape=null) is this key's problem, located at its line or
        # override; a shape left out is _random_needs_shape's, the section's
        if shape is None and info.data.get("model") == "random":
            raise ValueError("model 'random' needs a declared 'shape' section, not null")
        return shape

    @model_validator(mode="after")
    def _random_needs_shape(self) -> TargetConfig:
        if self.model == "random" and self.shape is None:
            raise ValueError("model 'random' needs a declared 'shape' section")
        return self


class SplitConfig(Section):
    """Which ranks serve the target and which train the draft."""

    target_ranks: list[int] = Field(
        default_factory=lambda: [0],
        description="ranks that run the target: regenerate answers, compute features, stream them",
    )
    trainer_ranks: list[int] | None = Field(
        default=None, description="default: every rank not in target_ranks"
    )
    world_size: int | None = Field(
        default=None, gt=0,
        description="default: len(target_ranks) + len(trainer_ranks); with neither set, "
        "len(target_ranks) + one trainer rank (one per trainer_devices entry where it is set)",
    )
    num_nodes: int = Field(
        default=1,
        gt=0,
        description="machines the ranks span; node n runs ranks n*P .. n*P+P-1 with "
        "P = world_size / num_nodes (torchrun static rendezvous at node 0, see --dry-run)",
    )
    target_devices: list[GpuId] | None = Field(
        default=None,
        description="GPU ids of the target group (one machine only: refused with num_nodes > 1, "
        "where every rank uses its node-local GPU LOCAL_RANK)",
    )
    trainer_devices: list[GpuId] | None = Field(
        default=None,
        description="GPU ids of the trainers (one machine only: refused with num_nodes > 1, "
        "where every rank uses its node-local GPU LOCAL_RANK)",
    )
    target_tensor_parallel: int = Field(
        default=1, gt=0,
        description="target ranks per SGLang tensor-parallel group: its first rank runs the "
        "engine and feature runner over the group's consecutive GPUs, the others wait "
        "(sglang only; hf needs 1)",
    )
    max_in_flight: int | None = Field(
        default=None,
        gt=0,
        description="samples in flight per trainer (backpressure credits, shared among the "
        "target ranks that feed it); default: twice the samples of data.max_length one "
        "optimizer step packs (token_budget // max_length x train.grad_accum), at least 4 "
        "and at least the target ranks feeding it, so the target can work a step ahead",
    )
    token_budget: int = Field(
        default=4096,
        gt=0,
        description="padded tokens per micro-batch: sequences x the longest one stay within it "
        "(a target rank gives each sample to the trainer, of those it feeds, whose micro-batches, "
        "packed so, are least advanced: every step takes train.grad_accum of them on every trainer; "
        "where the data runs out, a trainer short of them fills its step with micro-batches that "
        "supervise nothing, and a last step no trainer can fill is not trained, its samples "
        "counted in summary.json's untrained_at_end)",
    )
    restart_target: bool = Field(
        default=False,
        description="when a rank dies (a target, usually), start every rank again (up to "
        "--max-restarts times, default 3) and continue from the newest checkpoint; needs "
        "train.resume: auto",
    )
    comm_backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="transport of the features: auto is nccl when GPUs are visible and "
        "train.device is not cpu, else gloo; over gloo the target ranks run on the CPU and "
        "trainers of train.device cuda (or auto where GPUs are visible) each on their own GPU "
        "(a node's first trainer rank on GPU 0, its next on GPU 1, ...)",
    )
    feature_batch_size: int = Field(
        default=8, gt=0, description="sequences per target features() call on a target rank"
    )
    max_epochs: int | None = Field(
        default=None, gt=0, description="passes over the data; default: until train.steps"
    )
    reuse_features: bool = Field(
        default=False,
        description="compute each sample's target features once for two epochs: a target rank "
        "keeps a chunk's features and sends them again as the chunk's second-epoch samples right "
        "after the next chunk's first-epoch ones (epochs 0 and 1 interleave chunk by chunk instead "
        "of epoch 1 following in its own order; later epochs are computed again). Holds up to two "
        "chunks' features on the target's device; give the trainers credits for two chunks "
        "(split.max_in_flight; the dry run gives the figure). For CPU targets, where an epoch's "
        "features cost about half the target time its answers do",
    )
    peer_timeout_s: float = Field(
        default=900.0,
        ge=1.0,  # the ranks' rendezvous waits this long too: at 0.01 s it failed at start
        le=1e9,  # about 31 years: the process groups' timeout, which torch's store refuses far above it
        description="a peer that sends nothing this long, not even its heartbeat, is reported "
        "dead (a crashed one at once). Each rank sends a heartbeat every peer_timeout_s / 4 "
        "while it works, so a long target load, generation, training step or checkpoint save "
        "is not silence; the exception is a trainer fed by several target ranks, which gets no "
        "heartbeat from them. With num_nodes > 1 it is also how long each node waits at the "
        "rendezvous for the others to start (this plus 60 s), on every start and restart",
    )

    @property
    def keeps_features(self) -> bool:
        """Whether a target rank keeps epoch 0's features for epoch 1: ``reuse_features``, with an
        epoch 1 to send them to."""
        return self.reuse_features and self.max_epochs != 1
