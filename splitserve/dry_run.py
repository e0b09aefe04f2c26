"""``draftforge train RECIPE --dry-run``: the resolved config, the split, the draft's size, memory.

Nothing is loaded: the draft is built on the meta device (so a Ling-scale draft
costs no memory) and the target's size comes from its declared or known shape.
Memory figures are estimates per rank, in GiB, itemised so they can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.config import RecipeConfig
from draftforge.splitserve.producer import build_topology

GIB = 1024**3
BYTES = {"bfloat16": 2, "float32": 4}


@dataclass
class Estimate:
    """Itemised bytes of one rank."""

    items: list[tuple[str, float]]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.items)

    def lines(self, indent: str = "    ") -> list[str]:
        width = max(len(name) for name, _ in self.items)
        rows = [f"{indent}{name:<{width}}  {value / GIB:9.3f} GiB" for name, value in self.items]
        rows.append(f"{indent}{'total':<{width}}  {self.total / GIB:9.3f} GiB")
        return rows


def draft_parameter_counts(cfg: RecipeConfig) -> tuple[int, int]:
    """(with embeddings, without) of the recipe's draft, built on the meta device."""
    return _parameter_counts(recipe_meta_draft(cfg))


def recipe_meta_draft(cfg: RecipeConfig):
    """The recipe's draft on the meta device (:func:`_meta_draft`), or :class:`InputError` where
    the target's shape is unknown without loading it."""
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    shape = resolve_target_shape(cfg.target)
    if shape is None:
        from draftforge.errors import InputError

        raise InputError(
            f"target.model: the shape of target {cfg.target.model!r} is unknown without loading "
            "it (no config.json in that folder gives it); declare target.shape for a dry run"
        )
    return _meta_draft(build_dspark_config(cfg.draft, shape))


def dspark_parameter_counts(dspark_cfg) -> tuple[int, int]:
    """(with embeddings, without) of a DSpark draft of ``dspark_cfg``, built on the meta device."""
    return _parameter_counts(_meta_draft(dspark_cfg))


def _parameter_counts(model) -> tuple[int, int]:
    from draftforge.train.model import count_parameters

    return count_parameters(model, with_embeddings=True), count_parameters(model, with_embeddings=False)


def _meta_draft(dspark_cfg):
    """A DSpark draft of ``dspark_cfg`` on the meta device: shapes, no memory."""
    from draftforge.train.model import DSparkDraft

    class _MetaDraft(DSparkDraft):
        def init_weights(self, *args, **kwargs) -> None:  # nothing to initialise on meta
            return None

    with torch.device("meta"):
        return _MetaDraft(dspark_cfg)


DENSE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
                "num_key_value_heads", "intermediate_size")


def target_parameters(shape) -> int | None:
    """Parameters of the target: ``shape.num_parameters`` when declared, else a dense estimate,
    else None (some field the estimate needs is only the section's placeholder default).

    The estimate is a Llama/Qwen-style dense model of ``shape`` (embedding and lm_head one
    matrix where ``shape.tie_word_embeddings``, else two) with heads ``shape.head_dim`` wide
    (default hidden / heads, :func:`~draftforge.splitserve.registry.target_head_dim`);
    for a MoE target it counts one MLP per layer instead of every expert, so such
    recipes declare ``target.shape.num_parameters``.
    """
    if shape.num_parameters is not None:
        return shape.num_parameters
    if _placeholder_fields(shape):
        return None
    hidden = shape.hidden_size
    per_layer = layer_matrix_parameters(shape) + 2 * hidden  # and the layer's two norms
    embeddings = (1 if shape.tie_word_embeddings else 2) * shape.vocab_size * hidden
    return embeddings + shape.num_hidden_layers * per_layer + hidden


def layer_matrix_parameters(shape) -> int:
    """One dense decoder layer's weight matrices: the attention projections, with heads
    ``target_head_dim`` wide, and a gated MLP."""
    from draftforge.splitserve.registry import target_head_dim

    hidden = shape.hidden_size
    attn = hidden * target_head_dim(shape) * (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads)
    return attn + 3 * hidden * shape.intermediate_size


