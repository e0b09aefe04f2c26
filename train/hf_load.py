"""Load an exported DSpark folder back into draftforge's ``DSparkDraft`` (the twin of ``export``).

Safetensors only; single file or sharded with an index. The tensors are checked
against the same key table the exporter uses. Exports without embeddings (the
default: servers attach the target's), or with only one of the two, take the
``embed_tokens`` / ``lm_head`` they lack from the target, passed as tensors or as a
``TargetEngine``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from draftforge.errors import InputError
from draftforge.hf_config import json_number, rope_theta_of
from draftforge.train.export import (
    ARCHITECTURES,
    CONFIG_FILE,
    EMBEDDING_KEYS,
    INDEX_FILE,
    SINGLE_FILE,
    ExportError,
    check_tensors,
    draft_fingerprint,
    read_safetensors_file,
)
from draftforge.train.model import DSparkConfig, DSparkDraft

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_serving_config(folder: str | os.PathLike[str]) -> dict:
    """The exported ``config.json`` as a dict, with a clear error when absent or malformed."""
    path = Path(folder).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{path.parent}: no {CONFIG_FILE}; is it a draftforge export folder?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err
    except UnicodeDecodeError as err:
        raise ExportError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); export the draft again") from None
    if not isinstance(raw, dict):
        raise ExportError(f"{path}: a model config must be a JSON object, not a {type(raw).__name__}")
    return raw


def _flag(raw: dict, key: str, default: bool) -> bool:
    """A JSON true/false field (``bool("false")`` would be True: a hand-edited string is refused)."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _integer(raw: dict, key: str, default: int | None = None) -> int:
    """A JSON integer field. ``int()`` would read ``"8"``, cut ``8.7`` to 8 and ``true`` to 1, and
    say ``invalid literal for int()`` without the key: each is refused, naming the key. So is
    ``8.0``: servers read config.json as it is, and a float size breaks their shapes."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _integers(raw: dict, key: str) -> list[int]:
    """A JSON list of integers (``target_layer_ids``), refused naming the key otherwise."""
    values = raw[key]
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{key} must be a list of integers, got {values!r}")
    return list(values)


def _number(raw: dict, key: str, default: float) -> float:
    """A JSON number field, refused naming the key where it is a string, a bool or null."""
    return json_number(raw.get(key, default), key)


def config_from_serving(raw: dict, *, where: str = CONFIG_FILE) -> DSparkConfig:
    """The ``DSparkConfig`` described by an exported config.json.

    The four DFlash fields may be top-level or, as SGLang also accepts, nested under
    ``dflash_config``; where both are given they must agree. RoPE scaling is refused: the
    draft implements plain RoPE, so a scaled config would load into a model whose logits
    differ from the server's. So are an activation, attention biases or an architecture the
    draft does not implement (:func:`_check_implemented`).
    """
    _check_implemented(raw, where)
    raw = _with_dflash_fields(raw, where)
    _check_sglang_reads_the_same(raw, where)
    rope_theta = _plain_rope_theta(raw, where)
    if rope_theta is not None and not rope_theta > 0:  # 0 was read as absent: another draft
        raise ExportError(f"{where}: rope_theta must be a positive number, got {rope_theta}")
    required = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "intermediate_size", "num_target_layers", "target_layer_ids",
        "block_size", "mask_token_id", "markov_rank",
    )  # fmt: skip
    missing = [key for key in required if key not in raw]
    if missing:
        raise ExportError(f"{where}: missing DSpark fields: {', '.join(missing)}")
    try:
        _check_layer_order(_integers(raw, "target_layer_ids"))
        markov_rank = _integer(raw, "markov_rank")
        return DSparkConfig(
            vocab_size=_integer(raw, "vocab_size"),
            hidden_size=_integer(raw, "hidden_size"),
            num_hidden_layers=_integer(raw, "num_hidden_layers"),
            num_attention_heads=_integer(raw, "num_attention_heads"),
            num_key_value_heads=_integer(raw, "num_key_value_heads"),
            intermediate_size=_integer(raw, "intermediate_size"),
            target_hidden_size=_integer(raw, "target_hidden_size", raw["hidden_size"]),
            num_target_layers=_integer(raw, "num_target_layers"),
            target_layer_ids=_integers(raw, "target_layer_ids"),
            # an absent key is Qwen3Config's default, as servers read the file (128, not hidden /
            # heads); an explicit null is hidden / heads, as before
            head_dim=None if "head_dim" in raw and raw["head_dim"] is None
            else _integer(raw, "head_dim", QWEN3_HEAD_DIM),
            block_size=_integer(raw, "block_size"),
            mask_token_id=_integer(raw, "mask_token_id"),
            markov_rank=markov_rank,
            markov_head_type=raw.get("markov_head_type", "vanilla"),  # DSparkConfig names a wrong one
            # SGLang's default (build_confidence_head warns and takes the head as enabled)
            enable_confidence_head=_flag(raw, "enable_confidence_head", True),
            # SGLang's default (build_confidence_head): the head reads the Markov embedding
            confidence_head_with_markov=_flag(raw, "confidence_head_with_markov", markov_rank > 0),
            rope_theta=rope_theta or 10000.0,
            rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=_integer(raw, "max_position_embeddings", QWEN3_MAX_POSITIONS),
        )
    except (TypeError, ValueError) as err:
        raise ExportError(f"{where}: {err}") from err


# transformers' Qwen3Config defaults, which servers get for a key config.json leaves out
QWEN3_HEAD_DIM = 128
QWEN3_MAX_POSITIONS = 32768
DFLASH_FIELDS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id")


def _check_implemented(raw: dict, where: str) -> None:
    """Refuse a config.json describing a model draftforge's draft is not: SiLU MLPs, attention
    without biases (``serving_config`` writes ``hidden_act: silu``, ``attention_bias: false``),
    and one of the architectures ``draftforge export --arch`` writes. A server builds what the
    file says (SGLang's Qwen3 layers take ``hidden_act`` and ``attention_bias`` from it), so a
    draft loaded regardless would silently be another model than the one it serves. An absent
    key means the Qwen3 default (``silu``, no biases); an absent or null ``architectures`` is
    left to the server."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ExportError(
            f"{where}: hidden_act is {act!r}, but draftforge's draft implements 'silu' only (what "
            "draftforge export writes); a server would build another model than the one loaded"
        )
    bias = raw.get("attention_bias", False)
    if bias is not False:
        raise ExportError(
            f"{where}: attention_bias is {bias!r}, but draftforge's draft has no attention biases: "
            "only false is supported (what draftforge export writes)"
        )
    _check_attention_implemented(raw, where)
    if raw.get("speculators_model_type") == "dspark":
        raise ExportError(
            f"{where}: speculators_model_type is 'dspark', which SGLang's DSPARK loader refuses: "
            "it reads the DSpark fields from config.json itself; remove the key (draftforge export "
            "never writes it)"
        )
    arch = raw.get("architectures")
    if arch is not None and (not isinstance(arch, list) or len(arch) != 1 or arch[0] not in ARCHITECTURES):
        valid = " or ".join(f'["{name}"]' for name in ARCHITECTURES)
        raise ExportError(
            f"{where}: architectures is {json.dumps(arch)}, but a DSpark draft's is {valid} "
            "(what draftforge export --arch writes)"
        )


