"""The target interface: everything that needs the target LLM goes through a ``TargetEngine``.

Index convention (used everywhere in draftforge): auxiliary layer id ``i`` is
the *output* of decoder layer ``i`` (0-indexed), which is transformers'
``hidden_states[i + 1]`` (``hidden_states[0]`` is the embedding output). The
final decoder layer cannot be an auxiliary layer: its output is only useful
after the final norm, which ``TargetFeatures.final`` already holds (and SGLang
cannot capture it, see ``sglang_layer_ids``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from draftforge.errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from draftforge.splitserve.config import GenerationConfig, TargetConfig
    from draftforge.splitserve.placement import Spread


@dataclass
class TargetFeatures:
    """What the draft learns from, for a batch of token sequences.

    ``aux``: [B, S, K*H_t], the outputs of decoder layers ``target_layer_ids``
    concatenated in the given order; ``final``: [B, S, H_t], the final post-norm
    hidden state. Both in the recipe's dtype; positions outside the attention
    mask are zero.
    """

    aux: torch.Tensor
    final: torch.Tensor


class Reply(str):
    """A generated reply: the decoded text, plus whether the target ended it itself.

    ``finished`` is False when generation stopped at ``max_new_tokens``; the data
    pipeline then leaves the chat template's end-of-turn marker unsupervised
    instead of teaching the draft to stop mid-sentence. ``token_ids``: the ids the target
    generated for the text (its end-of-turn token left out), where the engine reports them
    (None otherwise): training supervises these, not the text tokenised again, which a
    byte-level BPE can split otherwise (SmolLM2 writes ``ĊĊ`` before a list item, and
    ``"\n\n1."`` tokenises as ``Ċ``, ``Ċ``, ``1``).
    """

    finished: bool
    token_ids: tuple[int, ...] | None

    def __new__(cls, text: str, finished: bool = True, token_ids: Sequence[int] | None = None) -> Reply:
        reply = super().__new__(cls, text)
        reply.finished = finished
        reply.token_ids = None if token_ids is None else tuple(int(i) for i in token_ids)
        return reply


def generated_reply(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], finished: bool,
                    eos_token_ids: Sequence[int]) -> Reply:
    """A reply from its generated token ids: its text without special tokens, and the ids of
    that text (:attr:`Reply.token_ids`: a last end-of-turn token left out).

    A reply cut at ``max_new_tokens`` (``finished`` False) may end inside a character:
    byte-level BPE spells an emoji or a CJK character over several tokens, and the cut
    ones decode to U+FFFD, which training would supervise as tokens the target never
    generated (those of "\ufffd"), so the trailing tokens of an unfinished character are
    dropped: the text ends with the last whole character. (A U+FFFD the target wrote itself
    at the very end of a cut reply goes too: one character fewer supervised, never a wrong
    one.) A finished reply is decoded as it is."""
    ids = list(ids)
    if ids and ids[-1] in set(eos_token_ids):
        ids.pop()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not finished:
        while ids and text.endswith("\ufffd"):
            ids.pop()
            text = tokenizer.decode(ids, skip_special_tokens=True)
    return Reply(text, finished=finished, token_ids=ids)


@runtime_checkable
class TargetEngine(Protocol):
    """A running target model (transformers in-process, or SGLang: ``sglang_backend``)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    #: False for an untrained model: no token id is more "unused" than another, so the
    #: check that ``draft.mask_token_id`` is a token chat never produces does not apply.
    trained: bool

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer (with its chat template)."""
        ...

    def generate(
        self, conversations: list[list[dict[str, str]]], settings: GenerationConfig
    ) -> list[Reply]:
        """One assistant reply per conversation (each ends with a user turn), decoded without special tokens."""
        ...

    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> TargetFeatures:
        """Auxiliary-layer and final hidden states for ``input_ids`` [B, S] (right-padded when masked)."""
        ...

    def lm_head_weight(self) -> torch.Tensor:
        """The target's output projection [V, H_t] (the draft keeps a frozen copy)."""
        ...

    def embed_tokens_weight(self) -> torch.Tensor:
        """The target's input embedding [V, H_t] (the draft keeps a frozen copy)."""
        ...

    def eos_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn."""
        ...


def check_conversation(conversation: object, index: int) -> None:
    """A conversation ``generate`` can answer: non-empty, string roles and contents, last turn user."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"conversation {index} must be a non-empty list of messages")
    for turn, message in enumerate(conversation):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"conversation {index}, message {turn}: expected a dict with string 'role' and "
                f"'content', got {message!r}"
            )
    if conversation[-1]["role"] != "user":
        raise ValueError(
            f"conversation {index} ends with role {conversation[-1]['role']!r}; generate() answers "
            f"a conversation that ends with a user turn"
        )


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, str]],
    index: int,
    settings: GenerationConfig,
) -> str:
    """The prompt text every backend generates from: the chat template (``settings.chat_template``
    or the tokenizer's) with ``add_generation_prompt`` and ``enable_thinking``."""
    from draftforge.data.tokenize import TEMPLATE_ERRORS, ChatTemplateError, template_failure

    check_conversation(conversation, index)
    if settings.chat_template is None and not getattr(tokenizer, "chat_template", None):
        # transformers' "tokenizer.chat_template is not set" is no fault of the conversation's
        raise ChatTemplateError(
            "the target's tokenizer has no chat template (its tokenizer_config.json or "
            "chat_template.jinja gives none); set target.generation.chat_template to the Jinja "
            "text of one (e.g. as a YAML block scalar, chat_template: |)"
        )
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=settings.enable_thinking,
            chat_template=settings.chat_template,
        )
    except TEMPLATE_ERRORS as exc:  # raise_exception('System role not supported'), a TypeError
        error = template_failure(exc, f"conversation {index}")
        error.conversation_index = index  # callers that know the conversation's id name it
        raise error from exc