def _placeholder_fields(shape, fields: tuple[str, ...] = DENSE_FIELDS) -> list[str]:
    """Those of ``fields`` (default: the dense estimate's) that neither the recipe nor the
    target's config set: they hold the section's placeholder defaults."""
    return [name for name in fields if name not in shape.model_fields_set]


def _counted(name: str, value: float, shape, fields: tuple[str, ...]) -> tuple[str, float]:
    """An estimate's item, or, where a field it needs is only a placeholder, the item left
    out (0) with the fields to declare, as the weights' line does."""
    missing = _placeholder_fields(shape, fields)
    if not missing:
        return name, value
    return f"{name} (unknown, not counted: declare target.shape.{', '.join(missing)})", 0


def _weights_source(shape) -> str:
    if shape.num_parameters is not None:
        return f"{shape.num_parameters:,} declared params"
    missing = _placeholder_fields(shape)
    if missing:
        return (f"unknown, not counted: declare target.shape.num_parameters (a dense estimate "
                f"would need {', '.join(missing)})")
    return f"{target_parameters(shape):,} params, dense estimate"


# What a rank on a CPU holds besides the items: Python, torch, transformers, the tokenizer, the
# process group. recipes/tiny-debug.yaml's ranks (a 6.4M-parameter target, whose items add up to
# 0.04 GiB) peaked at 0.45 GiB (target) and 0.84 GiB (trainer, items 0.46 GiB) of resident memory
# (VmHWM) on the 2-core machine of PERFORMANCE.md; rounded up. On a GPU the items are the
# device's memory, where this is not held (the CUDA context, not counted, is).
PROCESS_ITEM = ("the process: Python, torch, transformers, tokenizer (on a CPU)", 0.5 * GIB)


def target_estimate(cfg: RecipeConfig) -> Estimate:
    """One target rank: weights, feature batch activations, generation KV cache, send buffers."""
    from draftforge.splitserve.registry import resolve_target_shape, target_head_dim
    from draftforge.splitserve.roles import comm_backend

    shape = resolve_target_shape(cfg.target)
    # over gloo a target rank runs on the CPU, where an auto dtype takes the CPU's rule
    dtype_name = cfg.target.dtype_on("cuda" if comm_backend(cfg, gpus_visible=True) == "nccl" else "cpu")
    dtype = BYTES[dtype_name]
    tp = cfg.split.target_tensor_parallel
    k = len(cfg.draft.target_layer_ids)
    seq = cfg.data.max_length
    batch = cfg.split.feature_batch_size
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    head_dim = target_head_dim(shape)  # declared or config.json's, else hidden / heads
    # one layer's working set at a time: residual, qkv, attention scores, MLP intermediate
    working = batch * seq * (6 * hidden + 2 * shape.intermediate_size) * dtype
    scores = batch * heads * seq * seq * dtype
    captured = batch * seq * (k + 1) * hidden * dtype
    gen = cfg.target.generation
    kv = (2 * shape.num_hidden_layers * shape.num_key_value_heads * head_dim
          * gen.batch_size * (seq + gen.max_new_tokens) * dtype)
    logits = gen.batch_size * shape.vocab_size * 4
    wire = cfg.split.max_in_flight * seq * (k + 1) * hidden * 2
    # split.reuse_features: epoch 0's features of a chunk, kept until the next chunk's are made
    kept = ([("features kept for epoch 1 (split.reuse_features: two chunks)",
              2 * gen.batch_size * seq * (k + 1) * hidden * dtype)]
            if cfg.split.keeps_features else [])
    weights = (target_parameters(shape) or 0) * dtype / tp
    label = f"weights ({dtype_name}, tp {tp}, {_weights_source(shape)})"
    if cfg.target.backend == "sglang":
        # two SGLang instances, each with its own copy: the engine and the feature runner;
        # their KV pools fill the rest of target.sglang_mem_fraction (sglang_pool_note)
        return Estimate([
            *([PROCESS_ITEM] if _target_may_run_on_cpu(cfg) else []),
            (label.replace("weights (", "weights x2: generation engine + feature runner (", 1),
             2 * weights),
            ("features: captured layers", captured),
            *kept,
            ("send buffers (bf16)", wire),
        ])
    generation = [_counted("generation: KV cache + logits", kv + logits, shape,
                           ("num_attention_heads", "num_key_value_heads"))]
    on_cpu = _target_may_run_on_cpu(cfg)
    packed = packed_weights_bytes(cfg) if on_cpu else 0.0
    return Estimate([
        *([PROCESS_ITEM] if on_cpu else []),
        (label, weights),
        *([("packed copy of the linear weights (bf16 on a CPU, at most)", packed)] if packed else []),
        ("features: captured layers", captured),
        _counted("features: one layer's activations", working + scores, shape,
                 ("num_attention_heads", "intermediate_size")),
        *(generation if _generates(cfg) else []),
        *kept,
        ("send buffers (bf16)", wire),
    ])


