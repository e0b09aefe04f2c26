"""Export a trained draft as the Hugging Face folder SGLang and llama.cpp load as it is.

This module is the only writer of the serving format (contract section 4):

* ``config.json``: a Qwen3 config (``model_type: qwen3``) whose ``architectures``
  is ``Qwen3DSparkModel`` (or ``LingDSparkModel``), plus the top-level DSpark
  fields and a nested ``dflash_config`` copy of the four fields SGLang's DFlash
  parser reads (``block_size``, ``target_layer_ids``, ``num_target_layers``,
  ``mask_token_id``; ``parse_dflash_draft_config`` in SGLang's
  ``speculative/dflash_utils.py``). ``speculators_model_type`` is never written:
  SGLang refuses drafts that carry ``speculators_model_type: dspark``.
* ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with a
  ``model.safetensors.index.json`` above ``max_shard_size_mb`` megabytes of 10^6 bytes, what
  huggingface_hub and transformers mean by ``max_shard_size="...MB"``), tensor names
  without prefix, checked against an explicit key table: a missing, an
  unexpected or a mis-shaped tensor stops the export (SGLang silently skips
  unknown keys, so nothing downstream would notice).
* ``README.md``: a generated model card. It gives llama.cpp's commands only for
  drafts llama.cpp (llama-cpp-python 0.3.36) can run: its converter takes the
  ``vanilla`` Markov head only, and its runtime loads a confidence head only when it
  reads the Markov embedding too (``[n_embd + markov_rank, 1]``); other drafts are
  SGLang only (:func:`llamacpp_blockers`), and the export warns.

``with_embeddings`` and llama.cpp: the converter drops a full-vocabulary
``lm_head.weight`` and keeps ``embed_tokens.weight`` as ``token_embd``, which the
runtime then uses as the draft's embedding and tied output head instead of the
target's. That would be the target's own only for a tied target and a bit-equal copy
(a bf16 export rounds an fp32 target's), so every ``with_embeddings`` export's
config.json carries ``has_embed_tokens: false``, which makes the converter drop the
embedding too: the GGUF uses the target's embedding and output head, as SGLang does.
SGLang reads that key only to recognise one quantised Nemotron layout, where
``false`` is its default.

DSpark needs the Markov head: SGLang refuses ``markov_rank: 0``, so the DFlash
ablation (``markov_rank 0``) is not exportable; evaluate it from its training
checkpoint instead (``draftforge eval RUN_DIR/checkpoints/step_...``).

The export is atomic: everything is written into a temporary folder beside the
destination, then renamed into place; a failure removes the temporary folder and
leaves an older export at the destination untouched. What an export killed outright
(SIGKILL, out of memory) leaves beside the destination is tidied by the next export
into it (:func:`_tidy_leftovers`), which holds ``.NAME.lock`` there while it writes (on a file
system without ``flock`` it writes unlocked and tidies nothing: :func:`export_lock`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch

from draftforge.errors import InputError
from draftforge.files import (
    fsync_tree,
    put_back_aside,
    replace_dir,
    shareable,
    temporaries_of,
)
from draftforge.train.model import DSparkConfig, DSparkDraft

ARCHITECTURES = ("Qwen3DSparkModel", "LingDSparkModel")
EMBEDDING_KEYS = ("embed_tokens.weight", "lm_head.weight")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
TRAINING_CONFIG_FILE = "draft_config.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def is_model_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a model as exports and HF folders do: config.json and its
    weights (one safetensors file or the index of its shards)."""
    return (folder / CONFIG_FILE).is_file() and any(
        (folder / name).exists() for name in (SINGLE_FILE, INDEX_FILE))


class ExportError(InputError):
    """The draft cannot be exported as asked (bad tensors, unsupported configuration)."""


@dataclass
class ModelCard:
    """What the generated README.md says beyond the config: where the draft came from."""

    target: str = "unknown"
    recipe: str | None = None  # the resolved recipe YAML
    data: str | None = None  # a line or two on the training data
    acceptance_table: str | None = None  # markdown from `draftforge eval`
    extra: dict[str, str] = field(default_factory=dict)


