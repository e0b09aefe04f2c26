"""Recipe cross checks: the checks that need more than one section (the target's shape
against the draft, the process split, data settings), which also fill in derived values."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from draftforge.recipe_errors import KeyPath
from draftforge.splitserve.registry import KNOWN_TARGETS, DraftNotTarget, resolve_target_shape
from draftforge.train.config import warmup_steps

if TYPE_CHECKING:
    from draftforge.config import RecipeConfig
    from draftforge.splitserve.config import TargetShape

# (key path, what is wrong) or (key path, what is wrong, related key paths): see _Locator.line
Problem = tuple[KeyPath, str] | tuple[KeyPath, str, tuple[KeyPath, ...]]


def _check_target(cfg: RecipeConfig) -> tuple[TargetShape | None, list[Problem]]:
    """Resolve the target's shape; check a declared shape against the known one."""
    target = cfg.target
    problems: list[Problem] = []
    try:
        shape = resolve_target_shape(target, strict=True)
    except DraftNotTarget as exc:  # no shape declared makes it a target
        return None, [(("target", "model"), str(exc))]
    except (OSError, ValueError) as exc:
        return None, [(("target", "model"), (
            f"cannot use the target's config.json: {exc}; declare the target's shape under "
            "target.shape"))]
    if (target.shape is None and target.model != "random" and target.model not in KNOWN_TARGETS
            and not Path(target.model).expanduser().is_dir()):
        names = ", ".join([*KNOWN_TARGETS, "random"])
        return None, [(("target", "model"), (
            f"{target.model!r} is neither a registered name ({names}) nor an existing local "
            "folder; for a dry run without the target's weights, declare target.shape"))]
    if shape is None:  # an existing folder without a config.json: its parent, a hub cache's root
        config_json = Path(target.model).expanduser() / "config.json"
        return None, [(("target", "model"), (
            f"{target.model!r} holds no config.json ({config_json} is not a file), so the "
            "target's shape is unknown and the draft cannot be checked against it; point "
            "target.model at the folder with the model's config.json, or declare target.shape"))]
    if target.shape is None and shape is not None and target.model not in KNOWN_TARGETS:
        # a local folder's shape, recorded like a declared one: a run's config.yaml then
        # reloads (export, eval) on a machine without that folder
        target.shape = shape
    elif target.shape is not None and target.model != "random":
        try:
            known = resolve_target_shape(target.model_copy(update={"shape": None}))
        except DraftNotTarget as exc:
            return None, [(("target", "model"), str(exc))]
        except (OSError, ValueError):
            known = None
        if known is not None:
            # only against what the target's config gives: a field it leaves out holds the
            # section's placeholder default, not the target's value (declaring it is the fix)
            for field in sorted(target.shape.model_fields_set & known.model_fields_set):
                declared, real = getattr(target.shape, field), getattr(known, field)
                if real is not None and declared != real:
                    problems.append(
                        (
                            ("target", "shape", field),
                            f"{declared!r} differs from {target.model}'s {field} {real!r}; "
                            "remove it or fix it",
                        )
                    )
            # a config.json without head_dim (Llama's, Qwen2's) means hidden / heads: a
            # declared one is checked against that
            derivable = {"hidden_size", "num_attention_heads"} <= known.model_fields_set
            if ("head_dim" in target.shape.model_fields_set and target.shape.head_dim is not None
                    and known.head_dim is None and derivable):
                real = known.hidden_size // known.num_attention_heads
                if target.shape.head_dim != real:
                    problems.append((("target", "shape", "head_dim"), (
                        f"{target.shape.head_dim!r} differs from {target.model}'s head_dim {real} "
                        f"(its config.json gives none, so hidden_size {known.hidden_size} / "
                        f"num_attention_heads {known.num_attention_heads}); remove it or fix it")))
            # The resolved recipe (config.yaml of a run) records the whole shape the run
            # used, so that reloading it, as export does, compares real values only.
            target.shape = shape
    if target.model == "random" and shape is not None:
        if shape.head_dim is None and shape.hidden_size % shape.num_attention_heads:
            problems.append(
                (
                    ("target", "shape", "hidden_size"),
                    f"{shape.hidden_size} is not divisible by num_attention_heads "
                    f"{shape.num_attention_heads}",
                )
            )
        if shape.num_attention_heads % shape.num_key_value_heads:
            problems.append(
                (
                    ("target", "shape", "num_key_value_heads"),
                    f"{shape.num_key_value_heads} does not divide num_attention_heads "
                    f"{shape.num_attention_heads}",
                )
            )
    return shape, problems