def _check_attention_implemented(raw: dict, where: str) -> None:
    """Refuse attention draftforge's draft does not implement, which servers read from config.json
    (llama.cpp's converter: ``partial_rotary_factor``, ``use_sliding_window`` with
    ``sliding_window``, ``layer_types``, ``dflash_config.use_swa``, ``is_causal`` /
    ``dflash_config.causal``): RoPE over part of each head (drafts for Qwen3.5-family targets), a
    sliding window or causal attention inside the block would load into a draft whose logits
    differ from the server's. ``draftforge export`` writes none of them."""
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    rope = [(key, raw[key]) for key in ("rope_parameters", "rope_scaling") if isinstance(raw.get(key), dict)]
    for key, value in [("partial_rotary_factor", raw.get("partial_rotary_factor")),
                       *((f"{name}.partial_rotary_factor", spec.get("partial_rotary_factor")) for name, spec in rope)]:
        if value is not None and value != 1:  # fmt: skip
            raise ExportError(f"{where}: {key} is {value!r}, but draftforge's draft rotates whole heads "
                              "(RoPE over every head dimension, what draftforge export writes); a server "
                              "would rotate part of each head and compute other logits")
    layer_types = raw.get("layer_types")
    other_layers = isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types)
    asked = {  # key -> (its value, whether it asks for other attention)
        "use_sliding_window": (raw.get("use_sliding_window"),
                               bool(raw.get("use_sliding_window") and raw.get("sliding_window"))),
        "layer_types": (layer_types, other_layers),
        "dflash_config.use_swa": (nested.get("use_swa"), bool(nested.get("use_swa"))),
        "is_causal": (raw.get("is_causal"), bool(raw.get("is_causal"))),
        "dflash_config.causal": (nested.get("causal"), bool(nested.get("causal"))),
    }
    for key, (value, other) in asked.items():
        if other:
            raise ExportError(f"{where}: {key} is {json.dumps(value)}, but draftforge's draft attends over "
                              "the whole context and bidirectionally inside the block (what draftforge "
                              "export writes); a server would build another attention than the one loaded")