def tensor_table(cfg: DSparkConfig, *, with_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor an export of ``cfg`` holds, with its shape: the explicit key table."""
    hidden, rank, vocab = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    table: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, cfg.num_context_features),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(cfg.num_hidden_layers):
        prefix = f"layers.{i}"
        table.update(
            {
                f"{prefix}.input_layernorm.weight": (hidden,),
                f"{prefix}.post_attention_layernorm.weight": (hidden,),
                f"{prefix}.self_attn.q_proj.weight": (q_dim, hidden),
                f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
                f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
                f"{prefix}.self_attn.o_proj.weight": (hidden, q_dim),
                f"{prefix}.self_attn.q_norm.weight": (cfg.head_dim,),
                f"{prefix}.self_attn.k_norm.weight": (cfg.head_dim,),
                f"{prefix}.mlp.gate_proj.weight": (cfg.intermediate_size, hidden),
                f"{prefix}.mlp.up_proj.weight": (cfg.intermediate_size, hidden),
                f"{prefix}.mlp.down_proj.weight": (hidden, cfg.intermediate_size),
            }
        )
    if rank > 0:
        table["markov_head.markov_w1.weight"] = (vocab, rank)
        table["markov_head.markov_w2.weight"] = (vocab, rank)
        if cfg.markov_head_type == "gated":
            table["markov_head.gate_proj.weight"] = (rank, hidden + rank)
            table["markov_head.gate_proj.bias"] = (rank,)
        elif cfg.markov_head_type == "rnn":
            table["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
            table["markov_head.joint_proj.bias"] = (3 * rank,)
    if cfg.enable_confidence_head:
        extra = rank if cfg.confidence_head_with_markov else 0
        table["confidence_head.proj.weight"] = (1, hidden + extra)
        table["confidence_head.proj.bias"] = (1,)
    if with_embeddings:
        table["embed_tokens.weight"] = (vocab, hidden)
        table["lm_head.weight"] = (vocab, hidden)
    return table


def check_tensors(
    state: Mapping[str, torch.Tensor],
    cfg: DSparkConfig,
    *,
    with_embeddings: bool,
    where: str,
    optional: Collection[str] = (),
) -> None:
    """Refuse a missing, an unexpected or a mis-shaped tensor (``where`` names the source).
    Names in ``optional`` may be absent (the loader's: an export's embedding copies, each
    optional in the contract)."""
    table = tensor_table(cfg, with_embeddings=with_embeddings)
    missing = sorted(set(table) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(table))
    wrong = [
        f"{name}: {tuple(state[name].shape)} (expected {table[name]})"
        for name in table
        if name in state and tuple(state[name].shape) != table[name]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong)}")
    if problems:
        raise ExportError(
            f"{where} does not match the DSpark key table for this config "
            f"(markov_rank={cfg.markov_rank}, markov_head_type={cfg.markov_head_type}, "
            f"confidence head={cfg.enable_confidence_head}, with_embeddings={with_embeddings}): "
            + "; ".join(problems)
        )


def serving_config(
    cfg: DSparkConfig, *, arch: str, dtype: torch.dtype, with_embeddings: bool = False
) -> dict:
    """The exported config.json for ``cfg`` (contract section 4).

    ``with_embeddings``: the export holds copies of the target's embedding and lm_head;
    ``has_embed_tokens: false`` then keeps llama.cpp's converter from serving the copy as the
    draft's embedding and output head in place of the target's (module docstring).
    """
    if arch not in ARCHITECTURES:
        raise ExportError(f"unknown architecture {arch!r}; valid: {', '.join(ARCHITECTURES)}")
    if cfg.markov_rank <= 0:
        raise ExportError(
            "this draft has markov_rank 0 (the DFlash ablation): SGLang's DSPARK loader refuses "
            "markov_rank 0, so it cannot be exported in the DSpark format. Evaluate it from its "
            "training checkpoint instead: draftforge eval RUN_DIR/checkpoints/step_XXXXXXXX --target ..."
        )
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ExportError(
            f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary [0, {cfg.vocab_size})"
        )
    duplicates = sorted({i for i in cfg.target_layer_ids if list(cfg.target_layer_ids).count(i) > 1})
    if duplicates:
        raise ExportError(
            f"target_layer_ids {list(cfg.target_layer_ids)} name layer(s) {duplicates} more than once: "
            "SGLang captures each target layer once, so its fc.weight would get fewer features than it "
            "was trained on; train with distinct draft.target_layer_ids"
        )
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        raise ExportError(f"unsupported export dtype {dtype}; valid: {', '.join(_DTYPE_NAMES.values())}")
    config = {
        "architectures": [arch],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": bool(
            cfg.enable_confidence_head and cfg.confidence_head_with_markov
        ),
        "dflash_config": {
            "block_size": cfg.block_size,
            "target_layer_ids": list(cfg.target_layer_ids),
            "num_target_layers": cfg.num_target_layers,
            "mask_token_id": cfg.mask_token_id,
        },
    }
    if with_embeddings:
        config["has_embed_tokens"] = False
    return config


def ascending_target_layers(
    state: Mapping[str, torch.Tensor], cfg: DSparkConfig, *, progress=print
) -> tuple[dict[str, torch.Tensor], DSparkConfig]:
    """``state`` and ``cfg`` with ``target_layer_ids`` ascending and ``fc.weight``'s column
    blocks (one per target layer, ``target_hidden_size`` wide) permuted to match.

    Training concatenates the layers in the recipe's order, and llama.cpp in the order
    config.json lists them, but SGLang's capture always returns them ascending and its DSpark
    ``fc`` reads them as they come: an export with ascending ids means the same draft to
    every consumer. A mis-shaped ``fc.weight`` is left alone for :func:`check_tensors` to report.
    """
    ids = list(cfg.target_layer_ids)
    order = sorted(range(len(ids)), key=ids.__getitem__)
    width = cfg.target_hidden_size
    fc = state.get("fc.weight")
    expected = (cfg.hidden_size, cfg.num_context_features)
    if order == list(range(len(ids))) or fc is None or tuple(fc.shape) != expected:
        return dict(state), cfg
    ascending = [ids[i] for i in order]
    progress(f"target_layer_ids {ids} written ascending as {ascending}, with fc.weight's column "
             "blocks permuted to match (SGLang captures the layers in ascending order); fc then sums "
             "its terms in another order, so the export's logits can differ from the checkpoint's in "
             "their last bits (about 1e-7 in float32): list the ids ascending in the recipe for a "
             "bit-identical round trip")
    return ({**state, "fc.weight": fc_in_layer_order(fc, ids, ascending, width)},
            replace(cfg, target_layer_ids=ascending))


def fc_in_layer_order(fc: torch.Tensor, listed: Sequence[int], wanted: Sequence[int], width: int) -> torch.Tensor:
    """``fc.weight`` whose column blocks (one per target layer, ``width`` wide) follow the layers
    as ``listed``, with its blocks reordered to follow them as ``wanted`` (the same layers; a
    layer listed twice keeps its blocks' order)."""
    if list(listed) == list(wanted):
        return fc
    places: dict[int, list[int]] = {}
    for i, layer in enumerate(listed):
        places.setdefault(layer, []).append(i)
    starts = [places[layer].pop(0) * width for layer in wanted]
    return torch.cat([fc[:, start : start + width] for start in starts], dim=1)


def llamacpp_blockers(config: Mapping) -> list[str]:
    """Why llama.cpp (llama-cpp-python 0.3.36) cannot run the draft of this exported config;
    empty when it can."""
    reasons = []
    if config["markov_head_type"] != "vanilla":
        reasons.append(
            f"its Markov head is {config['markov_head_type']!r} and llama.cpp's converter "
            "supports only 'vanilla'"
        )
    if config["enable_confidence_head"] and not config["confidence_head_with_markov"]:
        reasons.append(
            "its confidence head reads the hidden state alone, and llama.cpp's runtime refuses "
            "the GGUF: it expects a confidence head that also reads the Markov embedding "
            "(confidence_head_with_markov: true)"
        )
    return reasons


def export_draft(
    source: DSparkDraft | tuple[Mapping[str, torch.Tensor], DSparkConfig],
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "Qwen3DSparkModel",
    with_embeddings: bool = False,
    max_shard_size_mb: float = 4096,
    card: ModelCard | None = None,
    progress=print,
    published: Callable[[str], None] | None = None,
) -> Path:
    """Write the serving folder for a draft (a module or ``(state_dict, config)``); returns its path.

    Embedding tensors are written only with ``with_embeddings`` (servers attach
    the target's own); a state dict without them is fine otherwise. ``published`` is called
    with the :func:`export_digest` of the folder this export wrote, computed under its lock
    before it takes its name: another export into the same folder may replace it as soon as
    the lock is released, so a digest taken of ``out_dir`` afterwards may be that one's.
    """
    check_shard_size(max_shard_size_mb)  # before any work, not once the staging folder is written
    if isinstance(source, DSparkDraft):
        state, cfg = source.state_dict(), source.config
    else:
        state, cfg = source
    state = {name: tensor for name, tensor in state.items()}
    if not with_embeddings:
        for name in EMBEDDING_KEYS:
            state.pop(name, None)
    lacking = [name for name in EMBEDDING_KEYS if name not in state]
    if with_embeddings and lacking:
        held = [name for name in EMBEDDING_KEYS if name in state]
        has = f"only {held[0]}, not {lacking[0]}" if held else "neither"
        raise ExportError(
            "with_embeddings needs embed_tokens.weight and lm_head.weight in the draft's state dict, "
            f"and this checkpoint has {has}; export without them (--no-with-embeddings, which also "
            "overrides a recipe's export.with_embeddings: true; servers attach the target's own) or "
            "load the target's into the draft first"
        )
    if with_embeddings:
        # a bf16 run keeps the frozen target matrices in bf16 beside fp32 weights (the trainer
        # casts them to spare a cast per matmul): they go out in the draft's own dtype
        own = {t.dtype for name, t in state.items() if name not in EMBEDDING_KEYS}
        if len(own) == 1:
            state.update({name: state[name].to(next(iter(own))) for name in EMBEDDING_KEYS})
    state, cfg = ascending_target_layers(state, cfg, progress=progress)
    # the key table first: a stray tensor of another dtype is an unexpected tensor, not "mixed dtypes"
    check_tensors(state, cfg, with_embeddings=with_embeddings, where="the draft's state dict")
    config = serving_config(cfg, arch=arch, dtype=_common_dtype(state), with_embeddings=with_embeddings)
    blockers = llamacpp_blockers(config)
    if blockers:
        progress(f"warning: llama.cpp cannot run this draft ({'; '.join(blockers)}); serve it with "
                 "SGLang (the model card gives no llama.cpp commands)")
    elif with_embeddings:
        progress("with_embeddings: config.json sets has_embed_tokens false so llama.cpp's converter "
                 "leaves the copies out of the GGUF and llama.cpp uses the target's own embedding "
                 "and output head, as SGLang does")

    if not config["enable_confidence_head"]:
        progress(f"note: {SGLANG_HEADLESS} (its cap-accept and compact modes build a confidence head "
                 "whatever config.json says, and stop at load without its weights)")
    out = Path(out_dir).expanduser().resolve()
    check_destination(out)
    # the folders above out that this export makes: a failed export removes them too
    made = [folder for folder in (out.parent, *out.parent.parents) if not folder.exists()]
    staging = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with export_lock(out) as locked:
            if locked:
                _tidy_leftovers(out, progress)
            else:  # a running export's staging folder would look like a killed one's
                progress(f"export: this file system has no file locks (flock), so the export into {out} "
                         "runs unlocked and leaves whatever killed exports left beside it in place")
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            _write_json(staging / CONFIG_FILE, config)
            files = write_safetensors(state, staging, max_shard_size_mb=max_shard_size_mb)
            (staging / CARD_FILE).write_text(model_card(config, card or ModelCard(), state))
            shareable(staging)  # mkdtemp made it 0700: unreadable to a server running as another user
            fsync_tree(staging)  # every file on disk before the folder takes its name
            # the names are out's, so this is the digest of out as this export wrote it
            digest = export_digest(staging) if published is not None else None
            replace_dir(staging, out)
            if published is not None:
                published(digest)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in made:  # deepest first; only while empty (another process may use one now)
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    total = sum(t.numel() for t in state.values())
    progress(f"exported {total:,} parameters ({len(state)} tensors, {len(files)} file(s)) to {out}")
    return out


def export_lock(out: Path, *, then: str = "wait for it to finish, or choose another --out"):
    """Hold ``.NAME.lock`` beside ``out`` (resolved) while an export writes it, or while the demo
    reads it: the leftovers :func:`_tidy_leftovers` removes are then a killed export's, never a
    running one's. Yields whether the lock is held: on a file system without ``flock`` (some
    network ones) the export runs unlocked, as training does there (``checkpoint.claim_run_dir``),
    instead of failing. Held elsewhere: :class:`ExportError`, its advice ``then``."""
    from draftforge.files import lock_or_refuse

    return lock_or_refuse(out.parent / f".{out.name}.lock", lambda holder: ExportError(
        f"another draftforge export or demo ({holder}) holds {out} now (writing it, or reading it for "
        f"its evaluation); {then}"))


def _tidy_leftovers(out: Path, progress) -> None:
    """What an export into ``out`` killed before it could clean up (SIGKILL, out of memory, a
    power cut) left beside it: its staging folders ``.NAME.tmp-*`` (a partial copy of the
    draft) are removed, and the earlier export that ``replace_dir`` had moved aside into
    ``.NAME.old-*`` is put back where it is the only one left (killed between its two
    renames), so that this export, should it fail too, leaves it in place; older copies go."""
    stale = temporaries_of(out, "tmp")  # exactly its own: a sibling export may be writing its own
    if put_back_aside(out):
        progress(f"export: put back the earlier export at {out}, which an export killed while "
                 "replacing it had left moved aside")
    aside = temporaries_of(out, "old")  # what is left of them once one is put back
    copies = [folder for folder in aside if (folder / out.name).exists()]
    for leftover in [*stale, *aside]:
        shutil.rmtree(leftover, ignore_errors=True)
    if stale:
        progress(f"export: removed {len(stale)} partial folder(s) an export killed while writing left "
                 f"beside {out}")
    if copies:
        progress(f"export: removed {len(copies)} older export(s) that exports killed while replacing "
                 f"{out} had moved aside beside it")


MEGABYTE = 10**6  # huggingface_hub's "MB" (serialization.parse_size_to_int), as transformers' too


def export_digest(folder: Path) -> str:
    """The sha256 of an export folder's files but its model card (``draftforge export
    --eval-report`` writes the card again, nothing else): each name and its content's sha256,
    in name order. The same for every export of one checkpoint with the same settings; what
    ``draftforge export`` prints as its ``export_files=`` line and the demo records."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*")):
        if path.name != CARD_FILE and path.is_file():
            content = hashlib.sha256()  # hashlib.file_digest needs Python 3.11
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    content.update(block)
            digest.update(path.name.encode() + content.digest())
    return digest.hexdigest()


def check_shard_size(max_shard_size_mb: float) -> None:
    """Refuse a ``max_shard_size_mb`` that is no positive, finite number (0 or a negative one
    would put every tensor in a shard of its own, NaN none past the first, inf fails to convert),
    naming the parameter and the value, as the CLI's ``--max-shard-size-mb`` and the recipe do."""
    number = isinstance(max_shard_size_mb, numbers.Real) and not isinstance(max_shard_size_mb, bool)
    if not (number and math.isfinite(max_shard_size_mb) and max_shard_size_mb > 0):
        raise ExportError(f"max_shard_size_mb must be a positive, finite number of megabytes (10^6 "
                          f"bytes), got {max_shard_size_mb!r}")


def write_safetensors(
    state: Mapping[str, torch.Tensor], folder: Path, *, max_shard_size_mb: float
) -> list[str]:
    """``model.safetensors``, or shards plus ``model.safetensors.index.json`` when larger than the
    limit, ``max_shard_size_mb`` megabytes of 10^6 bytes (:data:`MEGABYTE`): a shard holds tensors
    up to that many bytes, exactly that many included, as huggingface_hub's
    ``split_torch_state_dict_into_shards`` does (a larger tensor is a shard of its own)."""
    from safetensors.torch import save_file

    check_shard_size(max_shard_size_mb)
    limit = int(max_shard_size_mb * MEGABYTE)
    names = sorted(state)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(_contiguous(state, names), str(folder / SINGLE_FILE), metadata=metadata)
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(_contiguous(state, shard), str(folder / filename), metadata=metadata)
        files.append(filename)
        weight_map.update({name: filename for name in shard})
    total_size = sum(t.numel() * t.element_size() for t in state.values())
    _write_json(folder / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    return files


def model_card(config: dict, card: ModelCard, state: Mapping[str, torch.Tensor]) -> str:
    """The generated README.md."""
    params = sum(t.numel() for name, t in state.items() if name not in EMBEDDING_KEYS)
    gamma = config["block_size"]
    lines = [
        "---",
        "library_name: draftforge",
        "tags: [speculative-decoding, dspark, draft-model]",
        "---",
        "",
        f"# DSpark draft for {card.target}",
        "",
        f"A DSpark speculative-decoding draft ({config['architectures'][0]}) trained with draftforge "
        f"against `{card.target}`. It needs the target's embedding and lm_head at serving time "
        "(servers attach them)"
        + ("; this folder also carries copies of them (exported with --with-embeddings), which "
           "SGLang ignores." if "embed_tokens.weight" in state else "."),
        "",
        "| field | value |",
        "| --- | --- |",
        f"| parameters (without embeddings) | {params:,} |",
        f"| block size (gamma) | {gamma} |",
        f"| draft layers | {config['num_hidden_layers']} |",
        f"| hidden size | {config['hidden_size']} |",
        f"| target layers used | {config['target_layer_ids']} of {config['num_target_layers']} |",
        f"| mask token id | {config['mask_token_id']} |",
        f"| Markov head | {config['markov_head_type']}, rank {config['markov_rank']} |",
        f"| confidence head | {config['enable_confidence_head']} "
        f"(with Markov: {config['confidence_head_with_markov']}) |",
        f"| dtype | {config['torch_dtype']} |",
        "",
        "## Serving",
        "",
        *_serving_section(config),
        "## Measured acceptance",
        "",
        card.acceptance_table
        or "Not measured at export time; run `draftforge eval THIS_DIR --target TARGET`.",
        "",
    ]
    if card.data:
        lines += ["## Training data", "", card.data, ""]
    for title, text in card.extra.items():
        lines += [f"## {title}", "", text, ""]
    if card.recipe:
        lines += ["## Recipe", "", "```yaml", card.recipe.rstrip(), "```", ""]
    return "\n".join(lines)


def _serving_section(config: dict) -> list[str]:
    """The model card's serving commands: SGLang always, llama.cpp where it can run the draft."""
    gamma = config["block_size"]
    blockers = llamacpp_blockers(config)
    lines = [
        "```bash",
        f"sglang serve --model-path TARGET --speculative-algorithm DSPARK \\\n"
        f"  --speculative-draft-model-path THIS_DIR --speculative-num-draft-tokens {gamma + 1}",
    ]
    if not blockers:
        lines += [
            "python convert_hf_to_gguf.py THIS_DIR --target-model-dir TARGET --outfile THIS.gguf   # llama.cpp",
            f"llama-server -m TARGET.gguf -md THIS.gguf --spec-type draft-dspark --spec-draft-n-max {gamma}",
        ]
    lines += ["```", "",
              "Add the flags the target itself needs to be served (its tensor-parallel size, "
              "`--trust-remote-code` where its model code ships with the checkpoint).", "",
              _sglang_confidence_line(config, gamma), ""]
    if blockers:
        lines += [f"SGLang only: llama.cpp cannot run this draft ({'; '.join(blockers)}).", ""]
        return lines
    if config["enable_confidence_head"]:
        lines += [
            "The draft has a confidence head: llama.cpp's `--spec-draft-p-min P` verifies a "
            "block only up to its first slot whose predicted acceptance is below P.",
            "",
        ]
    if config.get("has_embed_tokens") is False:
        lines += [
            "The export holds copies of the target's embedding and lm_head; `has_embed_tokens: "
            "false` makes llama.cpp's converter leave both out, so the GGUF uses the target's own, "
            "as SGLang does (it would otherwise serve the embedding copy as the draft's embedding "
            "and output head).",
            "",
        ]
    return lines


def _sglang_confidence_line(config: dict, gamma: int) -> str:
    """What SGLang (0.5.23) does with the draft's confidence head: it builds the head only in its
    ragged-verify modes, and builds it there even where config.json says there is none."""
    if not config["enable_confidence_head"]:
        return (f"{SGLANG_HEADLESS}; in `cap-accept` or `compact` it builds the head anyway and stops "
                "at load (\"confidence head is enabled but the checkpoint is missing\").")
    return ("SGLang uses the confidence head only in its ragged-verify modes: set "
            "`SGLANG_RAGGED_VERIFY_MODE=cap-accept` (or `compact`) and give its scheduler a cost table "
            "built with `sglang.benchmark.dspark_sps_profiler` (`--speculative-dspark-sps-table-path`; "
            "without one it verifies every block whole). A calibration written by `draftforge eval "
            "--calibrate OUT.json` goes with `--speculative-dspark-confidence-sts-path OUT.json` "
            f"(one temperature per slot: keep `--speculative-num-draft-tokens {gamma + 1}`). In its "
            "default mode, `static`, SGLang verifies every block whole, skips the head's weights and "
            "ignores the calibration.")


SGLANG_HEADLESS = ("This draft has no confidence head: SGLang serves it in its default verify mode "
                   "(`SGLANG_RAGGED_VERIFY_MODE=static`) only")


def draft_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """The sha256 of every tensor of a draft but the embedding copies (the servers attach the
    target's own, and a checkpoint may hold them where its export does not): each name, dtype,
    shape and bytes as stored, in name order. Which weights an evaluation loaded, compared by
    ``draftforge export`` before it puts that evaluation's table into a model card: two drafts
    that differ in any tensor differ here (a hash of ``fc.weight`` alone, what evaluations
    recorded before, did not tell apart drafts sharing it); the same after a safetensors round
    trip, sharded or not. ``state`` may be any mapping (one that reads each tensor when asked).
    ``tensors:`` starts it (the ``fc.weight`` form started with its dtype)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        if name in EMBEDDING_KEYS:
            continue
        tensor = state[name].detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0{len(raw)}\0".encode())
        digest.update(hashlib.sha256(raw).digest())
    return f"tensors:{digest.hexdigest()}"


def unmarked_checkpoint_note(source: Path, *, used: str) -> str | None:
    """Where the checkpoint folder ``source`` names (or holds, as its model.safetensors) has no
    COMPLETE marker, a note saying what that means: its weights were read and checked, so they
    are ``used`` ("exported", "evaluated"), but training writes the marker last, so the folder
    may be a partial copy or an unfinished save. None where the marker is there."""
    from draftforge.train.checkpoint import COMPLETE

    folder = source if source.is_dir() else source.parent
    if (folder / COMPLETE).is_file():
        return None
    return (f"{folder} has no {COMPLETE} marker, which 'draftforge train' writes into a checkpoint "
            "last, once its other files are on disk: a folder without it is a partial copy of one, a "
            "save that did not finish, or no training checkpoint (train.resume refuses it). Its "
            f"{SINGLE_FILE} read whole and fits its {TRAINING_CONFIG_FILE}, so it is {used}; if it "
            "came from a run, check that it was copied whole, or pass the run directory (its newest "
            "complete checkpoint)")


def load_training_checkpoint(path: str | os.PathLike[str]) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """The draft config and state dict of a training checkpoint (the one place that knows its format).

    ``path`` may be a run directory (its newest ``checkpoints/step_*`` with a
    ``COMPLETE`` marker is used), a checkpoint folder holding ``model.safetensors``
    and ``draft_config.json``, or the ``model.safetensors`` file itself. Weights
    are read with safetensors only. A run directory's newest checkpoint that its still
    running training prunes (``train.keep_last``) while it is read is replaced by the newer
    one, with a line saying so; a checkpoint folder named directly is not.
    """
    path = Path(path).expanduser()
    if not path.exists():  # a typo: not "no model.safetensors found at <typo>/model.safetensors"
        raise ExportError(f"{path} does not exist; give a run directory, a checkpoint folder or a "
                          f"{SINGLE_FILE}")
    if path.is_file():
        if path.suffix != ".safetensors":  # RUN/config.yaml: not "RUN/draft_config.json is missing"
            hint = (f"the run directory {path.parent} for its newest complete checkpoint"
                    if (path.parent / "checkpoints").is_dir()
                    else f"a run directory, a checkpoint folder or a {SINGLE_FILE} file")
            raise ExportError(f"{path} is a file but no {SINGLE_FILE} (draftforge reads a draft's weights "
                              f"from safetensors only); pass {hint}")
        return _read_checkpoint(path, path, path.parent)
    if not (path / "checkpoints").is_dir():
        return _read_checkpoint(path, path / SINGLE_FILE, path)
    return read_newest(path, lambda folder: _read_checkpoint(path, folder / SINGLE_FILE, folder))


PRUNED_RETRIES = 3
T = TypeVar("T")


def read_newest(run_dir: Path, read: Callable[[Path], T]) -> T:
    """``read(folder)`` of ``run_dir``'s newest complete checkpoint; where the run's training,
    still saving, prunes it to train.keep_last while it is read (:class:`PrunedWhileRead`),
    the same of the newest one then, with a line saying so, up to :data:`PRUNED_RETRIES` times."""
    for _ in range(PRUNED_RETRIES):
        folder = latest_checkpoint(run_dir)
        try:
            return read(folder)
        except PrunedWhileRead:
            print(f"export: {folder.name} was removed while it was read (the running training keeps "
                  "train.keep_last checkpoints); reading the newest one again", flush=True)
    raise ExportError(f"{run_dir}: its newest checkpoint was removed while it was read "
                      f"{PRUNED_RETRIES} times over; export once the training has finished")


class PrunedWhileRead(ExportError):
    """A checkpoint folder that disappeared while it was read (pruned by a running training)."""


def _read_checkpoint(path: Path, weights: Path, folder: Path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """The config and state dict of ``folder`` (``weights`` is its weights file); a folder that
    disappears meanwhile raises :class:`PrunedWhileRead`."""
    was_there = folder.is_dir()
    try:
        return _read_checkpoint_files(path, weights, folder)
    except (ExportError, OSError) as err:
        if not was_there or folder.exists():
            raise
        raise PrunedWhileRead(
            f"{folder}: the checkpoint was removed while it was read (a running training prunes "
            "its checkpoints to train.keep_last); pass the run directory to read its newest one"
        ) from err


def _read_checkpoint_files(path: Path, weights: Path, folder: Path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    config_path = folder / TRAINING_CONFIG_FILE
    if not weights.is_file():
        from draftforge.train.checkpoint import COMPLETE, STATE_FILE

        held = ((COMPLETE, f"{COMPLETE} marker"), (STATE_FILE, STATE_FILE))
        marker = next((what for name, what in held if (folder / name).is_file()), None)
        if marker is not None and weights == folder / SINGLE_FILE:
            # a checkpoint (it has its marker or state) without the file: "neither a checkpoint folder
            # nor a run directory" or "pass a run directory" would misname what was passed
            which = f"checkpoint {folder}" if folder == path else f"{path}: its newest checkpoint {folder}"
            raise ExportError(
                f"{which} has no {SINGLE_FILE} (it has its {marker}): export reads the full model state "
                "from that file, which training writes into every checkpoint under every strategy, so "
                "this one was copied partially or its file was removed; copy the checkpoint whole, or "
                "export another one"
            )
        if path.is_dir() and folder == path and any(path.glob("step_*")):  # a run's checkpoints/ itself
            raise ExportError(
                f"{path}: a run's checkpoints folder; pass the run directory above it ({path.parent}) for "
                f"its newest complete checkpoint, or one of its step_XXXXXXXX folders"
            )
        if path.is_dir() and folder == path:  # "pass a run directory" misleads a run that saved none
            raise ExportError(
                f"{path}: no {SINGLE_FILE} found in it and no checkpoints/ folder, so it is neither a "
                "checkpoint folder nor a run directory that has saved a checkpoint; pass RUN_DIR once "
                f"training saved one, RUN_DIR/checkpoints/step_XXXXXXXX or a {SINGLE_FILE} file"
            )
        raise ExportError(
            f"{path}: no {SINGLE_FILE} found at {weights}; pass a run directory, a checkpoint folder "
            f"or a {SINGLE_FILE} file"
        )
    if not config_path.is_file():
        if (folder / "config.json").is_file():  # an export: it has its serving config instead
            raise ExportError(
                f"{path}: an export (it holds config.json, not {TRAINING_CONFIG_FILE}), where a training "
                "checkpoint is read; pass the run directory or one of its checkpoints (draftforge eval "
                "and the servers load an export as it is)")
        raise ExportError(
            f"{path}: {config_path} is missing: a training checkpoint holds {TRAINING_CONFIG_FILE} (the "
            f"draft's DSparkConfig as JSON) beside {SINGLE_FILE}, and an export holds config.json; "
            "neither is here")
    try:
        fields = json.loads(config_path.read_text())
        _check_field_types(fields)
        cfg = DSparkConfig(**fields)
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ExportError(f"{config_path}: not a valid draft config: {err}") from err
    state = read_safetensors_file(weights)
    state = {_strip_wrappers(name): tensor for name, tensor in state.items()}
    # checked here, where the files are known (export_draft sees a state dict); the
    # embeddings only when they are exported
    trained = {name: tensor for name, tensor in state.items() if name not in EMBEDDING_KEYS}
    check_tensors(trained, cfg, with_embeddings=False, where=f"{weights} (with its {config_path.name})")
    return cfg, state


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# what each DSparkConfig annotation admits from JSON (bool is an int to Python, and refused as one)
_JSON_TYPES = {
    "int": ("an integer", _is_int),
    "int | None": ("an integer or null", lambda v: v is None or _is_int(v)),
    "float": ("a number", lambda v: _is_int(v) or isinstance(v, float)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list[int]": ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v))),
}


def _check_field_types(fields) -> None:
    """Refuse a draft_config.json field of the wrong JSON type, naming the key: DSparkConfig
    would take ``"false"`` as a true ``enable_confidence_head`` (and write it into the exported
    config.json, which SGLang reads as true) or fail comparing ``"8"`` without saying which key."""
    if not isinstance(fields, dict):
        raise TypeError(f"a JSON object of DSparkConfig fields is needed, not a {type(fields).__name__}")
    types = {f.name: f.type for f in dataclasses.fields(DSparkConfig)}
    for key, value in fields.items():
        what, admits = _JSON_TYPES.get(types.get(key), (None, None))
        if admits is not None and not admits(value):
            raise TypeError(f"{key} must be {what}, got {value!r}")


def read_safetensors_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a corrupt, truncated or pickled file raises
    :class:`ExportError` naming it (never a bare safetensors traceback)."""
    from safetensors.torch import load_file

    path = Path(path)
    try:  # safetensors reports a file this user may not read as missing
        with open(path, "rb") as handle:
            head = handle.read(2)
    except PermissionError as err:
        raise ExportError(
            f"{path}: this user cannot read it ({err.strerror}); do not delete it for that, it may "
            "be whole: have its owner make it readable to this user (chmod a+r), or run as that user"
        ) from None
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        hint = ""
        if head[:1] == b"\x80" or head == b"PK":
            hint = " It looks like a pickle (torch.save) file: draftforge loads safetensors only."
        raise ExportError(
            f"{path}: not a readable safetensors file ({type(err).__name__}: {detail}); it may be "
            f"truncated or corrupt: write it again (export or checkpoint).{hint}"
        ) from None


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path:
    """The newest complete ``run_dir/checkpoints/step_XXXXXXXX`` folder, by the rule ``resume:
    auto`` picks with (``checkpoint.complete_checkpoints``: its ``COMPLETE`` marker and its
    ``trainer_state.json``; a crashed save's ``step_XXXXXXXX.tmp`` or a copy named otherwise is
    not one), so that an export and a resume of one run take the same checkpoint."""
    from draftforge.train.checkpoint import STATE_FILE, checkpoints_root, complete_checkpoints

    complete = complete_checkpoints(Path(run_dir))
    if not complete:
        raise ExportError(f"{checkpoints_root(Path(run_dir))}: no complete checkpoint (step_* with a "
                          f"COMPLETE marker and {STATE_FILE})")
    return complete[-1]


def _strip_wrappers(name: str) -> str:
    """``name`` without the prefixes wrappers add, in whichever order they were nested
    (``torch.compile(DDP(m))`` names ``_orig_mod.module.x``, ``DDP(torch.compile(m))``
    ``module._orig_mod.x``)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in ("_orig_mod.", "module."):
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def _common_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise ExportError(
            f"the draft's tensors have mixed dtypes {sorted(map(str, dtypes))}; cast the draft to one dtype first"
        )
    return dtypes.pop()


def _contiguous(state: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    # clone: safetensors refuses tensors that share storage (views of one buffer).
    return {name: state[name].detach().to("cpu").contiguous().clone() for name in names}


# what an export writes (write_safetensors names the shards model-0000i-of-0000n.safetensors)
_EXPORT_FILE = re.compile("|".join(
    [*(re.escape(name) for name in (CONFIG_FILE, CARD_FILE, SINGLE_FILE, INDEX_FILE)),
     r"model-\d{5}-of-\d{5}\.safetensors"]))


def check_destination(out: Path) -> None:
    """An export replaces only an earlier export: a folder whose config.json names a DSpark
    architecture and which holds nothing an export does not write (a Hugging Face model
    folder has a config.json too, and its tokenizer and weights would be deleted)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"export destination {out} exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    refuse = f"refusing to replace it; choose another --out or empty {out} first"
    try:
        architectures = json.loads((out / CONFIG_FILE).read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        architectures = None
    if not isinstance(architectures, list) or not set(architectures) & set(ARCHITECTURES):
        found = f"its {CONFIG_FILE} names {architectures}" if (out / CONFIG_FILE).is_file() else f"no {CONFIG_FILE}"
        raise ExportError(f"export destination {out} is a non-empty folder that is not an export "
                          f"({found}, not {' or '.join(ARCHITECTURES)}); {refuse}")
    foreign = sorted(path.name for path in out.iterdir() if not _EXPORT_FILE.fullmatch(path.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ExportError(f"export destination {out} holds files an export does not write "
                          f"({shown}), which replacing it would delete; {refuse}")


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def hub_offline_setting() -> str | None:
    """What puts huggingface_hub in offline mode (``"HF_HUB_OFFLINE=true"``), or None where the
    client is online.

    The client's own verdict decides (``huggingface_hub.constants.HF_HUB_OFFLINE``: it reads
    ``HF_HUB_OFFLINE``, or where that is unset or empty ``TRANSFORMERS_OFFLINE``, as true when it is
    ``1``, ``on``, ``yes`` or ``true`` in any case); the variable is named as it parses them."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        return None
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:
            return f"{name}={value}"
    return "HF_HUB_OFFLINE"  # set when huggingface_hub was imported, unset since


# what a push replaces on the Hub: everything an export writes, whatever an earlier push left
PUSH_REPLACES = ("*.safetensors", INDEX_FILE, CARD_FILE, CONFIG_FILE)


def push_to_hub(folder: str | os.PathLike[str], repo_id: str, *, private: bool = True) -> str:
    """Upload an export folder to the Hugging Face Hub in one commit that also deletes the files
    of an earlier export there (:data:`PUSH_REPLACES`); a clear error when offline or not logged in."""
    try:
        from huggingface_hub import HfApi
    except ImportError as err:
        raise RuntimeError("pushing needs huggingface_hub: pip install huggingface_hub") from err
    offline = hub_offline_setting()
    if offline is not None:
        from huggingface_hub import constants

        # the client reads TRANSFORMERS_OFFLINE once HF_HUB_OFFLINE is unset: advice to unset
        # one of two offline variables would fail again after a whole export
        name = " and ".join(dict.fromkeys([offline.split("=")[0], *(
            other for other in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
            if os.environ.get(other, "").upper() in constants.ENV_VARS_TRUE_VALUES)]))
        raise RuntimeError(
            f"cannot push to {repo_id}: {offline} is set, so huggingface_hub is offline. The export "
            f"is complete at {folder}; unset {name} and run `draftforge export ... --push-to-hub` "
            "again, or upload with `huggingface-cli upload`"
        )
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        # an earlier push's shards and index would otherwise stay beside the new files, and
        # servers would load the stale index's shards
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="draftforge export",
                          delete_patterns=list(PUSH_REPLACES))
    except Exception as err:  # network, auth, permission: the hub client raises many kinds
        raise RuntimeError(
            f"push to the Hugging Face Hub ({repo_id}) failed: {err.__class__.__name__}: {err}. "
            f"The export itself is complete at {folder}; check your network and `huggingface-cli login`, "
            "then retry"
        ) from err
    return f"https://huggingface.co/{repo_id}"