def _generates(cfg: RecipeConfig) -> bool:
    """Whether training generates answers: with ``data.regenerate`` and no answers file yet
    (training reads one that exists, as the demo's; without ``data.regenerate`` it trains on
    the data's own answers)."""
    from draftforge.data.loading import regenerated_path

    return cfg.data.regenerate and not regenerated_path(cfg.data, cfg.train.output_dir).is_file()


def packed_weights_bytes(cfg: RecipeConfig) -> float:
    """On a CPU in bf16 a transformers target keeps a second, oneDNN-packed copy of its linear
    weights (``splitserve/packed_linear.py``): every layer's projections and the lm_head; 0
    elsewhere (and where the target's shape is not known)."""
    from draftforge.splitserve.registry import resolve_target_shape

    shape = resolve_target_shape(cfg.target)
    if (cfg.target.backend != "hf" or cfg.target.dtype_on("cpu") != "bfloat16"
            or _placeholder_fields(shape)):
        return 0.0
    linears = shape.num_hidden_layers * layer_matrix_parameters(shape) + shape.vocab_size * shape.hidden_size
    return linears * 2 / cfg.split.target_tensor_parallel


def sglang_pool_note(cfg: RecipeConfig) -> str:
    """What the SGLang backend's target estimate leaves out: the KV pools SGLang sizes itself."""
    if cfg.target.backend != "sglang":
        return ""
    from draftforge.splitserve.roles import comm_backend
    from draftforge.splitserve.sglang_backend import RUNNER_TOKENS

    tp = cfg.split.target_tensor_parallel
    leader = "" if tp == 1 else (
        "; features and send buffers are the group leader's alone, the rank that sends")
    if comm_backend(cfg, gpus_visible=True) != "nccl":  # over gloo the target ranks run on the CPU
        return (f"  (target.backend sglang over gloo: the target ranks run on the CPU, where the "
                f"two SGLang instances hold their weights above in the machine's memory, and KV "
                f"pools of {RUNNER_TOKENS} tokens each, not counted here; "
                f"target.sglang_mem_fraction sizes GPU memory and is unused on the CPU{leader})")
    where = "on its GPU" if tp == 1 else f"on each of a group's {tp} GPUs"
    return (f"  (target.backend sglang: {where} the two SGLang instances hold "
            f"target.sglang_mem_fraction = {cfg.target.sglang_mem_fraction:g} of its memory in "
            "all, half each: their weights above, and KV pools that fill the rest of each half; "
            f"the run refuses to start where the weights alone fill a half{leader})")