def check_mask_token(
    tokenizer: PreTrainedTokenizerBase,
    mask_token_id: int,
    *,
    vocab_size: int,
    eos_ids: Sequence[int],
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> str:
    """Refuse a ``draft.mask_token_id`` the target's text can produce; describe an accepted one.

    The block input is ``[anchor, MASK, ..., MASK]``: if MASK can also be a real token
    (an ordinary piece of text, an end-of-turn id, a chat-template marker), the draft
    cannot tell a masked slot from that token. Accepted: a special or added token that a
    rendered chat does not contain, or an embedding row past the tokenizer's tokens.
    The chat is rendered as the data is (``chat_template`` and ``enable_thinking``: the
    recipe's ``target.generation``; the tokenizer's template when ``chat_template`` is
    None), and with the other thinking setting as well, since serving may use it.
    Raises :class:`~draftforge.errors.InputError` naming the token and some usable ids,
    or when there is no chat template at all.
    """
    where = f"draft.mask_token_id {mask_token_id}"
    if not 0 <= mask_token_id < vocab_size:
        raise InputError(f"{where} is outside the target's vocabulary of {vocab_size}")
    if mask_token_id in set(eos_ids):
        raise InputError(f"{where} is an end-of-turn token of the target ({list(eos_ids)}): "
                         "choose a special token the target never produces")
    if mask_token_id >= len(tokenizer):
        return f"{where}: an embedding row past the tokenizer's {len(tokenizer)} tokens (text never produces it)"
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    chat = _rendered_chat_ids(tokenizer, chat_template=chat_template, enable_thinking=enable_thinking)
    unusable = set(eos_ids) | set(chat) | {tokenizer.pad_token_id, tokenizer.bos_token_id}
    candidates = sorted(i for i in special if i not in unusable and i < vocab_size)[:6]
    hint = (f"; special tokens a chat does not contain: {candidates}" if candidates else
            "; the tokenizer has no special token to spare: use an id past its tokens if the "
            "embedding has one")
    if mask_token_id not in special:
        raise InputError(f"{where} is {token!r}, an ordinary text token of the target's tokenizer: "
                         f"choose a special token the target never produces{hint}")
    if mask_token_id in chat:
        raise InputError(f"{where} is {token!r}, which the chat template writes into every "
                         f"conversation{hint}")
    return f"{where}: {token!r}, a special token the chat template does not use"


def check_mask_token_in_folder(cfg: TargetConfig, mask_token_id: int) -> str | None:
    """:func:`check_mask_token` from a local target folder's tokenizer, ``config.json`` and
    ``generation_config.json`` alone, before its weights load (a refused id was found only
    after minutes of loading a large target); its log line, or None where the folder does not
    say its vocabulary size (the check then runs once the target has loaded)."""
    folder = Path(cfg.model).expanduser()
    if cfg.model == "random" or not (folder / "config.json").is_file():
        return None
    broken = broken_json_file(folder / "config.json")
    if broken is not None:
        raise InputError(broken)
    config = json.loads((folder / "config.json").read_text())
    vocab_size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return None
    tokenizer = folder_tokenizer(folder, cfg)
    return check_mask_token(tokenizer, mask_token_id, vocab_size=vocab_size,
                            eos_ids=folder_eos_ids(tokenizer, folder),
                            chat_template=cfg.generation.chat_template,
                            enable_thinking=cfg.generation.enable_thinking)


def _rendered_chat_ids(
    tokenizer: PreTrainedTokenizerBase, *, chat_template: str | None, enable_thinking: bool
) -> set[int]:
    """Token ids of a short rendered chat (system, user, assistant, user + generation prompt),
    with ``enable_thinking`` and, where the template renders it too, the other setting."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "draft.mask_token_id cannot be checked: the target's tokenizer has no chat template "
            "and target.generation.chat_template is not set (the data cannot be rendered either); "
            "set target.generation.chat_template"
        )
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye"}]
    ids: set[int] = set()
    for thinking in (enable_thinking, not enable_thinking):
        for conversation in ([{"role": "system", "content": "Be brief."}, *turns], turns):
            try:
                text = tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True,
                    chat_template=chat_template, enable_thinking=thinking,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - templates raise their own errors (e.g. no system role)
                continue
            ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
            break
        if not ids:  # the setting the data is rendered with must render
            source = "target.generation.chat_template" if chat_template else "the tokenizer's chat template"
            raise InputError(
                f"draft.mask_token_id cannot be checked: {source} renders no short chat "
                f"(user/assistant turns, enable_thinking {thinking}); fix the template"
            )
    return ids


def check_context(prompt_tokens: int, max_new_tokens: int, context: int | None, where: str) -> None:
    """Refuse a prompt whose reply could run past the target's ``max_position_embeddings``
    (``context``; None: not known). Past it a RoPE model still answers, but with positions it
    never saw, and the draft would be trained on those answers; SGLang refuses such a request
    itself (``TokenizerManager._validate_one_request``), with a ValueError that fails the whole
    batch and names no prompt."""
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise InputError(
            f"{where} has {prompt_tokens} tokens: with target.generation.max_new_tokens "
            f"{max_new_tokens}, it and its reply could take {prompt_tokens + max_new_tokens} "
            f"positions, more than the target's max_position_embeddings {context}; shorten or "
            "leave out that prompt, or lower max_new_tokens"
        )


def folder_eos_ids(tokenizer: PreTrainedTokenizerBase, folder: Path) -> list[int]:
    """End-of-turn ids: the tokenizer's eos plus ``generation_config.json``'s and ``config.json``'s
    (as the transformers backend: SGLang stops at both files' ids, transformers at config.json's
    where there is no generation_config.json)."""
    sources: list[object] = [tokenizer.eos_token_id]
    for name in ("generation_config.json", "config.json"):
        config_file = folder / name
        if not config_file.is_file():
            continue
        broken = broken_json_file(config_file)
        if broken is not None:  # its end-of-turn ids would be lost: replies would run to the limit
            raise InputError(f"{broken}; its end-of-turn ids (eos_token_id) are needed to end replies")
        sources += config_eos_ids(json.loads(config_file.read_text()))
    return merge_eos_ids(sources, where=f"target folder {folder}")


def config_eos_ids(config: object) -> list[object]:
    """The ``eos_token_id`` entries of a parsed ``config.json`` or ``generation_config.json``:
    its own and its ``text_config``'s (a multimodal model's language model)."""
    if not isinstance(config, dict):
        return []
    text_config = config.get("text_config")
    return [config.get("eos_token_id"),
            text_config.get("eos_token_id") if isinstance(text_config, dict) else None]


def merge_eos_ids(sources: Sequence[object], *, where: str) -> list[int]:
    """End-of-turn token ids from several sources (an id, a list of ids or None each), in order,
    without repeats. A target with none cannot end a reply (every one would run to
    ``max_new_tokens`` and be left unsupervised): :class:`~draftforge.errors.InputError`
    naming the target (``where``) and where to declare one."""
    ids: list[int] = []
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    if not ids:
        raise InputError(
            f"{where} defines no end-of-sequence token: neither its tokenizer (eos_token in "
            "tokenizer_config.json) nor its generation_config.json or config.json (eos_token_id) "
            "names one; "
            "declare the token that ends an assistant turn there"
        )
    return ids


def check_token_ids(input_ids: torch.Tensor, num_embeddings: int, where: str,
                    tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Refuse ids [B, S] an embedding of ``num_embeddings`` rows cannot look up, naming the first
    one, before a backend runs them: transformers' embedding raises a bare "index out of range
    in self" on a CPU and a device-side assert that ruins the CUDA context on a GPU, SGLang fails
    inside its scheduler. Such ids come from a tokenizer that has more tokens than the model has
    embedding rows (tokens added without resizing)."""
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise InputError(f"{where}: token ids must be integers, got a {input_ids.dtype} tensor")
    if input_ids.shape[-1] == 0:
        raise InputError(f"{where}: no tokens (input_ids of shape {tuple(input_ids.shape)})")
    outside = (input_ids < 0) | (input_ids >= num_embeddings)
    if not bool(outside.any()):
        return
    row, position = (int(i) for i in outside.nonzero()[0])
    token_id = int(input_ids[row, position])
    token, place = "", f"position {position}"
    if input_ids.shape[0] > 1:
        place = f"row {row}, {place}"
    if tokenizer is not None and token_id >= 0:
        text = tokenizer.convert_ids_to_tokens(token_id)
        token = "" if text is None else f" ({text!r} to the tokenizer)"  # None: the tokenizer lacks it too
    hint = ("the tokenizer and the weights do not match (tokens added to the tokenizer need "
            "the model's embeddings resized, e.g. `model.resize_token_embeddings(len(tokenizer))`)"
            if token_id >= 0 else "token ids are never negative")
    raise InputError(
        f"{where}: token id {token_id}{token} at {place} is outside the model's "
        f"{num_embeddings} embedding rows (ids 0..{num_embeddings - 1}); {hint}"
    )


