"""The SGLang target backend: generation and feature capture through SGLang, pinned to one release.

Two paths, both lazy (nothing of SGLang is imported until first use):

* ``generate``: SGLang's public offline engine (``sglang.Engine``), started on
  the first call in the calling process. Prompts go in as token ids rendered
  with the target's chat template, replies come back as token ids
  (``skip_tokenizer_init``) and are decoded with the same tokenizer as the
  transformers backend. Not a hot path.
* ``features``: SGLang's upstream auxiliary-hidden-state capture
  (``--enable-return-aux-hidden-states`` with the ``EAGLE3`` capture
  convention and explicit ``--return-aux-hidden-state-layer-ids``), run by a
  ``ModelRunner`` in a spawned child process (``sglang_runner``). SGLang's
  engine and HTTP server only return hidden states as nested Python float
  lists; the in-process ``LogitsProcessorOutput`` holds them as tensors
  (``hidden_states``: the aux layers ``[T, K*H]``; ``last_hidden_states``: the
  post-norm final state ``[T, H]``). That is internal API of SGLang 0.5.23,
  confined to ``sglang_runner`` and refused for any other version. Tensors
  cross the process boundary through ``torch.multiprocessing`` (shared memory
  on CPU, CUDA IPC on GPU), never as lists or JSON. The child process keeps
  SGLang's own process group and global runtime state out of a target rank
  that already runs ``torch.distributed``.

The two run at once on the target rank's one GPU, so neither is left to SGLang's
default ``mem_fraction_static`` (which assumes an instance alone on the GPU):
each gets an explicit share of ``target.sglang_mem_fraction`` (``gpu_shares``,
``mem_fraction_static``).

Everything that turns SGLang outputs into ``TargetFeatures`` (order of the
captured layers, splitting the packed token axis, padding) is a pure function
here, tested on CPU without SGLang.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from draftforge.errors import InputError
from draftforge.splitserve.target import (
    Reply,
    TargetFeatures,
    check_context,
    check_layer_ids,
    check_token_ids,
    folder_eos_ids,
    folder_tokenizer,
    generated_reply,
    remote_code_error,
    render_prompt,
    sglang_layer_ids,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from draftforge.splitserve.config import GenerationConfig, TargetConfig

SGLANG_VERSION = "0.5.23"
INSTALL_COMMAND = "pip install 'draftforge[sglang]'"
# SGLang names the capture by a draft family, and each model class implements some of
# the families' hooks: DSPARK uses set_dspark_layers_to_capture (the output of layer i:
# Ling-3.0-flash's BailingMoeV3 has only this one) or else set_dflash_layers_to_capture
# (the input of layer i + 1, the same state); EAGLE3 uses set_eagle3_layers_to_capture
# (also the input of layer i + 1), the only hook of Qwen2 and a dozen other classes.
# They give transformers' hidden_states[i + 1] for id i, except in the classes below (and
# their subclasses), which capture another state; they are refused (read from SGLang
# 0.5.23's source). Some classes refuse unsorted ids, so the runner asks for them ascending
# and reorders what comes back.
CAPTURE_HOOKS = (
    ("DSPARK", ("set_dspark_layers_to_capture", "set_dflash_layers_to_capture")),
    ("EAGLE3", ("set_eagle3_layers_to_capture",)),
)
_ENTERING = ("captures the state entering layer i, not leaving it (one layer earlier than "
             "transformers' hidden_states[i + 1] that draftforge trains on)")
_GEMMA3 = ("captures, for id i, the tensor that enters layer i + 1 apart from the residual "
           "stream (its layers keep the residual separate until the next norm), not "
           "transformers' hidden_states[i + 1] that draftforge trains on")
OTHER_CAPTURE = {
    "MuseGlimmerForCausalLM": _ENTERING,  # its DFlash hook
    "MuseGlimmerForConditionalGeneration": _ENTERING,
    "Gemma3ForCausalLM": _GEMMA3,  # its EAGLE3 hook (gemma3_causal.py)
    "Gemma3ForConditionalGeneration": _GEMMA3,  # delegates to Gemma3ForCausalLM's
    "DeepseekV4ForCausalLM": (  # its DSpark hook (deepseek_v4.py)
        "captures the attention input of layer i (one layer earlier than transformers' "
        "hidden_states[i + 1] that draftforge trains on), averaged over its hyper-connection "
        "streams"),
}
# The feature runner's KV pool in tokens: a features batch (split.feature_batch_size rows of
# up to data.max_length) must fit in it whole; the recipe check refuses a split that would not.
RUNNER_TOKENS = 65536
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The generation engine and the feature runner run side by side on the target rank's GPU,
# each with its own copy of the weights and its own KV pool. SGLang makes an instance's
# static memory (weights + KV pool) mem_fraction_static times the GPU memory free when
# that instance starts (its "pre_model_load_memory"), and its default fraction assumes the
# instance is alone on the GPU (0.8-0.95, from the total capacity): left to the defaults,
# the second instance would find only the first one's headroom free. So each instance gets
# an explicit share of the whole GPU, target.sglang_mem_fraction split in this proportion
# (the feature runner's part; the rest is the generation engine's), converted into SGLang's
# fraction of the memory free at its start (``mem_fraction_static``).
FEATURE_RUNNER_SHARE = 0.5
# An instance keeps (1 - mem_fraction_static) of the memory free at its start for its own
# activations and CUDA graphs; a share that needs more than this much of it is refused.
MAX_FRACTION_OF_FREE = 0.95
GIB = float(1 << 30)


class GpuMemory(NamedTuple):
    """A GPU's free and total memory in bytes, as ``torch.cuda.mem_get_info`` reports them."""

    free: int
    total: int


