"""The transformers target backend, the embedded default: a local HF causal LM run in-process."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from draftforge.errors import InputError
from draftforge.splitserve.packed_linear import pack_linear_weights
from draftforge.splitserve.sampling import decode
from draftforge.splitserve.target import (
    Reply,
    TargetFeatures,
    broken_json_file,
    check_context,
    check_layer_ids,
    check_token_ids,
    folder_tokenizer,
    generated_reply,
    merge_eos_ids,
    remote_code_error,
    render_prompt,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from draftforge.splitserve.config import GenerationConfig, TargetConfig

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class HFTarget:
    """A transformers causal LM as a ``TargetEngine``.

    Features are captured with forward hooks on the chosen decoder layers and on
    the final norm, attached only for the duration of one ``features`` call, so
    only the selected layers' states are kept (no ``output_hidden_states``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        layer_ids: Sequence[int],
        *,
        name: str,
        no_tokenizer_reason: str = "this target was built without a tokenizer",
    ) -> None:
        self.model = model.eval()
        #: linear layers whose no-grad CPU bf16 forward uses a weight packed once (bit-identical)
        self.packed_linears = pack_linear_weights(model)
        self.name = name
        self.trained = True
        self._tokenizer = tokenizer
        self._no_tokenizer_reason = no_tokenizer_reason
        config = model.config.get_text_config()
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        #: the longest sequence the target was made for (None where its config does not say)
        context = getattr(config, "max_position_embeddings", None)
        self.max_position_embeddings = int(context) if context else None
        self.layer_ids = check_layer_ids(layer_ids, self.num_hidden_layers)
        self.dtype = next(model.parameters()).dtype
        # where inputs go and features are gathered: the embedding's device (the first
        # of several when the model is spread over devices)
        self.device = model.get_input_embeddings().weight.device
        self.num_embeddings = int(model.get_input_embeddings().weight.shape[0])
        self._layers, self._final_norm = decoder_layers_and_norm(model)
        if len(self._layers) != self.num_hidden_layers:
            raise ValueError(
                f"{name}: config says {self.num_hidden_layers} decoder layers but the model has "
                f"{len(self._layers)}"
            )

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike[str],
        layer_ids: Sequence[int],
        cfg: TargetConfig,
        *,
        name: str | None = None,
        device: str | torch.device = "cpu",
        device_map: Mapping[str, int | str] | None = None,
    ) -> HFTarget:
        """Load a local Hugging Face causal LM folder (safetensors weights only).

        ``device_map`` (module name -> device, as accelerate writes it:
        :func:`~draftforge.splitserve.placement.plan_device_map`) spreads the model
        over several devices; then ``device`` is not used.
        """
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM

        path = _checked_model_folder(folder)
        set_cpu_threads(cfg.num_threads, device)
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(
                str(path),
                dtype=DTYPES[cfg.dtype],
                use_safetensors=True,
                trust_remote_code=cfg.trust_remote_code,
                device_map=None if device_map is None else dict(device_map),
                output_loading_info=True,
            )
        except ValueError as err:
            if "trust_remote_code" in str(err) and not cfg.trust_remote_code:
                raise remote_code_error(folder, err) from err
            if any(marker in str(err) for marker in _NOT_A_CAUSAL_LM):
                raise _not_a_causal_lm_error(path, err) from err
            raise
        except SafetensorError as err:  # a damaged file: the library's message names none
            raise _unreadable_weights_error(path, err) from err
        except OSError as err:
            layout = _layout_error(path)
            if layout is not None:
                raise layout from err
            raise
        except RuntimeError as err:
            if "ignore_mismatched_sizes" in str(err):  # transformers' load report lists them
                raise InputError(
                    f"target folder {path}: some weights in its safetensors files have other shapes "
                    "than its config.json gives them (transformers' load report above lists them): "
                    "the weights and config.json are of different models"
                ) from err
            raise
        _check_all_weights_loaded(path, loading)
        tokenizer = folder_tokenizer(path, cfg)
        if device_map is None:
            model.to(device)
        return cls(model, tokenizer, layer_ids, name=name or path.name)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer; raises for targets built without one."""
        if self._tokenizer is None:
            raise RuntimeError(
                f"target {self.name!r} has no tokenizer: {self._no_tokenizer_reason}"
            )
        return self._tokenizer

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> TargetFeatures:
        """Outputs of the auxiliary layers and the final post-norm state for ``input_ids`` [B, S].

        With ``attention_mask`` (right padding), positions outside the mask are zero.
        Runs under ``no_grad`` (not ``inference_mode``) so the trainer can feed the
        tensors into autograd.
        """
        # checked where the caller keeps the ids (the producer: the CPU), before the device sees them
        check_token_ids(_as_batch(input_ids, "input_ids"), self.num_embeddings, f"target {self.name!r}: features",
                        self._tokenizer)
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = _as_batch(attention_mask, "attention_mask").to(self.device)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids "
                    f"shape {tuple(input_ids.shape)}"
                )
        modules = {i: self._layers[i] for i in self.layer_ids}
        modules["final"] = self._final_norm
        with captured_outputs(modules) as captured:
            # The decoder alone: the lm_head's [B, S, V] logits are not needed here.
            self.model.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            )
        aux = torch.cat([captured[i].to(self.device) for i in self.layer_ids], dim=-1).to(self.dtype)
        final = captured["final"].to(self.device, self.dtype)
        if attention_mask is not None:
            keep_mask = attention_mask.bool().unsqueeze(-1)
            aux = aux.masked_fill(~keep_mask, 0)
            final = final.masked_fill(~keep_mask, 0)
        return TargetFeatures(aux=aux, final=final)

    @torch.no_grad()
    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token logits [B, S, V] for ``input_ids`` [B, S] (a helper for evaluation)."""
        input_ids = _as_batch(input_ids, "input_ids").to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits

    def generate(
        self, conversations: list[list[dict[str, str]]], settings: GenerationConfig
    ) -> list[Reply]:
        """One assistant reply per conversation, with the recipe's sampling settings.

        The chat template (``settings.chat_template`` or the tokenizer's) is applied
        with ``add_generation_prompt`` and ``enable_thinking``; batches of
        ``settings.batch_size`` are left-padded and decoded with a KV cache.
        Sampling is seeded from ``settings.seed`` at the start of every call (the
        global RNG is left untouched): the same list of conversations with the
        same settings gives the same replies. Temperature 0 means greedy.
        Replies are decoded without special tokens; ``Reply.finished`` is False
        for a reply cut at ``max_new_tokens``, whose text ends with its last whole
        character (``target.generated_reply``: a cut inside an emoji drops its tokens), and
        ``Reply.token_ids`` holds the ids generated for that text.
        """
        replies = self.generate_token_ids(conversations, settings)
        eos = self.eos_token_ids()
        return [generated_reply(self.tokenizer, ids, bool(ids) and ids[-1] in eos, eos) for ids in replies]

    @torch.no_grad()
    def generate_token_ids(
        self, conversations: list[list[dict[str, str]]], settings: GenerationConfig
    ) -> list[list[int]]:
        """Like ``generate`` but returns each reply's token ids, up to and including its end-of-turn token."""
        tokenizer = self.tokenizer
        prompts = [
            render_prompt(tokenizer, conversation, index, settings)
            for index, conversation in enumerate(conversations)
        ]
        eos_ids = self.eos_token_ids()
        pad = self.tokenizer.pad_token_id
        # Llama-3 and Mistral tokenizers have no pad token; one added to the tokenizer without
        # resizing the embedding has no row to look up (the padding is masked: any id will do)
        pad_id = pad if pad is not None and 0 <= pad < self.num_embeddings else eos_ids[0]
        eos = set(eos_ids)
        replies: list[list[int]] = []
        generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        for start in range(0, len(prompts), settings.batch_size):
            # padded here, not by the tokenizer, which refuses to pad without a pad token
            encoded = tokenizer(prompts[start : start + settings.batch_size], add_special_tokens=False)
            for offset, row in enumerate(encoded["input_ids"]):
                where = f"target {self.name!r}: the prompt of conversation {start + offset}"
                try:
                    check_token_ids(torch.tensor([row], dtype=torch.long), self.num_embeddings, where, tokenizer)
                    check_context(len(row), settings.max_new_tokens, self.max_position_embeddings, where)
                except InputError as err:
                    err.conversation_index = start + offset  # callers that know its id name it
                    raise
            input_ids, attention_mask = _left_padded(encoded["input_ids"], pad_id)
            output = decode(self.model, input_ids.to(self.device), attention_mask.to(self.device),
                            settings, eos_ids=eos_ids, pad_id=pad_id, generator=generator)
            for row in output.tolist():
                replies.append(_until_eos(row, eos))
        return replies

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [V, H_t], detached."""
        return self.model.get_output_embeddings().weight.detach()

    def embed_tokens_weight(self) -> torch.Tensor:
        """The input embedding [V, H_t], detached."""
        return self.model.get_input_embeddings().weight.detach()

    def eos_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn: the tokenizer's eos, the model's generation eos
        and its config's (SGLang stops at both; transformers' generation config holds the
        config's only where the folder has no generation_config.json)."""
        config = self.model.config
        return merge_eos_ids(
            (self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id,
             getattr(config, "eos_token_id", None), getattr(config.get_text_config(), "eos_token_id", None)),
            where=f"target {self.name!r}",
        )