def _check_layer_order(ids: list[int]) -> None:
    """Refuse ``target_layer_ids`` that are not strictly ascending. SGLang captures the target's
    layers once each, in ascending order, and its ``fc`` reads them as they come; llama.cpp
    concatenates them in the listed order. An export listing them otherwise (a duplicate, or an
    export written before draftforge sorted them) is a different draft to each server, so no
    draft loaded from it would be the one a server runs."""
    if ids != sorted(set(ids)):
        raise ValueError(
            f"target_layer_ids {ids} are not strictly ascending: SGLang captures each target layer "
            "once, in ascending order, and llama.cpp in the order listed, so the two servers would "
            "feed this draft's fc different features; export the training checkpoint again "
            "(draftforge export writes them ascending, with fc.weight's column blocks to match)"
        )


# Where SGLang's DSPARK loader reads a DSpark field before the top level (its
# parse_dspark_draft_config): a ``dspark_``-prefixed key, then ``dspark_config``, then
# ``text_config``. draftforge reads the top level, so a config.json whose other places say
# otherwise is refused rather than loaded as another draft than the served one.
_SGLANG_FIRST = {
    "markov_rank": ("dspark_markov_rank", "dspark_config.markov_rank", "text_config.markov_rank"),
    "markov_head_type": ("dspark_markov_head_type", "dspark_config.markov_head_type",
                         "text_config.markov_head_type"),
    "mask_token_id": ("dspark_noise_token_id", "dspark_config.mask_token_id", "text_config.mask_token_id"),
    "block_size": ("dspark_block_size",),
    "target_layer_ids": ("dspark_target_layer_ids",),
}


def _check_sglang_reads_the_same(raw: dict, where: str) -> None:
    """Refuse a config.json that SGLang reads as another draft than draftforge does: a DSpark
    field given where SGLang looks first (``_SGLANG_FIRST``) with another value than the top
    level's, no ``markov_head_type`` (SGLang refuses a Markov draft without one), or RoPE that is
    not NeoX-style (``rope_is_neox_style``/``is_neox_style`` false: the draft rotates halves)."""
    for field, places in _SGLANG_FIRST.items():
        for place in places:
            section, _, key = place.rpartition(".")
            holder = raw.get(section) if section else raw
            if not isinstance(holder, dict) or holder.get(key) is None:
                continue
            if holder[key] != raw.get(field):
                raise ExportError(
                    f"{where}: {place} is {holder[key]!r} but {field} is {raw.get(field)!r}: SGLang "
                    f"serves the {place} value, draftforge reads {field}; make them agree"
                )
    if "markov_head_type" not in raw and isinstance(raw.get("markov_rank"), int) and raw["markov_rank"] > 0:
        raise ExportError(
            f"{where}: no markov_head_type; SGLang's DSPARK loader refuses a draft with a Markov head "
            "without one: add \"markov_head_type\" (vanilla, gated or rnn)"
        )
    for key in ("rope_is_neox_style", "is_neox_style"):
        if key in raw and raw[key] is not True:
            raise ExportError(
                f"{where}: {key} is {raw[key]!r}, but draftforge's draft applies NeoX-style RoPE "
                "(rotating halves) only; a server would rotate interleaved pairs"
            )