def require_sglang() -> str:
    """Check that the pinned SGLang release is installed (without importing it); returns its
    version. Refused with an :class:`~draftforge.errors.InputError` (exit status 2): an install
    to fix, which a restart of the job would meet again."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as exc:
        raise InputError(
            f"target.backend 'sglang' needs the sglang package (version {SGLANG_VERSION}): "
            f"{INSTALL_COMMAND}, or use target.backend: hf"
        ) from exc
    if version != SGLANG_VERSION:
        raise InputError(
            f"target.backend 'sglang' is pinned to sglang=={SGLANG_VERSION}, but sglang {version} "
            f"is installed: its feature capture uses SGLang internals that change between "
            f"releases. Install the pinned version with {INSTALL_COMMAND}, or use target.backend: hf"
        )
    return version


# ---------------------------------------------------------------- pure helpers


def sampling_params(settings: GenerationConfig, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """SGLang sampling parameters (``sglang.srt.sampling.sampling_params.SamplingParams``) for ``settings``.

    Temperature 0 is greedy (SGLang's own rule: ``top_k`` 1); ``top_k`` 0
    (disabled in draftforge) is SGLang's ``-1``. ``stop_token_ids`` are the
    target's end-of-turn ids, the same the transformers backend stops on.
    """
    params: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "stop_token_ids": [int(i) for i in stop_token_ids],
        "skip_special_tokens": True,
    }
    if settings.temperature == 0:
        params.update(temperature=0.0, top_k=1)
    else:
        params.update(
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k if settings.top_k > 0 else -1,
            # The batch's own seed (draftforge reseeds every batch). SGLang 0.5 applies a
            # request's sampling_seed only in deterministic inference
            # (--enable-deterministic-inference); otherwise its sampler's state decides.
            sampling_seed=int(settings.seed),
        )
    return params


def joint_filter_note(settings: GenerationConfig) -> str | None:
    """What SGLang samples differently from the transformers backend under ``settings``, or
    None. With both ``top_k`` and ``top_p`` set, SGLang's sampler applies both to the target's
    whole distribution (``top_p`` counts the mass of all tokens), where transformers, the
    transformers backend and draftforge's evaluator take the ``top_k`` tokens, renormalise,
    then cut at ``top_p``: a smaller nucleus, the same where the ``top_k`` tokens hold almost
    all the mass. Greedy decoding is the same on both."""
    if settings.temperature == 0 or settings.top_k <= 0 or settings.top_p >= 1.0:
        return None
    return (f"target.generation top_k {settings.top_k} with top_p {settings.top_p}: SGLang cuts both "
            "on the whole distribution, the transformers backend (and draftforge eval) cuts top_p "
            "after renormalising the top_k tokens, so the two backends sample slightly different "
            "answers from the same settings")


def reply_ids(output: dict[str, Any], eos_token_ids: Sequence[int]) -> tuple[list[int], bool]:
    """A reply's token ids and whether the target ended it, from one ``Engine.generate`` output.

    With ``skip_tokenizer_init`` an output is ``{"output_ids": [...],
    "meta_info": {"finish_reason": {"type": "stop" | "length" | "abort", ...}}}``
    (``FINISH_*.to_json`` in ``sglang/srt/managers/schedule_batch.py``). Ids after
    the first end-of-turn token are dropped; an aborted request is an error.
    """
    reason = (output.get("meta_info") or {}).get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in ("stop", "length"):
        raise RuntimeError(f"SGLang did not finish a generation request: finish_reason {reason!r}")
    ids = [int(t) for t in output["output_ids"]]
    eos = set(eos_token_ids)
    for position, token in enumerate(ids):
        if token in eos:
            return ids[: position + 1], True
    return ids, kind == "stop"


def rows_from_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[int]]:
    """Split a right-padded batch [B, S] into its unpadded rows (CPU int64) and their lengths."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be a 2-D tensor [batch, seq], got "
            f"{getattr(input_ids, 'shape', type(input_ids))}"
        )
    batch, seq = input_ids.shape
    if attention_mask is None:
        lengths = [seq] * batch
    else:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids "
                f"shape {tuple(input_ids.shape)}"
            )
        mask = attention_mask.detach().to("cpu").bool()
        lengths = mask.sum(dim=1).tolist()
        for row, length in enumerate(lengths):
            if not bool(mask[row, :length].all()):
                raise ValueError(
                    f"attention_mask row {row} is not right-padded (ones then zeros); the SGLang "
                    f"backend takes right-padded batches"
                )
    ids = input_ids.detach().to("cpu", torch.int64)
    return [ids[row, :length] for row, length in enumerate(lengths)], [int(n) for n in lengths]