def _rope_theta_known(target) -> bool:
    """Whether the resolved shape's rope_theta is the target's: false when its config.json
    cannot be read here (a node without the target's folder) or gives no RoPE base (none
    written, or only per-layer-type ones without a full_attention entry) and target.shape
    does not declare it, where it is only the section's default."""
    if target.model == "random" or (target.shape is not None
                                    and "rope_theta" in target.shape.model_fields_set):
        return True
    try:
        known = resolve_target_shape(target.model_copy(update={"shape": None}))
    except (OSError, ValueError):
        return False
    return known is not None and "rope_theta" in known.model_fields_set


def _check_draft(cfg: RecipeConfig, shape: TargetShape | None) -> list[Problem]:
    """Check the draft against itself and the target; derive head_dim, rope and positions."""
    draft = cfg.draft
    problems: list[Problem] = []
    ids_path = ("draft", "target_layer_ids")
    ids = draft.target_layer_ids
    if not ids:
        problems.append((ids_path, "must list at least one target layer"))
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        problems.append((ids_path, f"duplicate layer ids {duplicates}"))
    for index, layer in enumerate(ids):
        if layer < 0:
            problems.append(
                (ids_path + (index,), f"layer id {layer} is negative; ids are 0-indexed")
            )
        elif shape is not None and layer >= shape.num_hidden_layers - 1:
            last = shape.num_hidden_layers - 1
            if layer == last:
                why = (
                    f"layer id {layer} is the target's final layer, which is not allowed "
                    f"(its output is the final-hidden stream)"
                )
            else:
                why = f"layer id {layer} is out of range: the target has {shape.num_hidden_layers} layers"
            valid = (f"valid ids are 0..{last - 1}" if last >= 1 else
                     "a target of one layer has none: the draft needs a layer before the final one")
            problems.append((ids_path + (index,), f"{why}; {valid}",
                             (("target", "shape", "num_hidden_layers"), ("target", "model"))))

    if draft.max_position_embeddings is not None and draft.max_position_embeddings < cfg.data.max_length:
        problems.append(
            (
                ("draft", "max_position_embeddings"),
                f"{draft.max_position_embeddings} is below data.max_length {cfg.data.max_length}: "
                "training would place anchors at positions the draft does not support (and eval "
                "refuses them); raise it, leave it unset for the target's, or lower data.max_length",
            )
        )
    if shape is not None:
        if draft.mask_token_id >= shape.vocab_size:
            problems.append(
                (
                    ("draft", "mask_token_id"),
                    f"{draft.mask_token_id} is outside the target vocabulary "
                    f"(vocab_size {shape.vocab_size}); pick an existing, unused token id",
                    (("target", "shape", "vocab_size"), ("target", "model")),
                )
            )
        if draft.hidden_size != shape.hidden_size:
            problems.append(
                (
                    ("draft", "hidden_size"),
                    f"{draft.hidden_size} differs from the target's hidden_size "
                    f"{shape.hidden_size}; the draft uses the target's embedding and lm_head, "
                    "so they must match",
                    (("target", "shape", "hidden_size"), ("target", "model")),
                )
            )
        if draft.rope_theta is None and _rope_theta_known(cfg.target):
            draft.rope_theta = shape.rope_theta  # else None: splitserve.registry.rope_theta_problem
        # known from the target's config.json, target.shape or the registry; the section's
        # default is the target's own only for model: random, which is built from it
        positions_known = (cfg.target.model == "random"
                           or "max_position_embeddings" in shape.model_fields_set)
        if draft.max_position_embeddings is None and positions_known:
            draft.max_position_embeddings = shape.max_position_embeddings
        elif draft.max_position_embeddings is None:
            folder = Path(cfg.target.model).expanduser()
            config_json = folder / "config.json"
            serve = (f"the longest position the draft is to serve (at least data.max_length "
                     f"{cfg.data.max_length}; it becomes the export's max_position_embeddings and "
                     "bounds eval's prompts)")
            if not folder.exists():
                # A mistyped path read as a missing setting: the folder comes first. It is not
                # refused for itself: on several nodes it may be on the target's node alone.
                problems.append(
                    (
                        ("target", "model"),
                        f"no folder {cfg.target.model} on this machine (a typo? or the "
                        "target's folder on another node), so the target's "
                        "max_position_embeddings is not known here (target.shape does not declare "
                        "it) and draft.max_position_embeddings is not set: fix the path; for a "
                        "folder that is on the target's node only, set draft.max_position_embeddings "
                        f"to {serve}, or declare target.shape.max_position_embeddings, in the "
                        "recipe or on every node (the nodes' draft sections must agree)",
                        (("draft", "max_position_embeddings"),),
                    )
                )
            else:
                why = (f"{config_json} gives none" if config_json.is_file()
                       else f"{config_json} cannot be read here")
                problems.append(
                    (
                        ("draft", "max_position_embeddings"),
                        f"not set, and the target's is not known ({why} and target.shape does not "
                        f"declare max_position_embeddings): set it to {serve}, or declare "
                        "target.shape.max_position_embeddings",
                    )
                )
        if positions_known and cfg.data.max_length > shape.max_position_embeddings:
            problems.append(
                (
                    ("data", "max_length"),
                    f"{cfg.data.max_length} is beyond the target's max_position_embeddings "
                    f"{shape.max_position_embeddings}: its features past that are not ones it "
                    "serves; lower data.max_length",
                    (("target", "shape", "max_position_embeddings"), ("target", "model")),
                )
            )

    if draft.head_dim is None:
        if draft.hidden_size % draft.num_attention_heads:
            problems.append(
                (
                    ("draft", "hidden_size"),
                    f"{draft.hidden_size} is not divisible by num_attention_heads "
                    f"{draft.num_attention_heads}; change one or set draft.head_dim",
                    (("draft", "num_attention_heads"),),
                )
            )
        else:
            draft.head_dim = draft.hidden_size // draft.num_attention_heads
    if draft.head_dim is not None and draft.head_dim % 2:
        problems.append(
            (
                ("draft", "head_dim"),
                f"{draft.head_dim} is odd (hidden_size / num_attention_heads unless set); RoPE "
                "rotates the two halves of each head, so it must be even",
                (("draft", "hidden_size"), ("draft", "num_attention_heads")),
            )
        )
    if draft.attention_backend == "flex":
        from draftforge.train.model import FLEX_MIN_HEAD_DIM

        if cfg.train.device == "cpu":
            problems.append(
                (
                    ("draft", "attention_backend"),
                    "flex cannot train with train.device: cpu (torch's flex attention has no "
                    "backward on the CPU); use draft.attention_backend: sdpa, or train on a GPU",
                )
            )
        elif draft.head_dim is not None and draft.head_dim < FLEX_MIN_HEAD_DIM:
            problems.append(
                (
                    ("draft", "attention_backend"),
                    f"flex needs draft.head_dim >= {FLEX_MIN_HEAD_DIM} (the minimum of its compiled "
                    f"CUDA kernel), this draft's is {draft.head_dim}; use draft.attention_backend: "
                    "sdpa or a larger head_dim",
                )
            )
    if draft.num_attention_heads % draft.num_key_value_heads:
        problems.append(
            (
                ("draft", "num_key_value_heads"),
                f"{draft.num_key_value_heads} does not divide num_attention_heads "
                f"{draft.num_attention_heads}",
                (("draft", "num_attention_heads"),),
            )
        )
    if (
        draft.markov_rank == 0
        and draft.enable_confidence_head
        and draft.confidence_head_with_markov
    ):
        problems.append(
            (
                ("draft", "markov_rank"),
                "0 disables the Markov head, but the confidence head is set to read the Markov "
                "embedding; set draft.confidence_head_with_markov: false, or "
                "draft.enable_confidence_head: false for the DFlash ablation",
            )
        )
    if cfg.train.markov_init == "bigram" and cfg.train.init_from is not None:
        problems.append(
            (
                ("train", "markov_init"),
                "bigram would replace the Markov head that train.init_from loads; set "
                "train.markov_init: random to keep the export's, or leave train.init_from out",
            )
        )
    if cfg.train.markov_init == "bigram" and not draft.has_markov_table:
        problems.append(
            (
                ("train", "markov_init"),
                "bigram fills the Markov head's W1/W2 table, which needs draft.markov_rank > 0 "
                f"and a vanilla or gated head (this draft: rank {draft.markov_rank}, "
                f"{draft.markov_head_type}); set train.markov_init: random",
            )
        )
    if cfg.data.max_length > cfg.split.token_budget:
        problems.append(
            (
                ("split", "token_budget"),
                f"{cfg.split.token_budget} is less than data.max_length {cfg.data.max_length}: "
                "a sample that long would make a micro-batch over the budget on its own; raise "
                "split.token_budget or lower data.max_length",
                (("data", "max_length"),),
            )
        )
    loss = cfg.train.loss
    if loss.ce_weight == 0 and loss.tv_weight == 0 and loss.kl_weight == 0:
        problems.append(
            (
                ("train", "loss", "tv_weight"),
                "0 with ce_weight and kl_weight 0 as well: nothing would train the draft's "
                "predictions (the confidence head's BCE only fits the head); give one of the "
                "three a positive weight",
            )
        )
    warmup = warmup_steps(cfg.train)
    if warmup >= cfg.train.steps:
        problems.append(
            (
                ("train", "warmup_ratio"),
                f"{cfg.train.warmup_ratio:g} of {cfg.train.steps} steps is {warmup} warmup steps, "
                "which leaves none for the cosine decay: the run would end at the peak learning "
                "rate; lower train.warmup_ratio or raise train.steps",
                (("train", "steps"),),
            )
        )
    if cfg.train.loss.position_weighting == "dpace" and cfg.train.grad_accum > 1:
        problems.append(
            (
                ("train", "grad_accum"),
                f"{cfg.train.grad_accum} micro-batches with train.loss.position_weighting: dpace: "
                "D-PACE weights depend on the draft's own acceptance, so the step's weight sum is "
                "known only after every micro-batch's forward, and each would be normalised "
                "alone; use position_weighting: exp, or a larger split.token_budget instead of "
                "accumulation",
            )
        )
    return problems