def check_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """Validate auxiliary layer ids against a target with ``num_hidden_layers`` decoder layers.

    Ids must be distinct integers in ``[0, num_hidden_layers - 2]``: the final
    decoder layer is refused (its use is the post-norm ``final`` state). Raises
    :class:`~draftforge.errors.InputError` (``draft.target_layer_ids`` is the recipe's).
    """
    ids = list(layer_ids)
    if not ids:
        raise InputError("target_layer_ids is empty: the draft needs at least one auxiliary layer")
    last = num_hidden_layers - 1
    for layer_id in ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise InputError(f"target_layer_ids must be integers, got {layer_id!r}")
        if layer_id == last:
            raise InputError(
                f"target_layer_ids contains {layer_id}, the target's final decoder layer "
                f"(it has {num_hidden_layers} layers, 0-indexed): the final layer is used through "
                f"the post-norm final hidden state, not as an auxiliary layer; pick ids in "
                f"0..{last - 1}"
            )
        if not 0 <= layer_id < last:
            raise InputError(
                f"target_layer_ids contains {layer_id}, outside 0..{last - 1} for a target with "
                f"{num_hidden_layers} decoder layers (ids are 0-indexed; the final layer is excluded)"
            )
    if len(set(ids)) != len(ids):
        raise InputError(f"target_layer_ids has repeated ids: {ids}")
    return ids