def captured_order(layer_ids: Sequence[int]) -> list[int]:
    """The order SGLang's aux states come back in: ascending layer (its models capture inside the layer loop)."""
    return sorted(sglang_layer_ids(layer_ids))


def aux_in_requested_order(
    packed: torch.Tensor, layer_ids: Sequence[int], hidden_size: int
) -> torch.Tensor:
    """Reorder SGLang's ``[..., K*H]`` aux states (ascending layers) into the order of ``layer_ids``.

    draftforge concatenates auxiliary layers in the recipe's order; SGLang's
    ``LlamaModel.forward`` (and its siblings) append a capture whenever the
    layer loop reaches a layer in ``layers_to_capture``, i.e. ascending.
    """
    ids = list(layer_ids)
    if packed.shape[-1] != len(ids) * hidden_size:
        raise ValueError(
            f"SGLang returned aux states of width {packed.shape[-1]}, expected "
            f"{len(ids)} layers x {hidden_size}"
        )
    order = captured_order(ids)
    if order == sglang_layer_ids(ids):
        return packed
    slots = packed.unflatten(-1, (len(ids), hidden_size))
    index = torch.tensor([order.index(i) for i in sglang_layer_ids(ids)], device=packed.device)
    return slots.index_select(-2, index).flatten(-2)


def pad_packed(packed: torch.Tensor, lengths: Sequence[int], seq_len: int) -> torch.Tensor:
    """Scatter token-packed states ``[sum(lengths), D]`` into a right-padded ``[B, seq_len, D]`` (zeros outside)."""
    total = sum(lengths)
    if packed.dim() != 2 or packed.shape[0] != total:
        raise ValueError(
            f"SGLang returned states of shape {tuple(packed.shape)}, expected [{total}, D] "
            f"for {len(lengths)} sequences of lengths {list(lengths)}"
        )
    if any(n > seq_len for n in lengths):
        raise ValueError(f"a sequence length in {list(lengths)} exceeds seq_len {seq_len}")
    out = packed.new_zeros(len(lengths), seq_len, packed.shape[1])
    mask = torch.arange(seq_len).unsqueeze(0) < torch.tensor(list(lengths)).unsqueeze(1)
    out[mask.to(packed.device)] = packed
    return out