def _with_dflash_fields(raw: dict, where: str) -> dict:
    """``raw`` with the DFlash fields of a nested ``dflash_config`` lifted to the top level."""
    nested = raw.get("dflash_config")
    if nested is None:
        return raw
    if not isinstance(nested, dict):
        raise ExportError(f"{where}: dflash_config must be an object, got {type(nested).__name__}")
    merged = dict(raw)
    for key in DFLASH_FIELDS:
        if key not in nested:
            continue
        if key in raw and raw[key] != nested[key]:
            raise ExportError(
                f"{where}: {key} is {raw[key]!r} at the top level but {nested[key]!r} in dflash_config; "
                "they must agree"
            )
        merged[key] = nested[key]
    return merged


def _plain_rope_theta(raw: dict, where: str) -> float | None:
    """The RoPE base of ``raw`` (None where it gives none); RoPE scaling is refused. A
    ``rope_scaling`` of type ``default`` is plain RoPE: newer transformers write a plain
    config's as ``{"rope_theta": ..., "rope_type": "default"}``, without a top-level ``rope_theta``."""
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    try:
        theta = rope_theta_of(raw)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
            if theta is None and scaling.get("rope_theta") is not None:
                theta = json_number(scaling["rope_theta"], "rope_scaling.rope_theta")
            scaling = None
    except ValueError as err:  # names the key
        raise ExportError(f"{where}: {err}") from None
    if isinstance(params, dict) and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling:
        raise ExportError(
            f"{where}: rope scaling {scaling!r} is not supported: draftforge's draft applies plain "
            "RoPE, so its logits would differ from a server's that scales; use a draft exported "
            "without rope_scaling"
        )
    return theta