#: transformers' words for a config it has no causal-LM class for (an unknown ``model_type``,
#: none at all, or a known one without a causal LM head, such as T5)
_NOT_A_CAUSAL_LM = ("does not recognize this architecture", "Unrecognized configuration class",
                    "Unrecognized model in")


def _not_a_causal_lm_error(path: Path, err: ValueError) -> InputError:
    """The error for a folder transformers cannot load as a causal LM: the folder and the first
    line of transformers' reason (the rest lists every supported config class)."""
    import transformers

    reason = str(err).strip().splitlines()[0]
    return InputError(
        f"target folder {path}: transformers {transformers.__version__} cannot load it as a causal "
        f"language model ({reason}); draftforge needs a decoder-only LM with Llama-style layers "
        "(check config.json's model_type, or upgrade transformers for a newer architecture)"
    )


def _check_all_weights_loaded(path: Path, loading: Mapping[str, object]) -> None:
    """Refuse a model some of whose weights the folder lacks: transformers initialises them at
    random and only logs it, which would make the target silently partly random."""
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise InputError(
            f"target folder {path}: its safetensors files lack {len(missing)} of the weights "
            f"{_config_class_hint(path)}needs ({shown}); transformers would initialise them at "
            "random. A shard may be missing, or the weights are of another model than config.json's"
        )