def features_from_packed(
    aux: torch.Tensor,
    final: torch.Tensor,
    lengths: Sequence[int],
    seq_len: int,
    layer_ids: Sequence[int],
    hidden_size: int,
    dtype: torch.dtype,
) -> TargetFeatures:
    """``TargetFeatures`` [B, S, ...] from SGLang's token-packed aux ``[T, K*H]`` and final ``[T, H]`` states."""
    if final.dim() != 2 or final.shape[-1] != hidden_size:
        raise ValueError(
            f"SGLang returned final states of shape {tuple(final.shape)}, expected [T, {hidden_size}]"
        )
    aux = aux_in_requested_order(aux, layer_ids, hidden_size)
    return TargetFeatures(
        aux=pad_packed(aux, lengths, seq_len).to(dtype),
        final=pad_packed(final, lengths, seq_len).to(dtype),
    )


def capture_convention(model_cls: type) -> str:
    """The ``speculative_algorithm`` that makes SGLang's ``model_cls`` capture auxiliary
    hidden states (see ``CAPTURE_HOOKS``); a clear error when it implements no hook, or
    captures at other layers than the transformers backend does."""
    for cls in model_cls.__mro__:
        if cls.__name__ in OTHER_CAPTURE:
            raise RuntimeError(f"SGLang's {model_cls.__name__} {OTHER_CAPTURE[cls.__name__]}; "
                               "use target.backend: hf for this model")
    for convention, hooks in CAPTURE_HOOKS:
        if any(hasattr(model_cls, hook) for hook in hooks):
            return convention
    names = ", ".join(hook for _, hooks in CAPTURE_HOOKS for hook in hooks)
    raise RuntimeError(
        f"SGLang's {model_cls.__name__} implements none of {names}, so it cannot return the "
        "auxiliary hidden states a draft trains on; use target.backend: hf for this model"
    )


def sglang_model_class(model_path: str) -> type:
    """The SGLang model class that serves the model in ``model_path`` (its config.json's
    first architecture), resolved by SGLang's own registry."""
    from sglang.srt.models.registry import ModelRegistry

    config = json.loads((Path(model_path) / "config.json").read_text())
    model_cls, _ = ModelRegistry.resolve_model_cls(config.get("architectures") or [])
    return model_cls


def gpu_shares(mem_fraction: float) -> dict[str, float]:
    """The share of the whole GPU each SGLang instance may hold as static memory:
    ``"engine"`` (generation) and ``"runner"`` (features), ``mem_fraction`` together."""
    if not 0.0 < mem_fraction < 1.0:
        raise ValueError(f"target.sglang_mem_fraction must be in (0, 1), got {mem_fraction}")
    runner = mem_fraction * FEATURE_RUNNER_SHARE
    return {"engine": mem_fraction - runner, "runner": runner}


def mem_fraction_static(
    share: float, memory: GpuMemory, *, who: str, weight_bytes: int = 0
) -> float:
    """SGLang's ``mem_fraction_static`` for an instance starting now that is to hold ``share``
    of the GPU's total memory: SGLang applies the fraction to the memory free at the
    instance's start, not to the total. Refuses, naming the recipe key, a share that the
    free memory cannot hold or that the weights (``weight_bytes``) alone fill."""
    if memory.total <= 0 or not 0 < memory.free <= memory.total:
        raise ValueError(f"implausible GPU memory: {memory.free} bytes free of {memory.total}")
    wanted = share * memory.total
    where = (
        f"{wanted / GIB:.1f} GiB ({share:.3g} of the target GPU's {memory.total / GIB:.1f} GiB, "
        f"its part of target.sglang_mem_fraction)"
    )
    if wanted <= weight_bytes:
        raise RuntimeError(
            f"the target's weights ({weight_bytes / GIB:.1f} GiB) fill the SGLang {who}'s share "
            f"of {where}, leaving nothing for its KV pool; raise target.sglang_mem_fraction or "
            f"use a GPU with more memory"
        )
    fraction = wanted / memory.free
    if fraction > MAX_FRACTION_OF_FREE:
        raise RuntimeError(
            f"the SGLang {who} is to hold {where}, but only {memory.free / GIB:.1f} GiB of the "
            f"GPU are free as it starts, and it needs {1 - MAX_FRACTION_OF_FREE:.0%} of the free "
            f"memory besides for its activations; lower target.sglang_mem_fraction or stop "
            f"what else runs on that GPU"
        )
    return math.floor(fraction * 10_000) / 10_000  # rounded down: never more than the share