def trainer_estimate(cfg: RecipeConfig, with_emb: int, without_emb: int, *, meta_draft=None) -> Estimate:
    """One trainer rank: parameters, gradients, AdamW states (sharded as the strategy does) and
    activations. ``meta_draft``: the recipe's meta-device draft where the caller has built it already
    (:func:`recipe_meta_draft`; fsdp2 reads its units from it), else it is built here."""
    from draftforge.splitserve.registry import resolve_target_shape

    shape = resolve_target_shape(cfg.target)
    train, draft = cfg.train, cfg.draft
    ranks = len(cfg.split.trainer_ranks)
    trainable, frozen = without_emb, with_emb - without_emb
    low = BYTES[train.dtype]
    shard = ranks if train.strategy in ("fsdp2", "deepspeed") else 1
    if train.strategy == "fsdp2":
        # fp32 sharded masters, grads, Adam; gathered in the compute dtype (train/distributed.py
        # shard_fsdp2): each draft layer is its own unit, resharded after its forward and
        # gathered again for its backward, so two at once (the one computing and the next,
        # prefetched); the root unit (fc, norms, Markov and confidence heads) is not resharded
        # after forward, so it stays gathered from the first forward to the end of backward,
        # beside the layers; the frozen embed and lm_head are not sharded: whole on every rank
        layer, root = fsdp2_unit_parameters(cfg, shape, meta_draft=meta_draft)
        items = [
            ("trainable params (fp32, sharded)", trainable * 4 / shard),
            (f"gathered layers (compute dtype, 2 x {layer:,} params)", 2 * layer * low),
            (f"gathered root (compute dtype, {root:,} params: fc, norms, heads)", root * low),
            ("frozen embed + lm_head (compute dtype, whole on every trainer)", frozen * low),
        ]
    elif train.strategy == "deepspeed":
        zero3 = train.zero_stage == 3
        items = [
            ("params (compute dtype)" + (", sharded" if zero3 else ""), trainable * low / (shard if zero3 else 1)),
            ("fp32 master weights (sharded)", trainable * 4 / shard),
            ("frozen embed + lm_head", frozen * low),
        ]
    else:
        items = [
            ("trainable params (fp32)", trainable * 4),
            ("frozen embed + lm_head", frozen * low),
        ]
    if _trainer_may_run_on_cpu(cfg):
        items.insert(0, PROCESS_ITEM)
    items += [
        ("gradients (fp32" + (", sharded)" if shard > 1 else ")"), trainable * 4 / shard),
        ("AdamW moments (fp32" + (", sharded)" if shard > 1 else ")"), trainable * 8 / shard),
    ]
    k = len(draft.target_layer_ids)
    budget = cfg.split.token_budget
    # a step collates all its grad_accum micro-batches before the first forward
    features = train.grad_accum * budget * (k + 1) * shape.hidden_size * 2  # bf16 on the wire
    activations, objective = activation_bytes(cfg, shape, cfg.data.max_length)
    queue = cfg.split.max_in_flight * cfg.data.max_length * (k + 1) * shape.hidden_size * 2
    items += [
        ("batch features (bf16" + (f", a step's {train.grad_accum} micro-batches)"
                                   if train.grad_accum > 1 else ")"), features),
        ("context + backbone activations", activations),
        ("objective chunk (fp32, vocabulary)", objective),
        ("received queue (bf16)", queue),
    ]
    if draft.markov_rank:  # train/objective.py: one [V, H + r] head for both logit terms, and
        # W2's gradient summed in fp32 from the forward's chunks to the backward
        items += [
            (f"objective's joined [lm_head | W2] (compute dtype, {shape.vocab_size:,} x "
             f"{shape.hidden_size + draft.markov_rank:,})",
             shape.vocab_size * (shape.hidden_size + draft.markov_rank) * low),
            ("objective's W2 gradient (fp32)", shape.vocab_size * draft.markov_rank * 4),
        ]
    if _trainer_may_run_on_cpu(cfg):
        w2_group = w2_group_bytes(cfg, shape, cfg.data.max_length)
        if w2_group:
            items.append(("objective's W2 gradient group (a trainer on a CPU)", w2_group))
        if train.dtype == "bfloat16":  # train/objective.py, _target_logits
            items.append(("objective's packed lm_head (a trainer on a CPU)",
                          shape.vocab_size * shape.hidden_size * 2))
    return Estimate(items)


def fsdp2_unit_parameters(cfg: RecipeConfig, shape, *, meta_draft=None) -> tuple[int, int]:
    """(one draft layer's parameters, the root unit's own trainable ones: fc, norms, Markov
    and confidence heads) of the recipe's draft (``meta_draft``, or built on the meta device when
    None): the units ``fully_shard`` gathers under train.strategy fsdp2 (the frozen embed and
    lm_head, which it leaves whole, are counted apart)."""
    from draftforge.train.config import build_dspark_config

    model = meta_draft if meta_draft is not None else _meta_draft(build_dspark_config(cfg.draft, shape))
    in_units = {id(p) for layer in model.layers for p in layer.parameters()}
    in_units |= {id(model.embed_tokens.weight), id(model.lm_head.weight)}
    layer = max((sum(p.numel() for p in layer.parameters()) for layer in model.layers), default=0)
    return layer, sum(p.numel() for p in model.parameters() if id(p) not in in_units)