def sglang_layer_ids(hf_layer_ids: Sequence[int]) -> list[int]:
    """Translate draftforge (transformers) layer ids into SGLang's ``--return-aux-hidden-state-layer-ids``.

    SGLang captures an auxiliary state *before* running decoder layer ``i + 1``
    for a requested id ``i`` (its models store ``layers_to_capture = [i + 1]``
    and record the residual stream on entry to that layer). The input of layer
    ``i + 1`` is the output of layer ``i``, i.e. transformers'
    ``hidden_states[i + 1]``, which is exactly draftforge's id ``i``. So the
    translation is the identity; it lives here so the SGLang backend has one
    place to change if a release shifts the convention, and its parity test
    (captured SGLang states == ``HFTarget.features`` on a few tokens) must pass
    before this is trusted for a new SGLang version. The final decoder layer
    (id ``L - 1``) has no "before layer L" in SGLang, another reason it is
    refused by ``check_layer_ids``.
    """
    return [int(i) for i in hf_layer_ids]


class TargetName(str):
    """A target's short name (what messages show and regenerated rows record as ``target``),
    plus ``fingerprint``: what tells apart two targets of the same name, such as the
    ``final`` folders of two fine-tuning runs; None where the name alone says which."""

    fingerprint: str | None

    def __new__(cls, name: str, fingerprint: str | None = None) -> TargetName:
        target = super().__new__(cls, name)
        target.fingerprint = fingerprint
        return target