def _config_class_hint(path: Path) -> str:
    """``"config.json's <architecture> "`` or an empty string, for messages about the weights."""
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ""
    return f"config.json's {architectures[0]} " if architectures else ""


def _unreadable_weights_error(path: Path, err: Exception) -> InputError:
    """The error for a safetensors file that cannot be read, naming the first such file of the
    folder (a Git LFS pointer left by a clone without git-lfs, or a file cut short)."""
    from safetensors import safe_open

    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as file_err:  # noqa: BLE001 - safetensors raises its own error types
            with weights.open("rb") as handle:
                lfs_pointer = handle.read(64).startswith(b"version https://git-lfs")
            hint = ("it is a Git LFS pointer, not the weights: fetch them with `git lfs pull` in "
                    "that folder" if lfs_pointer else
                    "it is damaged or cut short (an interrupted download or copy?): fetch it again")
            return InputError(f"target folder {path}: {weights.name} is not a readable safetensors "
                              f"file ({file_err}); {hint}")
    return InputError(f"target folder {path}: its safetensors weights cannot be read ({err}); "
                      "fetch them again")


def set_cpu_threads(num_threads: int, device: str | torch.device) -> None:
    """One intra-op thread per process by default: processes sharing cores must not oversubscribe."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(num_threads)


def _checked_model_folder(folder: str | os.PathLike[str]) -> Path:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise InputError(
            f"target.model {str(folder)!r} is neither a registered name (smollm2-135m-instruct, "
            f"random) nor an existing local folder"
        )
    if not (path / "config.json").is_file():
        raise InputError(
            f"target folder {path} has no config.json; is it a Hugging Face model folder?"
        )
    if not any(path.glob("*.safetensors")):
        pickled = sorted(
            p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}
        )
        hint = (
            f"it holds only pickled weights ({', '.join(pickled[:3])}); draftforge loads safetensors "
            f"only. Convert once, e.g. `model.save_pretrained(dir, safe_serialization=True)` in a "
            f"trusted environment"
            if pickled
            else "it holds no weights"
        )
        raise InputError(f"target folder {path} has no *.safetensors file: {hint}")
    # transformers ignores a generation_config.json that does not parse, and with it the
    # end-of-turn ids it lists (Llama-3's <|eot_id|>): every reply would run to max_new_tokens
    broken = broken_json_file(path / "generation_config.json")
    if broken is not None:
        raise InputError(f"{broken}; transformers would ignore it and with it the end-of-turn ids "
                         "(eos_token_id) it lists: fix or fetch the file again")
    absent = _absent_shards(path)
    if absent:
        raise InputError(
            f"target folder {path}: model.safetensors.index.json names {len(absent)} weights "
            f"file(s) the folder does not have ({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}); "
            "the download or copy is incomplete"
        )
    return path


def _layout_error(path: Path) -> InputError | None:
    """The error for a folder whose safetensors files transformers does not find (it reads
    ``model.safetensors`` or the shards a ``model.safetensors.index.json`` lists, and says only
    "no file named model.safetensors" beside the shards); None for a folder laid out so.
    SGLang loads every ``*.safetensors`` file: the SGLang backend takes such a folder."""
    if (path / "model.safetensors").is_file() or (path / _SAFETENSORS_INDEX).is_file():
        return None
    present = sorted(p.name for p in path.glob("*.safetensors"))
    shown = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
    hint = ("they are shards of a model whose index file is missing: the download or copy is "
            f"incomplete, fetch {_SAFETENSORS_INDEX} too" if any(_SHARD_NAME.search(n) for n in present)
            else "transformers reads the weights only from model.safetensors or from the shards a "
            f"{_SAFETENSORS_INDEX} lists (save the model with `save_pretrained` to get that layout)")
    return InputError(f"target folder {path} has {len(present)} safetensors file(s) ({shown}) but "
                      f"neither model.safetensors nor {_SAFETENSORS_INDEX}: {hint}")


_SAFETENSORS_INDEX = "model.safetensors.index.json"
#: how transformers names the shards of a model saved in several files
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


def _absent_shards(path: Path) -> list[str]:
    """The files ``model.safetensors.index.json`` maps weights to that are not in ``path`` (none
    when there is no readable index: transformers then says what is wrong)."""
    try:
        weight_map = json.loads((path / _SAFETENSORS_INDEX).read_text())["weight_map"]
        files = {str(name) for name in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(name for name in files if not (path / name).is_file())


@contextmanager
def captured_outputs(modules: Mapping[Hashable, nn.Module]) -> Iterator[dict[Hashable, torch.Tensor]]:
    """Forward hooks that keep each module's output under its key while the block runs.

    Only the modules asked for are hooked, so no all-layer ``hidden_states`` are
    materialised. A module that runs twice inside the block is an error (its
    first output would be lost silently). The hooks are removed on exit.
    """
    captured: dict[Hashable, torch.Tensor] = {}

    def keep(key: Hashable):
        def hook(_module: nn.Module, _args: object, output: object) -> None:
            if key in captured:
                raise RuntimeError(f"module for {key!r} ran twice in one forward")
            captured[key] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [module.register_forward_hook(keep(key)) for key, module in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def decoder_layers_and_norm(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and the final norm of a transformers causal LM; an
    :class:`~draftforge.errors.InputError` for a model laid out otherwise (GPT-2's ``h`` and
    ``ln_f``): the target a user chose cannot be used."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(norm, nn.Module):
        raise InputError(
            f"target model class {type(model).__name__} is not supported: draftforge takes "
            f"features from model.get_decoder().layers and .norm (Llama-style decoders), which "
            f"it does not have"
        )
    return layers, norm


def _left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` left-padded with ``pad_id`` into ``input_ids`` [B, S], and their attention mask."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token (the rest is padding)."""
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[: position + 1]
    return tokens


def _as_batch(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        raise ValueError(
            f"{what} must be a 2-D tensor [batch, seq], got {getattr(tensor, 'shape', type(tensor))}"
        )
    return tensor