def index_weight_map(index: Path, *, advice: str) -> dict[str, str]:
    """Tensor name -> shard file name of a safetensors index (``model.safetensors.index.json``),
    with every shard it names present beside it. A malformed index or a missing shard raises
    :class:`~draftforge.errors.InputError` naming the file, followed by ``advice`` (the
    caller's: what to do about it)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # ValueError: bad JSON or UTF-8
        raise InputError(f"{index}: not a valid safetensors index ({type(err).__name__}: {err}); {advice}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise InputError(f"{index}: not a valid safetensors index ('weight_map' is not an object of "
                         f"tensor names to file names); {advice}")
    for filename in sorted(set(weight_map.values())):
        if Path(filename).name != filename or filename in ("", ".", ".."):
            raise InputError(f"{index}: names shard {filename!r}, which is not a file name beside it "
                             f"(a path would read a file outside {index.parent}); {advice}")
        if not (index.parent / filename).is_file():
            raise InputError(f"{index.parent / filename}: listed in {index.name} but missing; {advice}")
    return weight_map


def read_safetensors_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of an export: ``model.safetensors`` or the shards its index names."""
    folder = Path(folder).expanduser()
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if index.is_file():
        weight_map = index_weight_map(index, advice="export the draft again")
        state: dict[str, torch.Tensor] = {}
        for filename in sorted(set(weight_map.values())):
            shard = read_safetensors_file(folder / filename)
            for name, tensor in shard.items():
                if weight_map.get(name) != filename:
                    listed = f"lists it in {weight_map[name]}" if name in weight_map else "does not list it"
                    raise ExportError(f"{folder / filename}: holds tensor {name}, but {index} {listed}; "
                                      "export the draft again")
                state[name] = tensor
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ExportError(
                f"{index}: tensors listed but absent from their shards: "
                + ", ".join(f"{name} (in {weight_map[name]})" for name in missing)
                + "; export the draft again"
            )
        return state
    if single.is_file():
        return read_safetensors_file(single)
    for path in (index, single):  # there, but no file: say so, not "neither"
        if path.is_symlink() and not path.exists():
            raise ExportError(f"{path} is a link to {os.readlink(path)}, which does not exist (a hub "
                              "cache whose blobs were removed?); restore it or export the draft again")
        if path.exists():
            raise ExportError(f"{path} is not a file (a folder?); export the draft again")
    pickled = sorted(p.name for p in folder.glob("*") if p.suffix in {".bin", ".pt", ".pth"})
    hint = f" (found pickled weights {pickled}: draftforge loads safetensors only)" if pickled else ""
    raise ExportError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def _check_dtypes(state: dict[str, torch.Tensor], folder: Path) -> None:
    """Refuse a tensor of a dtype no export has (draftforge writes float32, bfloat16 or
    float16), naming its file and key: ``load_state_dict`` would cast an integer, a bool or a
    float8 tensor to the draft's dtype without a word and load another draft than the file's."""
    wrong = sorted(name for name, tensor in state.items() if tensor.dtype not in _DTYPES.values())
    if not wrong:
        return
    index = folder / INDEX_FILE
    files = index_weight_map(index, advice="export the draft again") if index.is_file() else {}
    shown = "; ".join(f"{folder / files.get(name, SINGLE_FILE)}: {name} is {state[name].dtype}"
                      for name in wrong)
    raise ExportError(f"{shown}; an exported draft's tensors are {', '.join(_DTYPES)} "
                      "(draftforge export writes one of them); export the draft again")


def _check_finite(state: dict[str, torch.Tensor], folder: Path) -> None:
    """Refuse tensors holding NaN or infinity that drafting uses: the draft then proposes
    garbage, which the evaluator would measure as an acceptance length of 1 without a word.
    A confidence head's are said, not refused: drafting does not read it (full verification
    and the drafted tokens stay sound; a calibration refuses its logits)."""
    broken = sorted(name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all()))
    head = [name for name in broken if name.startswith("confidence_head.")]
    broken = [name for name in broken if name not in head]
    if head:
        print(f"warning: {folder}: {', '.join(head)} hold NaN or infinite values: the confidence head "
              "is unusable (threshold verification, calibration); drafting does not read it", flush=True)
    if broken:
        shown = ", ".join(broken[:5]) + (f" and {len(broken) - 5} more" if len(broken) > 5 else "")
        raise ExportError(f"{folder}: {shown} hold{'s' if len(broken) == 1 else ''} NaN or infinite "
                          "values, so the draft computes nothing usable (a training that diverged, or a "
                          "damaged file); export it again from a sound checkpoint")


def export_fingerprint(folder: str | os.PathLike[str]) -> str:
    """:func:`~draftforge.train.export.draft_fingerprint` of an export's tensors as stored (each
    read from its shard when the fingerprint asks for it, so one at a time): which weights an
    evaluation of the export measured, compared by ``draftforge export`` with those it writes."""
    from collections.abc import Mapping

    from safetensors import safe_open

    folder = Path(folder).expanduser()
    index = folder / INDEX_FILE
    where = (index_weight_map(index, advice="export the draft again") if index.is_file()
             else {name: SINGLE_FILE for name in _tensor_names(folder / SINGLE_FILE)})

    class Stored(Mapping):
        def __getitem__(self, name):
            with safe_open(str(folder / where[name]), framework="pt") as weights:
                return weights.get_tensor(name)

        def __iter__(self):
            return iter(where)

        def __len__(self):
            return len(where)

    return draft_fingerprint(Stored())


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as weights:
        return list(weights.keys())