def target_name(cfg: TargetConfig) -> TargetName:
    """The name the recipe's target engine carries (and regenerated answers record):
    a registered name or ``random`` as it is, a local folder by its last component.

    Its ``fingerprint``: for ``random`` the seed and shape, for a local folder
    :func:`folder_fingerprint`; none for a registered name (one pinned model)."""
    from draftforge.splitserve import smollm2

    if cfg.model == smollm2.NAME:
        return TargetName(cfg.model)
    if cfg.model == "random":
        # num_parameters only sizes placement plans: the weights do not depend on it
        shape = {} if cfg.shape is None else cfg.shape.model_dump(exclude={"num_parameters"})
        return TargetName(cfg.model, f"seed {cfg.seed}; " + " ".join(f"{k}={v}" for k, v in sorted(shape.items())))
    # made absolute first, so that "." or "run/.." is named by the folder it means, not "" or ".."
    # (lexically: a symlinked folder keeps the name it was given)
    folder = Path(os.path.abspath(Path(cfg.model).expanduser()))
    return TargetName(folder.name, folder_fingerprint(folder))


#: the files besides the weights that decide what a local target answers
_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
_SLICES_PER_WEIGHTS_FILE = 16
_SLICE_BYTES = 1 << 16


def folder_fingerprint(folder: Path) -> str | None:
    """``sha256:...`` of a local model folder: its config, generation and tokenizer files, and
    of each ``*.safetensors`` file the name, the size and 16 slices of 64 KiB spread over it
    (the first holds the tensor index). Two checkpoints of one model differ in every slice
    once all their weights were trained; reading only slices keeps this cheap for a model of
    any size, at the cost of not telling apart files that differ only between slices.
    None for a folder that cannot be read (loading it says why)."""
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    try:
        for name in _IDENTITY_FILES:
            if (folder / name).is_file():
                digest.update(f"{name}\x1f".encode() + (folder / name).read_bytes() + b"\x1e")
        for path in sorted(folder.glob("*.safetensors")):
            size = path.stat().st_size
            digest.update(f"{path.name}\x1f{size}\x1f".encode())
            with path.open("rb") as weights:
                last = max(size - _SLICE_BYTES, 0)
                for k in range(_SLICES_PER_WEIGHTS_FILE):
                    weights.seek(last * k // (_SLICES_PER_WEIGHTS_FILE - 1))
                    digest.update(weights.read(_SLICE_BYTES))
            digest.update(b"\x1e")
    except OSError:
        return None
    return f"sha256:{digest.hexdigest()[:32]}"


def resolve_device(choice: str, target_gpus: Sequence[int] | None = None, *,
                   cuda_available: bool | None = None) -> str:
    """The device a command's ``--device`` names: ``auto`` is the first of the recipe's
    ``target_gpus`` (``split.target_devices``; GPU 0 when unset) when CUDA is visible, else
    ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` as given. Raises
    :class:`~draftforge.errors.InputError` for anything else, or a GPU that is not visible."""
    given = choice
    visible = None  # how many GPUs, when asked here (tests pass cuda_available instead)
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
        visible = torch.cuda.device_count() if cuda_available else 0
    if choice == "auto":
        if not cuda_available:
            return "cpu"
        choice = f"cuda:{target_gpus[0] if target_gpus else 0}"
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise InputError(f"--device {choice!r} is not a device: give auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {choice!r}: the target runs on cpu or cuda")
    if device.type == "cuda" and not cuda_available:
        raise InputError(f"--device {choice!r}: no CUDA GPU is visible")
    if device.type == "cuda" and visible is not None and (device.index or 0) >= visible:
        origin = "the recipe's first target GPU" if given == "auto" else "--device"
        raise InputError(f"device {device} ({origin}): only {visible} GPU(s) are visible; give "
                         "--device cuda:N with N below that")
    return str(device)


def build_target(
    cfg: TargetConfig,
    layer_ids: Sequence[int],
    *,
    device: str | torch.device = "cpu",
    tensor_parallel: int = 1,
    placement: Spread | None = None,
) -> TargetEngine:
    """Build the target engine the recipe's ``target`` section names.

    ``cfg.model``: a registered name (``smollm2-135m-instruct``), ``random`` (a
    seeded random Llama of ``cfg.shape``, features only unless its vocabulary is
    SmolLM2's) or a local Hugging Face folder with safetensors weights.
    ``tensor_parallel`` > 1 (SGLang only) serves it from that many GPUs, ``device``'s
    index and the ones after it. ``placement`` (transformers only, not ``random``)
    splits the model by layers over several GPUs
    (:func:`~draftforge.splitserve.placement.spread_placement`); a model that does
    not fit on them is refused before its weights are read.
    """
    if cfg.backend == "sglang":
        return _build_sglang_target(cfg, layer_ids, device=device, tensor_parallel=tensor_parallel)
    if cfg.backend != "hf":
        raise ValueError(f"unknown target.backend {cfg.backend!r}; valid: 'hf', 'sglang'")
    if tensor_parallel != 1:
        raise InputError(
            f"split.target_tensor_parallel: {tensor_parallel} needs target.backend: sglang; the "
            "hf backend runs one whole target per rank"
        )

    from draftforge.splitserve import smollm2
    from draftforge.splitserve.hf_backend import HFTarget
    from draftforge.splitserve.random_target import build_random_target
    from draftforge.splitserve.registry import resolve_target_shape

    known = resolve_target_shape(cfg)
    if known is not None:  # refuse bad layer ids before a slow load or conversion
        check_layer_ids(layer_ids, known.num_hidden_layers)

    if cfg.model == "random":
        if placement is not None:
            raise InputError("a random target is built on one device; it cannot be spread over several")
        engine: TargetEngine = build_random_target(cfg, layer_ids, device=device)
        engine.name = target_name(cfg)  # "random" with its seed and shape as the fingerprint
    else:
        folder = (smollm2.ensure_smollm2(cfg.cache_dir) if cfg.model == smollm2.NAME
                  else Path(cfg.model).expanduser())
        device_map = None
        if placement is not None:
            from draftforge.splitserve.placement import plan_device_map

            device_map = plan_device_map(folder, placement, cfg)
        engine = HFTarget.from_folder(folder, layer_ids, cfg, name=target_name(cfg), device=device,
                                      device_map=device_map)
    _check_declared_shape(cfg, engine)
    return engine


def _build_sglang_target(
    cfg: TargetConfig,
    layer_ids: Sequence[int],
    *,
    device: str | torch.device,
    tensor_parallel: int,
) -> TargetEngine:
    """An ``SGLangTarget`` for a registered name or a local folder (SGLang needs real weights)."""
    from draftforge.splitserve import smollm2
    from draftforge.splitserve.sglang_backend import SGLangTarget, require_sglang

    require_sglang()  # before any conversion or load: the install command is the first thing to fix
    if cfg.model == "random":
        raise InputError(
            "target.model 'random' is built in memory and has no folder for SGLang to load; "
            "use target.backend: hf for random targets"
        )
    folder = (smollm2.ensure_smollm2(cfg.cache_dir) if cfg.model == smollm2.NAME
              else Path(cfg.model).expanduser())
    engine = SGLangTarget(folder, layer_ids, cfg, name=target_name(cfg), device=device,
                          tensor_parallel=tensor_parallel)
    _check_declared_shape(cfg, engine)
    return engine


def load_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer (and chat template) without loading its weights.

    For data preparation (chat templates, loss masks) in processes that never
    run the target. ``random`` targets borrow SmolLM2's, cut to their vocabulary
    (:mod:`~draftforge.splitserve.borrowed_tokenizer`), where it has that many tokens.
    """
    from draftforge.splitserve import borrowed_tokenizer, smollm2

    if cfg.model == "random":
        vocab_size = cfg.shape.vocab_size if cfg.shape is not None else None
        if not borrowed_tokenizer.has_tokenizer(vocab_size):
            raise InputError(
                f"target 'random' with vocab_size {vocab_size} has no tokenizer (random targets "
                f"of that size support features on token ids only); declare "
                f"{borrowed_tokenizer.MIN_VOCAB} <= target.shape.vocab_size <= "
                f"{borrowed_tokenizer.FULL_VOCAB} to borrow SmolLM2's tokenizer cut to that size"
            )
        folder: str = str(borrowed_tokenizer.tokenizer_dir(vocab_size, cfg.cache_dir))
    elif cfg.model == smollm2.NAME:
        folder = str(smollm2.ensure_smollm2(cfg.cache_dir))
    else:
        folder = os.path.expanduser(cfg.model)
        if not os.path.isdir(folder):
            raise InputError(
                f"target.model {cfg.model!r} is neither a registered name ({smollm2.NAME}, random) "
                f"nor an existing local folder"
            )
    return folder_tokenizer(folder, cfg)


#: files one of which a saved tokenizer has (fast, sentencepiece, BPE and WordPiece vocabularies)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt")


def folder_tokenizer(folder: str | os.PathLike[str], cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the model folder ``folder``. Raises
    :class:`~draftforge.errors.InputError` naming the folder when it holds no tokenizer, or
    when the tokenizer needs code shipped with it and ``cfg.trust_remote_code`` is off."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        if "trust_remote_code" in str(err) and not cfg.trust_remote_code:
            raise remote_code_error(folder, err) from err
        if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
            raise InputError(
                f"target folder {folder} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): "
                "save the target's tokenizer beside its weights, e.g. "
                "`tokenizer.save_pretrained(folder)`"
            ) from err
        broken = _broken_tokenizer_json(Path(folder))
        if broken is not None:
            raise InputError(broken) from err
        raise


#: a saved tokenizer's JSON files, which transformers' errors do not name when one does not parse
_TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                         "added_tokens.json", "vocab.json", "chat_template.json")


def _broken_tokenizer_json(folder: Path) -> str | None:
    """Why the first of ``folder``'s tokenizer JSON files that does not parse is unusable (its
    path, line and column; a Git LFS pointer said as such), or None when they all parse."""
    for name in _TOKENIZER_JSON_FILES:
        broken = broken_json_file(folder / name)
        if broken is not None:
            return broken
    return None


def broken_json_file(path: Path) -> str | None:
    """Why the JSON file ``path`` is unusable (its path, line and column; a Git LFS pointer
    said as such), or None when it parses or does not exist."""
    if not path.is_file():
        return None
    text = path.read_bytes()
    try:
        json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        where = (f"{exc.msg}: line {exc.lineno} column {exc.colno}"
                 if isinstance(exc, json.JSONDecodeError) else str(exc))
        hint = ("; it is a Git LFS pointer, not the file: fetch it with `git lfs pull` in that "
                "folder" if text.startswith(b"version https://git-lfs") else "")
        return f"{path} is not valid JSON ({where}){hint}"
    return None


def remote_code_error(folder: str | os.PathLike[str], err: Exception) -> InputError:
    """The error for a model folder whose model or tokenizer needs code shipped with it."""
    return InputError(
        f"target.model {str(folder)!r} needs code shipped with the model; set "
        f"target.trust_remote_code: true only if you trust that code ({err})"
    )


def _check_declared_shape(cfg: TargetConfig, engine: TargetEngine) -> None:
    if cfg.shape is None:
        return
    for field in ("num_hidden_layers", "hidden_size", "vocab_size"):
        declared, actual = getattr(cfg.shape, field), getattr(engine, field)
        if declared != actual:
            raise InputError(
                f"target.shape.{field} is {declared} but the loaded target {engine.name!r} has "
                f"{actual}; fix or remove target.shape"
            )