def _check_split(cfg: RecipeConfig) -> list[Problem]:
    """Derive trainer_ranks / world_size; check the split covers 0..world_size-1 exactly."""
    split = cfg.split
    problems: list[Problem] = []
    target = split.target_ranks
    for key, ranks in (("target_ranks", target), ("trainer_ranks", split.trainer_ranks or [])):
        negative = [r for r in ranks if r < 0]
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if negative:
            problems.append((("split", key), f"ranks must be >= 0, got {negative}"))
        if repeated:
            problems.append((("split", key), f"duplicate ranks {repeated}"))
    if not target:
        problems.append((("split", "target_ranks"), "the target group needs at least one rank"))
    if problems:
        return problems

    if split.trainer_ranks is None:
        world = split.world_size
        if world is None:  # one trainer rank, or one for each GPU trainer_devices names
            world = len(target) + (len(split.trainer_devices) if split.trainer_devices else 1)
        split.trainer_ranks = [r for r in range(world) if r not in target]
    if split.world_size is None:
        split.world_size = len(target) + len(split.trainer_ranks)
    if split.max_in_flight is None:
        # fewer credits than a step packs samples: the target cannot work ahead of the
        # trainer's step, and both wait in turn (an audit measured 20 % trainer idle)
        per_step = max(1, split.token_budget // cfg.data.max_length) * cfg.train.grad_accum
        producers = max(1, len(target) // split.target_tensor_parallel)
        split.max_in_flight = max(4, producers, 2 * per_step)
    trainer, world = split.trainer_ranks, split.world_size

    if not trainer:
        problems.append(
            (
                ("split", "trainer_ranks"),
                f"the trainer group is empty (world_size {world}, target_ranks {target}); "
                "raise split.world_size or list split.trainer_ranks",
            )
        )
    overlap = sorted(set(target) & set(trainer))
    if overlap:
        problems.append(
            (
                ("split", "trainer_ranks"),
                f"ranks {overlap} are in both target_ranks and trainer_ranks",
            )
        )
    covered = set(target) | set(trainer)
    if not overlap and covered != set(range(world)):
        missing = sorted(set(range(world)) - covered)
        extra = sorted(covered - set(range(world)))
        detail = []
        if missing:
            detail.append(f"ranks {missing} are in neither group")
        if extra:
            detail.append(f"ranks {extra} are >= world_size")
        problems.append(
            (
                ("split", "world_size"),
                f"{world}: target_ranks and trainer_ranks must together cover 0..{world - 1} "
                f"exactly ({'; '.join(detail)})",
                # located where the ranks were given when world_size is left to its default
                (("split", "trainer_ranks"), ("split", "target_ranks")),
            )
        )
    if not problems:
        from draftforge.splitserve.multinode import node_problems

        problems += node_problems(split)
    if len(target) % split.target_tensor_parallel:
        problems.append(
            (
                ("split", "target_tensor_parallel"),
                f"{split.target_tensor_parallel} does not divide the target group size {len(target)}",
            )
        )
    for key, ranks in (("target_devices", target), ("trainer_devices", trainer)):
        devices = getattr(split, key)
        if devices is not None and len(devices) != len(ranks):
            group = key.split("_")[0]
            problems.append(
                (
                    ("split", key),
                    f"lists {len(devices)} device(s) for {len(ranks)} {group} rank(s); give one per rank",
                )
            )
    return problems


def _check_data(cfg: RecipeConfig) -> list[Problem]:
    """Data settings that no sample could meet, or that training would ignore."""
    data = cfg.data
    problems: list[Problem] = []
    if data.min_loss_tokens >= data.max_length:
        problems.append(
            (
                ("data", "min_loss_tokens"),
                f"{data.min_loss_tokens} is not below data.max_length {data.max_length}: a sample "
                "also holds its prompt, so none would have that many supervised tokens and every "
                "one would be dropped; lower data.min_loss_tokens",
                (("data", "max_length"),),
            )
        )
    if data.regenerated_file is not None and not data.regenerate:
        problems.append(
            (
                ("data", "regenerated_file"),
                f"{data.regenerated_file} is read only with data.regenerate: true; with false the "
                "draft trains on the replies of data.train_files as they are and this file would "
                "be ignored: set data.regenerate: true to train on its answers, or remove it",
            )
        )
    if data.regenerate:
        from draftforge.data.loading import regenerated_path

        answers = regenerated_path(data, cfg.train.output_dir).absolute()
        for spec in data.train_files:
            if not spec.startswith("builtin:") and Path(spec).expanduser().absolute() == answers:
                key = ("data", "regenerated_file") if data.regenerated_file is not None else ("data", "train_files")
                what = "data.regenerated_file" if data.regenerated_file is not None else \
                    "<train.output_dir>/regenerated.jsonl, where the answers go by default,"
                problems.append((key, (
                    f"{what} {answers} is also one of data.train_files, the prompts it answers: "
                    "regeneration would write the answers over the prompts (and 'draftforge demo "
                    "--force' delete them); give the answers another path"), (("data", "train_files"),)))
    return problems


def _cross_check(cfg: RecipeConfig) -> list[Problem]:
    shape, problems = _check_target(cfg)
    problems += _check_draft(cfg, shape)
    problems += _check_data(cfg)
    problems += _check_split(cfg)
    return problems