def runner_args(
    cfg: TargetConfig,
    model_path: str,
    layer_ids: Sequence[int],
    *,
    device: torch.device,
    max_total_tokens: int,
    convention: str,
    memory: GpuMemory | None = None,
    weight_bytes: int = 0,
    tp_size: int = 1,
) -> dict[str, Any]:
    """``ServerArgs`` fields for the feature runner: aux capture of ``layer_ids`` under the
    model class's ``convention`` (:func:`capture_convention`), no draft, no CUDA graphs.

    On a GPU, ``memory`` (free and total as it starts; under tensor parallelism the
    tightest of the group's GPUs) is required: the runner's static memory is held to its
    share of ``target.sglang_mem_fraction`` (:func:`gpu_shares`) on each of its GPUs.
    """
    return {
        **_common_args(cfg, model_path, device, "runner", memory, weight_bytes, tp_size),
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": convention,
        "return_aux_hidden_state_layer_ids": captured_order(layer_ids),  # some classes refuse unsorted
        "max_total_tokens": max_total_tokens,
        "disable_cuda_graph": True,  # prefill only: no decode graphs to capture
        "disable_radix_cache": True,
    }


def engine_args(
    cfg: TargetConfig,
    model_path: str,
    *,
    device: torch.device,
    memory: GpuMemory | None = None,
    weight_bytes: int = 0,
    tp_size: int = 1,
) -> dict[str, Any]:
    """``ServerArgs`` fields of the generation engine: token ids in and out, seeded from the recipe.

    On a GPU, ``memory`` (free and total as it starts; under tensor parallelism the
    tightest of the group's GPUs) is required: the engine's static memory is held to its
    share of ``target.sglang_mem_fraction`` (:func:`gpu_shares`) on each of its GPUs.
    """
    return {
        **_common_args(cfg, model_path, device, "engine", memory, weight_bytes, tp_size),
        "skip_tokenizer_init": True,
        "random_seed": cfg.generation.seed,
    }


_INSTANCE_NAMES = {"engine": "generation engine", "runner": "feature runner"}


def _common_args(
    cfg: TargetConfig,
    model_path: str,
    device: torch.device,
    instance: str,
    memory: GpuMemory | None,
    weight_bytes: int,
    tp_size: int,
) -> dict[str, Any]:
    """Arguments both instances share. Under tensor parallelism (``tp_size`` GPUs from
    ``device``'s index on, SGLang's own placement) each GPU holds about 1/tp_size of the
    weights (``weight_bytes`` is the whole checkpoint)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    args: dict[str, Any] = {
        "model_path": model_path,
        "dtype": cfg.dtype,
        "trust_remote_code": cfg.trust_remote_code,
        "device": device.type,
        "tp_size": tp_size,
        "log_level": "error",
    }
    if device.type == "cuda":
        args["base_gpu_id"] = 0 if device.index is None else device.index
        who = _INSTANCE_NAMES[instance]
        if memory is None:
            raise ValueError(
                f"the SGLang {who} on {device} needs the GPU's free and total memory to size "
                f"its share of target.sglang_mem_fraction"
            )
        share = gpu_shares(cfg.sglang_mem_fraction)[instance]
        args["mem_fraction_static"] = mem_fraction_static(
            share, memory, who=who, weight_bytes=weight_bytes // tp_size
        )
    return args


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of the folder's ``*.safetensors`` files: the weights as stored (a lower bound
    where the recipe's dtype is wider than the checkpoint's)."""
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


