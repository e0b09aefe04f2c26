"""``train.init_from``: a run's draft starts from an exported DSpark folder's weights.

Further training of a draft that ``draftforge export`` (or another tool, in the contract's
format) wrote: the folder is read and checked as ``draftforge eval`` reads it (safetensors
only, the key table, finite tensors), its ``config.json`` must describe the draft the recipe's
``draft`` section builds, and its tensors replace the draft's initial weights before the
strategy shards them. The frozen embedding and lm_head stay the target's, as servers attach
them; the optimiser and the learning-rate schedule start afresh. A resumed run loads its
checkpoint instead, so this runs only at a run's first step.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch

from draftforge.errors import InputError
from draftforge.train.export import CONFIG_FILE, EMBEDDING_KEYS, ExportError, fc_in_layer_order
from draftforge.train.hf_load import config_from_serving, read_checked_export, read_serving_config

# what must agree between the export and the recipe's draft: every field that shapes a weight
# or changes what one means; a context limit and the attention kernel may differ
COMPARED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "target_hidden_size", "num_target_layers", "target_layer_ids",
            "block_size", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov", "rope_theta", "rms_norm_eps")


def check_fits(folder: str, model_config: dict | None) -> None:
    """Refuse, naming ``train.init_from``, a folder that is not an export or whose
    ``config.json`` describes another draft than ``model_config`` (the recipe's, as a dict of
    the fields known; None where it is not known yet, and only the folder is checked), before
    anything starts (:func:`preflight_fit`); :func:`init_from_export` compares alike where the
    weights load."""
    path, key = _export_folder(folder)
    try:
        raw = read_serving_config(path)
        cfg = config_from_serving(raw, where=str(path / CONFIG_FILE))
    except ExportError as err:
        raise InputError(f"{key}: {err}") from None
    if model_config is not None:
        _refuse_another_draft(key, raw, cfg, model_config)


def _refuse_another_draft(key: str, raw: dict, cfg, model_config: dict) -> None:
    """Refuse an export (its ``config.json`` as read, ``raw``, and the draft config it describes)
    of another draft than ``model_config``, naming each field that differs."""
    ours, theirs = _as_weights_read_it(model_config), _as_weights_read_it(asdict(cfg))
    if "enable_confidence_head" not in raw:  # SGLang's default; the weights say (read_checked_export)
        for name in ("enable_confidence_head", "confidence_head_with_markov"):
            ours.pop(name, None)
    differ = [f"{name} {theirs[name]!r} (the recipe's draft: {ours[name]!r})"
              for name in COMPARED if name in ours and theirs[name] != ours[name]]
    if differ:
        raise InputError(f"{key} holds another draft than the recipe's draft section builds: "
                         f"{'; '.join(differ)}. Set the draft section to the export's values "
                         f"(its {CONFIG_FILE}), or start from another export")


def _export_folder(folder: str) -> tuple[Path, str]:
    """The folder and ``train.init_from``'s words for it; refused unless it holds a config.json."""
    path, key = Path(folder), f"train.init_from {folder}"
    if not (path / CONFIG_FILE).is_file():
        raise InputError(f"{key}: no {CONFIG_FILE} there, so it is not an exported draft; give the folder "
                         "draftforge export wrote (a training checkpoint is continued with train.resume)")
    return path, key


def _as_weights_read_it(config: dict) -> dict:
    """The compared fields of a draft config, as its weights mean them: the confidence head
    reads the Markov embedding only where there is a head (an export writes the flag so), and
    the target layers as a set, an export listing them ascending with ``fc``'s columns
    permuted to match (:func:`init_from_export` puts them back in the recipe's order)."""
    known = {name: config[name] for name in COMPARED if name in config}
    if "confidence_head_with_markov" in known:
        known["confidence_head_with_markov"] = bool(config.get("enable_confidence_head", True)
                                                    and config["confidence_head_with_markov"])
    if "target_layer_ids" in known:
        known["target_layer_ids"] = sorted(known["target_layer_ids"])
    return known


def preflight_fit(cfg) -> None:
    """:func:`check_fits` before anything starts, against the draft the recipe builds where the
    target's shape is known without loading it (its rope base only where the draft section
    sets one: else the target's, read when it loads)."""
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config

    shape = resolve_target_shape(cfg.target)
    if shape is None:
        check_fits(cfg.train.init_from, None)
        return
    known = cfg.draft if cfg.draft.rope_theta is not None else cfg.draft.model_copy(update={"rope_theta": 1.0})
    built = asdict(build_dspark_config(known, shape, vocab_size=shape.vocab_size))
    if cfg.draft.rope_theta is None:
        del built["rope_theta"]
    check_fits(cfg.train.init_from, built)


def init_from_export(model, folder: str) -> str:
    """Load the export at ``folder`` into ``model`` (a freshly built ``DSparkDraft`` holding the
    target's embeddings); returns a line for the log. Refuses, naming ``train.init_from``, a
    folder that is not an export, a damaged one, or one of another draft than ``model``'s."""
    path, key = _export_folder(folder)
    try:  # the weights first: a config.json without enable_confidence_head is judged by them
        raw, exported, state = read_checked_export(path)
    except ExportError as err:
        raise InputError(f"{key}: {err}") from None
    _refuse_another_draft(key, raw, exported, asdict(model.config))
    state = {**state, "fc.weight": fc_in_layer_order(state["fc.weight"], exported.target_layer_ids,
                                                     model.config.target_layer_ids,
                                                     model.config.target_hidden_size)}
    params = model.state_dict()
    wanted = set(params) - set(EMBEDDING_KEYS)
    if wanted != set(state) - set(EMBEDDING_KEYS):  # check_tensors agreed with the same config
        odd = sorted(wanted ^ (set(state) - set(EMBEDDING_KEYS)))
        raise InputError(f"{key}: its tensors are not this draft's ({', '.join(odd[:5])})")
    stale = [name for name in EMBEDDING_KEYS if name in state
             and not torch.equal(state[name], params[name].to(state[name].dtype))]
    if stale:
        print(f"[trainer] note: {key}: its {' and '.join(stale)} differ from the target's; training uses "
              "the target's, as servers do", file=sys.stderr, flush=True)
    with torch.no_grad():
        for name in sorted(wanted):
            params[name].copy_(state[name])
    return (f"draft weights from {path} ({len(wanted)} tensors; the optimiser and learning-rate "
            "schedule start afresh)")