def anchors_per_micro_batch(cfg: RecipeConfig, sample_tokens: int) -> int:
    """Anchors in one micro-batch of samples ``sample_tokens`` long: as many samples as the
    token budget holds, each with train.num_anchors or, when the samples are shorter, one
    per token with a supervised successor (the trainer runs no block that only pads)."""
    return rows_per_micro_batch(cfg, sample_tokens) * min(cfg.train.num_anchors, max(1, sample_tokens - 1))


def rows_per_micro_batch(cfg: RecipeConfig, sample_tokens: int) -> int:
    """Samples ``sample_tokens`` long that the token budget holds (at least one)."""
    return max(1, cfg.split.token_budget // max(1, sample_tokens))


def activation_bytes(cfg: RecipeConfig, shape, sample_tokens: int) -> tuple[float, float]:
    """(context + backbone activations, the objective's vocabulary chunk) for a micro-batch of
    samples ``sample_tokens`` long (``splitserve/draft_activations.py`` counts the first)."""
    from draftforge.splitserve.draft_activations import backbone_saved_bytes, precision_of

    draft, train = cfg.draft, cfg.train
    sequences = rows_per_micro_batch(cfg, sample_tokens)
    block_tokens = anchors_per_micro_batch(cfg, sample_tokens) * draft.block_size
    backbone = backbone_saved_bytes(
        draft, target_hidden_size=shape.hidden_size, block_tokens=block_tokens,
        context_tokens=sequences * sample_tokens, sequences=sequences,
        precision=precision_of(train.strategy, train.dtype))
    chunk = min(block_tokens, train.loss.chunk_blocks * draft.block_size)
    objective = chunk * shape.vocab_size * 4 * 4  # draft and target logits, probabilities, grads
    return backbone, objective


def w2_group_bytes(cfg: RecipeConfig, shape, sample_tokens: int) -> float:
    """The buffer a trainer on a CPU gathers the objective's chunks in for the Markov head's
    W2 gradient (``train/objective.py``, ``_W2GradientSum``), for a micro-batch of samples
    ``sample_tokens`` long: 0 without a Markov head, on a GPU, or where a micro-batch's blocks
    fit one chunk."""
    from draftforge.train.objective import w2_group_rows

    draft, train = cfg.draft, cfg.train
    if not draft.markov_rank or not _trainer_may_run_on_cpu(cfg):
        return 0.0
    element = BYTES[train.dtype]
    rows = w2_group_rows(shape.vocab_size, element, chunk_rows=train.loss.chunk_blocks * draft.block_size,
                         total_rows=anchors_per_micro_batch(cfg, sample_tokens) * draft.block_size,
                         on_cpu=True)
    return rows * (shape.vocab_size + draft.markov_rank) * element


def short_sample_note(cfg: RecipeConfig) -> str:
    """How much more a trainer may need when micro-batches pack many shorter samples: the
    estimate assumes samples of data.max_length, the packing allows any from
    data.min_loss_tokens + 1 tokens; the note gives the length that packs the most anchors."""
    from draftforge.splitserve.registry import resolve_target_shape

    shape = resolve_target_shape(cfg.target)
    full = anchors_per_micro_batch(cfg, cfg.data.max_length)
    # the most over every sample length the packing allows: it peaks near num_anchors + 1
    # tokens (as many samples as fit, each with all its anchors), not at the shortest
    lengths = range(cfg.data.min_loss_tokens + 1, cfg.data.max_length + 1)
    short_len = max(lengths, key=lambda n: anchors_per_micro_batch(cfg, n), default=cfg.data.max_length)
    short = anchors_per_micro_batch(cfg, short_len)
    if short <= full:
        return ""
    extra = (sum(activation_bytes(cfg, shape, short_len)) + w2_group_bytes(cfg, shape, short_len)
             - sum(activation_bytes(cfg, shape, cfg.data.max_length))
             - w2_group_bytes(cfg, shape, cfg.data.max_length))
    return (f"    (above: samples of data.max_length, {full} anchors a micro-batch; samples of "
            f"{short_len} tokens could pack {short}: up to {extra / GIB:.3f} GiB more)")


def _rope_note(cfg: RecipeConfig) -> str | None:
    """A dry run plans the job without the target's files; training needs the RoPE base."""
    from draftforge.splitserve.registry import rope_theta_problem

    problem = rope_theta_problem(cfg)
    return None if problem is None else f"note: training would refuse: {problem}"


def _zero_stage_note(cfg: RecipeConfig) -> str | None:
    from draftforge.train.config import ignored_zero_stage_note

    note = ignored_zero_stage_note(cfg.train)
    return None if note is None else f"note: {note}"


def uneven_feed_note(topology, tensor_parallel: int = 1) -> str:
    """Where the producers do not divide the trainers evenly (or these them): which producer or
    trainer sets the pace, and what the target side feeds (:func:`feed_rate`) against the sum
    of its producers. Nothing for an even split."""
    from draftforge.splitserve.accounting import feed_rate

    num_p, num_r = len(topology.producers), len(topology.trainers)
    factor = feed_rate(num_p, num_r, 1.0)
    if factor >= num_p:
        return ""

    def ranks(kind: str, chosen: list[int], total: int, verb: str) -> tuple[str, str, str]:
        """``kind rank(s) X, Y``, then ``each `` or nothing, and ``others VERB`` or ``another VERBs``."""
        plural = len(chosen) > 1
        return (f"{kind} rank{'s' if plural else ''} {', '.join(map(str, chosen))}",
                "each " if plural else "",
                f"others {verb}" if total - len(chosen) > 1 else f"another {verb}s")

    if num_p <= num_r:
        loads = {p: len(topology.dests(p)) for p in topology.producers}
        most = max(loads.values())
        busy = [p for p, n in loads.items() if n == most]
        name, each, others = ranks("target", busy, num_p, "feed")
        who = f"{name}, feeding {most} trainer ranks {each}where {others} {min(loads.values())},"
    else:
        fed = {r: len(topology.sources(r)) for r in topology.trainers}
        fewest = min(fed.values())
        slow = [r for r, n in fed.items() if n == fewest]
        name, each, others = ranks("trainer", slow, num_r, "get")
        unit = "tensor-parallel target group" if tensor_parallel > 1 else "target rank"
        who = (f"{name}, fed by {fewest} {unit}{'s' if fewest > 1 else ''} {each}where {others} "
               f"{max(fed.values())},")
    one = "one tensor-parallel target group's" if tensor_parallel > 1 else "one target rank's"
    return (f"  uneven: the trainer ranks step in lockstep on equal shares of the data, so {who} "
            f"set{'s' if not each else ''} the pace: the target side feeds at most {factor:.3g} x "
            f"{one} rate, not {num_p} x")


def _reuse_note(cfg: RecipeConfig, topology) -> str | None:
    """What ``split.reuse_features`` does to the stream, and whether the credits hold the two
    chunks it sends per chunk answered."""
    split, chunk = cfg.split, cfg.target.generation.batch_size
    if not split.keeps_features:
        return None
    # a target rank's two chunks are shared among the trainers it feeds; a trainer fed by
    # several target ranks splits split.max_in_flight among its links
    need = {r: max(-(-2 * chunk // len(topology.dests(p))) for p in topology.sources(r))
            for r in topology.trainers}
    short = [r for r in topology.trainers if split.max_in_flight // len(topology.sources(r)) < need[r]]
    wanted = max(need[r] * len(topology.sources(r)) for r in topology.trainers)
    return ("  split.reuse_features: epochs 0 and 1 interleave chunk by chunk, epoch 1 sending the "
            f"features epoch 0 computed, so a target rank sends two chunks ({2 * chunk} samples) for "
            "each chunk it answers"
            + (f"; split.max_in_flight {split.max_in_flight} holds less of them than trainer rank(s) "
               f"{short} get, so a target rank waits for a trainer to take some before it answers "
               f"its next chunk: raise it to {wanted}" if short else ""))


def _shared_credits(split, topology) -> str:
    """What a trainer fed by several target ranks holds: each link gets an equal whole share
    of ``split.max_in_flight`` (the rest is never used)."""
    shares = []
    for count in sorted({len(topology.sources(r)) for r in topology.trainers}):
        if count > 1:
            per_link = split.max_in_flight // count
            unit = "tensor-parallel target groups" if split.target_tensor_parallel > 1 else "target ranks"
            shares.append(f"a trainer fed by {count} {unit}: {per_link} per link, "
                          f"{per_link * count} in all")
    return f" ({'; '.join(shares)})" if shares else ""


def _trainer_may_run_on_cpu(cfg: RecipeConfig) -> bool:
    """Whether the trainers run on a CPU, or may where no GPU is visible: not with a device
    list, not with train.device cuda (refused where no GPU is visible), not over NCCL."""
    split = cfg.split
    if split.trainer_devices is not None or cfg.train.device == "cuda":
        return False
    return split.comm_backend != "nccl"


def _target_may_run_on_cpu(cfg: RecipeConfig) -> bool:
    """Whether the target ranks run on a CPU, or may where no GPU is visible: over gloo they do
    (whatever train.device says); under an auto backend also where no GPU is visible, unless a
    device list or train.device cuda asks for GPUs."""
    from draftforge.splitserve.roles import comm_backend

    split = cfg.split
    if comm_backend(cfg, gpus_visible=True) != "nccl":
        return True
    return split.comm_backend == "auto" and split.target_devices is None and cfg.train.device != "cuda"


def _placed(cfg: RecipeConfig, ranks: list[int], devices: list[int] | None, *, trainer: bool) -> str:
    """Where a group's ranks run, as the run places them: the group's device list; else over
    NCCL each rank's GPU LOCAL_RANK; over gloo the CPU, or for a trainer of train.device
    cuda (or auto where a GPU is visible) its own GPU, by its place among its node's trainers."""
    from draftforge.splitserve.roles import comm_backend

    split = cfg.split
    if devices is not None:
        return f"devices {devices}"
    if comm_backend(cfg, gpus_visible=True) == "gloo":
        if not trainer or cfg.train.device == "cpu":
            return "cpu"
        if split.num_nodes > 1:
            own = "each on its own GPU, by its place among its node's trainers (gloo)"
        else:
            own = f"GPUs {list(range(len(ranks)))} (gloo: in the order of the ranks)"
        return own if cfg.train.device == "cuda" else f"{own}, or cpu where no GPU is visible"
    gpus = ("node-local GPUs LOCAL_RANK" if split.num_nodes > 1
            else f"GPUs {list(ranks)} (LOCAL_RANK)")  # one node: LOCAL_RANK is the rank
    return gpus if split.comm_backend == "nccl" else f"{gpus}, or cpu where no GPU is visible"


def planned_dtypes(cfg: RecipeConfig) -> tuple[RecipeConfig, str | None]:
    """``cfg`` with its ``auto`` dtypes as the planned GPUs resolve them, and a note saying so,
    where this machine has no GPU to ask (a login node planning a GPU recipe): bfloat16, as on
    every GPU with native bf16 (Ampere and later). Loading resolved them by this machine's
    CPU, float32 on one without native bf16, which would double the GPU ranks' estimates.
    Ranks that run on a CPU keep the CPU's rule."""
    import torch

    from draftforge.splitserve.roles import comm_backend

    if torch.cuda.is_available():  # resolved by the GPU itself when the recipe was loaded
        return cfg, None
    target, train, planned = cfg.target, cfg.train, []
    on_gpus = comm_backend(cfg, gpus_visible=True) == "nccl"  # as the plan places the ranks
    if target._auto_dtype and on_gpus and target.dtype_on("cuda") != "bfloat16":
        target = target.model_copy(update={"dtype": "bfloat16"})
        target._auto_dtype = False
        planned.append("target.dtype")
    trainer_on_gpus = cfg.train.device != "cpu" and (on_gpus or not _trainer_may_run_on_cpu(cfg))
    if train._auto_dtype and trainer_on_gpus and train.dtype != "bfloat16":
        train = train.model_copy(update={"dtype": "bfloat16"})
        planned.append("train.dtype")
    if not planned:
        return cfg, None
    return cfg.model_copy(update={"target": target, "train": train}), (
        f"  {' and '.join(planned)}: auto, planned as bfloat16 for the recipe's GPUs (this machine has "
        "none to ask, and its CPU would take float32; a GPU without native bf16 takes float32)")


def dry_run(cfg: RecipeConfig) -> str:
    """The dry-run report."""
    from draftforge.splitserve.roles import comm_backend

    cfg, dtype_note = planned_dtypes(cfg)
    split = cfg.split
    topology = build_topology(split)
    meta_draft = recipe_meta_draft(cfg)  # built once: the parameter counts and the trainer estimate
    with_emb, without_emb = _parameter_counts(meta_draft)
    lines = [cfg.to_yaml().rstrip(), "", "split:"]
    nodes = "" if split.num_nodes == 1 else f" over {split.num_nodes} nodes"
    backend = comm_backend(cfg, gpus_visible=True)
    if split.comm_backend == "auto":
        backend = ("auto: nccl where GPUs are visible, else gloo" if backend == "nccl"
                   else "auto: gloo (train.device cpu)")
    lines.append(f"  world size {split.world_size}{nodes}; comm backend {backend}")
    lines += filter(None, [dtype_note])
    lines.append(
        f"  target ranks {split.target_ranks} (tensor parallel {split.target_tensor_parallel}, "
        f"{_placed(cfg, split.target_ranks, split.target_devices, trainer=False)})"
    )
    lines.append(
        f"  trainer ranks {split.trainer_ranks} (strategy {cfg.train.strategy}, "
        f"{_placed(cfg, split.trainer_ranks, split.trainer_devices, trainer=True)})"
    )
    if split.target_tensor_parallel > 1:
        from draftforge.splitserve.roles import tensor_parallel_groups

        for group in tensor_parallel_groups(split):
            lines.append(f"  target ranks {group}: one SGLang tensor-parallel group, led by rank "
                         f"{group[0]} (its engine and feature runner run tensor-parallel over the group)")
    for producer in topology.producers:
        lines.append(f"  target rank {producer} feeds trainer ranks {topology.dests(producer)}")
    lines += filter(None, [uneven_feed_note(topology, split.target_tensor_parallel)])
    lines.append(
        f"  credits: {split.max_in_flight} samples in flight per trainer{_shared_credits(split, topology)}; "
        f"batches of {split.token_budget} padded tokens"
    )
    lines += filter(None, [_reuse_note(cfg, topology)])
    trainer = trainer_estimate(cfg, with_emb, without_emb, meta_draft=meta_draft)
    lines += [
        "",
        f"draft parameters: {with_emb:,} with embeddings, {without_emb:,} without "
        f"(trainable; embed_tokens and lm_head are the target's, frozen)",
        *filter(None, [_rope_note(cfg), _zero_stage_note(cfg)]),
        "",
        "memory estimate per target rank:",
        *target_estimate(cfg).lines(),
        *filter(None, [sglang_pool_note(cfg)]),
        "memory estimate per trainer rank:",
        *trainer.lines(),
    ]
    lines += filter(None, [short_sample_note(cfg), bigram_note(cfg, trainer)])
    return "\n".join(lines)


# a step's own allocations: none of them exists while the trainer starts
STEP_ITEMS = ("gradients", "AdamW moments", "batch features", "context + backbone activations",
              "objective chunk", "objective's W2 gradient")


def bigram_note(cfg: RecipeConfig, trainer: Estimate) -> str | None:
    """With ``train.markov_init: bigram``, the start-up table against what it coexists with."""
    if cfg.train.markov_init != "bigram":
        return None
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.markov_init import MAX_TOKENS, OVERSAMPLE

    side = min(MAX_TOKENS, resolve_target_shape(cfg.target).vocab_size)
    # train/markov_init.py: the float64 table, built in place, and the randomised SVD's work
    # beside it, about four [side, rank + OVERSAMPLE] float64 matrices (a rise of 0.53 GiB
    # resident measured after the table at 8192^2, rank 256, and 0.61 GiB after its SVD)
    table = side * side * 8 + 4 * side * (cfg.draft.markov_rank + OVERSAMPLE) * 8
    later = sum(v for name, v in trainer.items if name.startswith(STEP_ITEMS))
    verdict = ("within the total above" if table <= later else
               f"so the trainer's peak may be up to {(table - later) / GIB:.3f} GiB above the total")
    return (f"    train.markov_init bigram: at start-up the trainer holds a float64 bigram table of up "
            f"to {side:,} x {side:,} tokens and its SVD, up to {table / GIB:.3f} GiB, before the "
            f"first step allocates its gradients, AdamW moments and activations "
            f"({later / GIB:.3f} GiB): {verdict}")