# The input embedding's name: Llama/Qwen-style checkpoints, and Bailing/Ling (BailingMoeV3,
# loaded by SGLang's bailing_moe_v3.py under model.word_embeddings).
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.word_embeddings.weight")
OUTPUT_HEAD_NAMES = ("lm_head.weight",)
SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint folder: its index's ``weight_map``, or
    the keys of its ``*.safetensors`` files where it has no index."""
    from safetensors import safe_open

    from draftforge.train.hf_load import index_weight_map

    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return index_weight_map(index, advice=f"the target checkpoint in {folder} is incomplete or "
                                "damaged; download it again")
    files: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file.name))
    return files


def read_weight(folder: Path, names: Sequence[str], *, what: str = "weight") -> torch.Tensor:
    """The first of ``names`` the folder's safetensors hold (``what`` names it in the error)."""
    from safetensors import safe_open

    files = weight_files(folder)
    for name in names:
        if name in files:  # weight_files found every file it names
            with safe_open(str(folder / files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    where = SAFETENSORS_INDEX if (folder / SAFETENSORS_INDEX).is_file() else "*.safetensors files"
    raise InputError(f"target folder {folder}: no {what} tensor; looked for {', '.join(names)} in its {where}")


# torchrun tells its ranks to use the launcher's rendezvous store, and torch.distributed
# obeys it in every process that inherits the variable: SGLang's own ranks then all
# wait as clients of a store nobody hosts (seen with SGLang 0.5.23 under draftforge
# train: both scheduler ranks hung in _create_c10d_store). SGLang instances start
# without it.
TORCHRUN_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """SIGTERM's handler as it was before the block, put back after it where the engine
    replaced it: SGLang's first request installs, in the main thread, an event-loop handler
    whose graceful exit ends the process tree by SIGKILL once the loop next runs. A rank's
    own handler (:func:`~draftforge.splitserve.roles.interrupt_once`) unwinds instead, closing
    the feature runner before the engine (:meth:`SGLangTarget.close`)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        now = signal.getsignal(signal.SIGTERM)
        # SIG_DFL, SIG_IGN or one marked after_stop: the rank's own handler ran meanwhile and
        # set what comes after it
        after_stop = now in (signal.SIG_DFL, signal.SIG_IGN) or getattr(now, "after_stop", False)
        if before is not None and now is not before and not after_stop:
            import asyncio

            with contextlib.suppress(Exception):
                loop = asyncio.get_event_loop_policy().get_event_loop()
                handle = getattr(loop, "_signal_handlers", {}).get(signal.SIGTERM)
                if handle is not None:  # uvloop (SGLang's policy) removes none while not running:
                    handle.cancel()     # a cancelled handle is skipped by both loops
                loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def without_torchrun_store() -> Iterator[None]:
    """Starts processes (SGLang's ranks) that build their own ``torch.distributed`` world
    without torchrun's agent-store variable, restoring it afterwards."""
    saved = os.environ.pop(TORCHRUN_STORE_VARIABLE, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[TORCHRUN_STORE_VARIABLE] = saved


def numa_node_count() -> int:
    """NUMA nodes of this machine, as Linux lists them (1 where it lists none)."""
    nodes = Path("/sys/devices/system/node")
    return max(1, len(list(nodes.glob("node[0-9]*"))) if nodes.is_dir() else 0)


def cpu_threads_bind(tp_size: int, *, cpus: Sequence[int], numa_nodes: int) -> str | None:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp_size`` SGLang ranks on the CPU: ``cpus`` split
    into ``tp_size`` contiguous groups ("0,1|2,3"), or None where SGLang's default of one NUMA
    node per rank applies. SGLang 0.5.23 refuses more CPU ranks than NUMA nodes unless the
    variable is set (``init_threads_binding``, ``sglang/srt/utils/numa_utils.py``)."""
    if tp_size <= max(1, numa_nodes):
        return None
    cpus = sorted(cpus)
    bounds = [rank * len(cpus) // tp_size for rank in range(tp_size + 1)]
    # with fewer CPUs than ranks, neighbouring ranks share one
    groups = [cpus[bounds[r]:bounds[r + 1]] or [cpus[bounds[r]]] for r in range(tp_size)]
    return "|".join(",".join(str(cpu) for cpu in group) for group in groups)


def tensor_parallel_gpus(device: torch.device, tensor_parallel: int) -> list[int]:
    """The GPUs a target group of ``tensor_parallel`` ranks led from ``device`` runs on:
    ``device``'s index and the ones after it, as SGLang places a group from its
    ``base_gpu_id`` (empty on CPU). Refuses a group that runs past the visible GPUs."""
    if tensor_parallel < 1:
        raise ValueError(f"split.target_tensor_parallel must be at least 1, got {tensor_parallel}")
    if device.type != "cuda":
        return []
    first = 0 if device.index is None else device.index
    gpus = list(range(first, first + tensor_parallel))
    visible = torch.cuda.device_count()
    if tensor_parallel > 1 and gpus[-1] >= visible:
        raise ValueError(
            f"a tensor-parallel target group of {tensor_parallel} from GPU {first} needs GPUs "
            f"{gpus}, but {visible} are visible"
        )
    return gpus


# ---------------------------------------------------------------- the engine


class SGLangTarget:
    """A target served by SGLang ``SGLANG_VERSION`` as a ``TargetEngine``.

    The generation engine and the feature runner start on first use; call
    ``close()`` (or let the object be collected) to stop them. Both stay up side
    by side on the one GPU, each within its share of ``target.sglang_mem_fraction``
    (:func:`gpu_shares`), whichever starts first.

    ``tensor_parallel`` > 1 serves the target from that many GPUs, ``device``'s index
    and the ones after it: both instances are SGLang tensor-parallel groups over them
    (the engine through ``tp_size``, the feature runner as one child process per rank),
    and each instance's share holds on every GPU of the group.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        layer_ids: Sequence[int],
        cfg: TargetConfig,
        *,
        name: str | None = None,
        device: str | torch.device = "cpu",
        max_total_tokens: int = RUNNER_TOKENS,
        tensor_parallel: int = 1,
    ) -> None:
        require_sglang()
        from transformers import AutoConfig

        from draftforge.splitserve.hf_backend import _checked_model_folder

        self.folder = _checked_model_folder(folder)
        self.cfg = cfg
        self.name = name or self.folder.name
        self.trained = True
        self.device = torch.device(device)
        self.tensor_parallel = int(tensor_parallel)
        self.gpus = tensor_parallel_gpus(self.device, self.tensor_parallel)
        self.dtype = DTYPES[cfg.dtype]
        try:  # the transformers backend's errors for the same folder, not a library traceback
            config = AutoConfig.from_pretrained(
                str(self.folder), trust_remote_code=cfg.trust_remote_code
            ).get_text_config()
        except ValueError as err:
            if "trust_remote_code" in str(err) and not cfg.trust_remote_code:
                raise remote_code_error(self.folder, err) from err
            raise InputError(f"target folder {self.folder}: transformers cannot read its config.json "
                             f"({err})") from err
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        #: the longest sequence the target was made for (None where its config does not say)
        context = getattr(config, "max_position_embeddings", None)
        self.max_position_embeddings = int(context) if context else None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.layer_ids = check_layer_ids(layer_ids, self.num_hidden_layers)
        self._tokenizer = folder_tokenizer(self.folder, cfg)
        self.max_total_tokens = max_total_tokens
        self._engine: Any = None
        self._runner: Any = None
        self._noted: set[str] = set()  # notes printed once per target

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer (with its chat template)."""
        return self._tokenizer

    def eos_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn."""
        return folder_eos_ids(self._tokenizer, self.folder)

    def generate(
        self, conversations: list[list[dict[str, str]]], settings: GenerationConfig
    ) -> list[Reply]:
        """One assistant reply per conversation, sampled by SGLang with the recipe's settings.

        Prompts are rendered exactly as the transformers backend renders them
        and sent as token ids; replies are decoded without special tokens.
        SGLang seeds its sampler once, at engine start, from
        ``target.generation.seed``, and ignores each batch's seed unless the engine runs
        deterministic inference: sampled replies then depend on the calls made before
        them, so a resumed regeneration samples the answers it redoes afresh (greedy is
        exact). No sample is lost or repeated; the answers differ.
        """
        prompts: list[list[int]] = []
        for index, conversation in enumerate(conversations):
            text = render_prompt(self._tokenizer, conversation, index, settings)
            prompts.append(self._tokenizer(text, add_special_tokens=False)["input_ids"])
            where = f"target {self.name!r}: the prompt of conversation {index}"
            try:
                check_token_ids(torch.tensor([prompts[-1]], dtype=torch.long), self.vocab_size, where,
                                self._tokenizer)
                check_context(len(prompts[-1]), settings.max_new_tokens, self.max_position_embeddings, where)
            except InputError as err:
                err.conversation_index = index  # regeneration names the prompt's file, line and id
                raise
        if not prompts:
            return []
        eos = self.eos_token_ids()
        params = sampling_params(settings, eos)
        note = joint_filter_note(settings)
        if note is not None and note not in self._noted:
            self._noted.add(note)
            print(f"draftforge: note: {note}", file=sys.stderr, flush=True)
        engine = self._generation_engine()
        with sigterm_kept():
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
        replies = []
        for output in outputs:
            ids, finished = reply_ids(output, eos)
            # a reply cut inside a character ends at its last whole one (target.generated_reply)
            replies.append(generated_reply(self._tokenizer, ids, finished, eos))
        return replies

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> TargetFeatures:
        """Aux-layer outputs [B, S, K*H] and final post-norm states [B, S, H], zero outside the mask."""
        rows, lengths = rows_from_batch(input_ids, attention_mask)
        # before SGLang sees them; its embedding has config.vocab_size rows
        check_token_ids(input_ids, self.vocab_size, f"target {self.name!r}: features", self._tokenizer)
        seq_len = input_ids.shape[1]
        present = [row for row in rows if len(row) > 0]
        if present:
            aux, final = self._feature_runner().features(present)
        else:
            aux = torch.zeros(0, len(self.layer_ids) * self.hidden_size, dtype=self.dtype)
            final = torch.zeros(0, self.hidden_size, dtype=self.dtype)
        features = features_from_packed(
            aux, final, lengths, seq_len, self.layer_ids, self.hidden_size, self.dtype
        )
        return TargetFeatures(
            aux=features.aux.to(self.device), final=features.final.to(self.device)
        )

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [V, H_t], read from the folder's safetensors (tied: the embedding)."""
        names = [*OUTPUT_HEAD_NAMES, *(EMBEDDING_NAMES if self.tie_word_embeddings else ())]
        return read_weight(self.folder, names, what="output head").to(self.device, self.dtype)

    def embed_tokens_weight(self) -> torch.Tensor:
        """The input embedding [V, H_t], read from the folder's safetensors."""
        return read_weight(self.folder, EMBEDDING_NAMES, what="input embedding").to(self.device, self.dtype)

    def close(self) -> None:
        """Stop the feature runner, then the generation engine (both restart on next use).

        In this order: SGLang's ``Engine.shutdown`` SIGKILLs every child of this process,
        the runner's too, which then never stops cleanly. The engine is shut down even when
        stopping the runner fails."""
        runner, engine = self._runner, self._engine
        self._runner = self._engine = None
        try:
            if runner is not None:
                runner.close()
        finally:
            if engine is not None:
                engine.shutdown()

    def _select_sglang_device(self) -> None:
        """SGLang's CPU path is chosen by this switch, read when sglang is first imported
        (by the engine or, for the feature runner, by the model registry)."""
        if self.device.type == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            if self.tensor_parallel > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
                bind = cpu_threads_bind(self.tensor_parallel, cpus=os.sched_getaffinity(0),
                                        numa_nodes=numa_node_count())
                if bind is not None:  # inherited by every rank the engine or runner spawns
                    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind

    def _gpu_memory(self) -> GpuMemory | None:
        """The target GPUs' free and total memory now, just before an SGLang instance starts
        (None on CPU): each instance's share is converted against what is free at its start,
        on the group's tightest GPU under tensor parallelism."""
        if self.device.type != "cuda":
            return None
        measured = [torch.cuda.mem_get_info(torch.device("cuda", gpu)) for gpu in self.gpus]
        return min((GpuMemory(free=int(f), total=int(t)) for f, t in measured),
                   key=lambda memory: memory.free)

    def _generation_engine(self) -> Any:
        if self._engine is None:
            self._select_sglang_device()
            import sglang

            args = engine_args(
                self.cfg,
                str(self.folder),
                device=self.device,
                memory=self._gpu_memory(),
                weight_bytes=checkpoint_bytes(self.folder),
                tp_size=self.tensor_parallel,
            )
            if self.device.type == "cpu":
                # on the CPU each SGLang rank sizes its KV pool from all the RAM free at its
                # start (two ranks of SmolLM2 took 11 GB each, and one was killed): bound it
                args["max_total_tokens"] = self.max_total_tokens
            with without_torchrun_store():
                self._engine = sglang.Engine(**args)
        return self._engine

    def _feature_runner(self) -> Any:
        if self._runner is None:
            from draftforge.splitserve.sglang_runner import FeatureRunnerProcess

            self._select_sglang_device()
            args = runner_args(
                self.cfg,
                str(self.folder),
                self.layer_ids,
                device=self.device,
                max_total_tokens=self.max_total_tokens,
                convention=capture_convention(sglang_model_class(str(self.folder))),
                memory=self._gpu_memory(),
                weight_bytes=checkpoint_bytes(self.folder),
                tp_size=self.tensor_parallel,
            )
            with without_torchrun_store():
                self._runner = FeatureRunnerProcess(args, num_threads=self.cfg.num_threads)
        return self._runner