def read_checked_export(folder: Path) -> tuple[dict, DSparkConfig, dict[str, torch.Tensor]]:
    """An export's ``config.json`` as read, the draft config it describes and its tensors, all
    checked (dtypes, finite values, the key table); each of ``embed_tokens.weight`` and
    ``lm_head.weight`` is optional (contract section 4). Raises :class:`ExportError`."""
    raw = read_serving_config(folder)
    cfg = config_from_serving(raw, where=str(folder / CONFIG_FILE))
    state = read_safetensors_folder(folder)
    _check_dtypes(state, folder)
    _check_finite(state, folder)
    if "enable_confidence_head" not in raw and not any(name.startswith("confidence_head.") for name in state):
        raise ExportError(
            f"{folder / CONFIG_FILE} has no enable_confidence_head, which SGLang takes as true (and "
            "then needs confidence_head.proj.*), and the folder holds no confidence head: add "
            '"enable_confidence_head": false to it (SGLang then serves it in static verify mode only)'
        )
    check_tensors(state, cfg, with_embeddings=any(name in state for name in EMBEDDING_KEYS),
                  optional=EMBEDDING_KEYS, where=str(folder))
    return raw, cfg, state


def load_exported_draft(
    folder: str | os.PathLike[str],
    *,
    target=None,
    embed_tokens: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> DSparkDraft:
    """Build the draft an export folder describes and load its tensors exactly.

    Each of ``embed_tokens.weight``/``lm_head.weight`` is optional in the folder (contract
    section 4): ``embed_tokens``/``lm_head`` (or ``target``'s) are used where given, as servers
    attach the target's whatever the folder holds (a folder copy that differs from them is
    noted), and the folder's own copy only where none is given; given ones of another shape
    than the config's vocabulary and hidden size are refused. ``dtype`` defaults to the
    export's.
    """
    folder = Path(folder).expanduser()
    raw, cfg, state = read_checked_export(folder)
    held = [name for name in EMBEDDING_KEYS if name in state]
    if target is not None:
        embed_tokens, lm_head = target.embed_tokens_weight(), target.lm_head_weight()
    for name, matrix in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
        # a draft of another target: refused also where the export holds its own copies
        if matrix is not None and tuple(matrix.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ExportError(
                f"{folder}: the target's {name} is {tuple(matrix.shape)}, but the draft's {CONFIG_FILE} "
                f"has vocab_size {cfg.vocab_size} and hidden_size {cfg.hidden_size}: the draft was "
                "trained for another target; pass the target it was trained against"
            )
    model = DSparkDraft(cfg)
    given = {"embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head}
    lacking = [name for name in EMBEDDING_KEYS if name not in state]
    if any(given[name] is None for name in lacking):
        what = (f"only {held[0]}, not {lacking[0]}" if held
                else "no embed_tokens/lm_head (exported without --with-embeddings)")
        raise ExportError(
            f"{folder} holds {what}; pass the target (or its embedding and lm_head) to load it"
        )
    # servers ignore the folder's copies and attach the target's (contract section 4): so does
    # loading, wherever the target's (or given) matrices are at hand; a copy that is not the
    # target's (another revision of it, say) is said, since serving would not use it either
    stale = [name for name in held if given[name] is not None
             and not torch.equal(state[name], given[name].detach().to(state[name].device, state[name].dtype))]
    if stale:
        print(f"draftforge: note: {folder}'s {' and '.join(stale)} differ from the target's; "
              "using the target's, as servers do", file=sys.stderr, flush=True)
    state = {**state, **{name: matrix.detach() for name, matrix in given.items() if matrix is not None}}
    load_dtype = dtype or _DTYPES.get(str(raw.get("torch_dtype")), next(iter(state.values())).dtype)
    model.to(load_dtype)
    model.load_state_dict({k: v.to(load_dtype) for k, v in state.items()}, strict=True)
    return model.to(device).eval()
