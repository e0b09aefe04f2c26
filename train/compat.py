"""Does a draft fit its target, and does a checkpoint fit the draft a recipe builds?

Both checks run before any training or evaluation starts and list every field
that differs, so a mismatch is refused with what to change instead of failing
deep inside a matmul (or, worse, training a draft no server can load).
"""

from __future__ import annotations

from draftforge.errors import InputError

# Fields of a draft's DSparkConfig that must agree for weights to be reused:
# everything that shapes a tensor or changes what the draft predicts (rope_theta sets
# the RoPE frequencies, rms_norm_eps every norm). Left out: max_position_embeddings,
# which changes no weight and no prediction (RoPE is computed from the positions, there
# is no position table); it only bounds the anchor positions inference accepts, so a
# run may resume with a longer limit.
SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "target_hidden_size", "num_target_layers",
    "target_layer_ids", "head_dim", "block_size", "mask_token_id", "markov_rank",
    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
    "rope_theta", "rms_norm_eps",
)  # fmt: skip


class DraftMismatchError(InputError):
    """A draft and a target (or a checkpoint and a recipe) do not fit together."""


def config_differences(saved: dict, current: dict, *, saved_name: str, current_name: str) -> list[str]:
    """``field: <saved_name> X, <current_name> Y`` for every shape field that differs."""
    out = []
    for key in SHAPE_FIELDS:
        if key in saved and key in current and saved[key] != current[key]:
            out.append(f"{key}: {saved_name} {saved[key]!r}, {current_name} {current[key]!r}")
    return out


def draft_target_differences(
    draft: dict, *, hidden_size: int, vocab_size: int, num_hidden_layers: int
) -> list[str]:
    """What stops a draft (its DSparkConfig as a dict) from running on a target of this shape."""
    out = []
    if draft.get("target_hidden_size", draft.get("hidden_size")) != hidden_size:
        out.append(f"hidden size: the draft reads target features of size "
                   f"{draft.get('target_hidden_size')}, the target's hidden_size is {hidden_size}")
    if draft.get("vocab_size") != vocab_size:
        out.append(f"vocabulary: the draft has {draft.get('vocab_size')} tokens, the target {vocab_size}")
    layers = list(draft.get("target_layer_ids") or [])
    beyond = [i for i in layers if not 0 <= int(i) < num_hidden_layers]
    if beyond:
        out.append(f"layer ids: the draft reads target layers {layers}, but {beyond} do not exist "
                   f"(the target has {num_hidden_layers} layers, ids 0..{num_hidden_layers - 1})")
    if draft.get("num_target_layers") not in (None, num_hidden_layers):
        out.append(f"num_target_layers: the draft was trained on a target of "
                   f"{draft.get('num_target_layers')} layers, this target has {num_hidden_layers}")
    return out


def check_draft_fits_target(draft: dict, *, draft_source: str, target_name: str, hidden_size: int,
                            vocab_size: int, num_hidden_layers: int) -> None:
    """Raise :class:`DraftMismatchError` listing every difference, or return quietly."""
    problems = draft_target_differences(draft, hidden_size=hidden_size, vocab_size=vocab_size,
                                        num_hidden_layers=num_hidden_layers)
    if problems:
        raise DraftMismatchError(
            f"the draft {draft_source} does not fit the target {target_name}:\n  "
            + "\n  ".join(problems)
            + "\nEvaluate it with the target it was trained against (its config.json records "
            "target_hidden_size, vocab_size and target_layer_ids)."
        )
