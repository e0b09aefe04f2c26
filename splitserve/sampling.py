"""Batched decoding for the transformers backend: a KV-cached loop with a top-k-first sampler.

``transformers``' ``generate`` samples over the whole vocabulary even after top-k has left
20 finite logits: top-p sorts all V of them and the multinomial draw touches all V. On a
CPU, with SmolLM2's 49,152 tokens at batch 16, that was about a quarter of each decoding
step. Here the sampler takes the top-k logits first and applies temperature, top-p and the
draw to those k only; the distribution is the same (temperature, then top-k, then top-p,
as ``transformers`` orders them), which a test checks against ``transformers``' own logits
processors. Greedy decoding is the argmax and matches ``generate`` token for token.

Two limits, both found by an audit and left as they are, since changing how the
draws are made would change every regenerated answer the README's figures rest on:

- one generator draws for the rows still generating, so a row's sampled tokens depend
  on the other rows of its batch and on when they end (and so on whether the cache
  can drop finished rows). Answers are reproducible for the same prompts, batch size
  and backend, which is what resume relies on, not across batch compositions;
- ``torch.topk`` keeps exactly ``top_k`` tokens where transformers keeps every token
  tied with the k-th. Float32 logits practically never tie; SmolLM2's bf16 logits tied
  at the 20th place at 60 of 138 positions measured, which moved the distribution by
  a total variation of 4e-4 on average (0.03 at most).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import cache_utils

from draftforge.splitserve.kv_cache import growing_cache

# the base class of transformers' linear-attention cache layers (none in a release without them)
_LINEAR_ATTENTION = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())

if TYPE_CHECKING:
    from draftforge.splitserve.config import GenerationConfig

_STOP: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("decode_stop", default=None)


class DecodingStopped(Exception):
    """Raised by :func:`decode` inside :func:`stopping_when` once its check says stop: the
    batch's replies are not finished, and none are returned."""


@contextlib.contextmanager
def stopping_when(check: Callable[[], bool]) -> Iterator[None]:
    """Within the block, :func:`decode` asks ``check`` before each step and raises
    :class:`DecodingStopped` once it is true (a target rank whose trainers have all stopped
    would otherwise finish a whole chunk's answers no one takes: tens of seconds on a CPU)."""
    token = _STOP.set(check)
    try:
        yield
    finally:
        _STOP.reset(token)


def kv_cache_argument(model) -> str:
    """The name under which ``model.forward`` takes and returns its KV cache: ``cache`` in
    transformers >= 5.2x (``past_key_values`` still works there, with a deprecation warning,
    until 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill_arguments(model) -> dict[str, int]:
    """``logits_to_keep=1`` where ``model.forward`` names that argument (only the last position's
    logits are needed), else nothing: as ``transformers``' ``generate`` decides, since a model
    whose forward lacks it (remote code written before it existed) raises a TypeError on it.
    The evaluator's prefill (``draftforge.eval.speculative.TargetSession``) asks the same."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32, whose softmax is the distribution to sample. A
    temperature so small that the quotient overflows (below about 1e-37 for logits of tens)
    would make a row's maximum infinite, and its softmax NaN; there each row is first shifted
    by its maximum, which leaves the softmax unchanged, so the quotient is 0 at the row's most
    likely tokens and negative or -inf elsewhere: the limit, greedy choice among ties. Where
    every row's maximum is finite the plain quotient is kept, bit for bit."""
    logits = logits.float()
    scaled = logits / temperature
    if bool(torch.isfinite(scaled.amax(dim=-1)).all()):
        return scaled
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    # in float64, where every positive temperature is above 0 (below about 7e-46 it is 0 in
    # float32, and 0 / 0 is NaN at the maximum); the quotient's float32 is 0 or negative or -inf
    return (shifted.double() / temperature).float()


def top_k_top_p(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The temperature-scaled softmax over the ``top_k`` most likely tokens of each row (all
    when 0), most likely first, with the tokens past the ``top_p`` nucleus set to 0 (not
    renormalised): ``(probs, token ids)``, both ``[..., k]``. The sampler here and the
    evaluator's rejection sampling (``draftforge.eval.speculative.sampling_probs``) share it."""
    vocab = logits.shape[-1]
    k = vocab if top_k <= 0 else min(top_k, vocab)
    values, indices = torch.topk(scaled_logits(logits, temperature), k, dim=-1)  # descending
    probs = torch.softmax(values, dim=-1)
    if top_p < 1.0:
        # keep a token while the mass before it is below top_p: the first always stays
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= top_p, 0.0)
    return probs, indices


def next_tokens(logits: torch.Tensor, settings: GenerationConfig, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: argmax at temperature 0, else a draw from the
    temperature-scaled distribution restricted to the top ``top_k`` tokens (all when 0) and
    then to the smallest set of those whose probability reaches ``top_p``."""
    if settings.temperature <= 0:
        return logits.argmax(dim=-1)
    probs, indices = top_k_top_p(logits, settings.temperature, settings.top_k, settings.top_p)
    choice = torch.multinomial(probs, 1, generator=generator)
    return indices.gather(-1, choice).squeeze(-1)


def _drops_rows(cache) -> bool:
    """Whether ``cache`` can drop the rows that ended: every layer must select its rows.
    transformers' linear-attention layers cannot (their conv and recurrent states have no
    row selection, or one inherited from an attention layer that leaves them whole), so a
    hybrid model (Ling-3.0-flash, Qwen3-Next) keeps its ended rows in the batch instead."""
    if not hasattr(cache, "batch_select_indices"):
        return False
    layers = getattr(cache, "layers", None)
    return layers is None or all(
        hasattr(layer, "batch_select_indices") and not isinstance(layer, _LINEAR_ATTENTION)
        for layer in layers)


@torch.no_grad()
def decode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: GenerationConfig,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Generate up to ``settings.max_new_tokens`` after left-padded ``input_ids`` [B, S].

    Returns the new tokens [B, T]; a row that has produced an end-of-sequence id is
    padded with ``pad_id`` after it. The KV cache is a ``GrowingCache`` where the model
    allows it (see ``kv_cache``). Rows that have ended leave the batch (their KV cache
    rows are dropped, when the cache supports it), so the remaining steps compute only
    the rows still generating; decoding stops once every row has ended. Within
    :func:`stopping_when`, raises :class:`DecodingStopped` once its check says stop.
    """
    stop = _STOP.get()
    batch = input_ids.shape[0]
    device = input_ids.device
    eos = torch.tensor(sorted(set(eos_ids)), device=device)
    cache_arg = kv_cache_argument(model)
    mask = attention_mask.to(torch.long)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    cache = growing_cache(model, input_ids.shape[1] + settings.max_new_tokens)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **prefill_arguments(model), **({} if cache is None else {cache_arg: cache}))
    cache, logits = getattr(out, cache_arg), out.logits[:, -1]
    next_position = positions[:, -1:] + 1
    result = torch.full((batch, settings.max_new_tokens), pad_id, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # the original row of each row still in the batch
    live = torch.ones(batch, dtype=torch.bool, device=device)  # still generating
    for step in range(settings.max_new_tokens):
        if stop is not None and stop():
            raise DecodingStopped(f"stopped after {step} of up to {settings.max_new_tokens} new tokens")
        token = next_tokens(logits, settings, generator)
        result[rows[live], step] = token[live]
        live &= ~torch.isin(token, eos)
        if not bool(live.any()) or step + 1 == settings.max_new_tokens:
            break
        if not bool(live.all()) and _drops_rows(cache):
            keep = live.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, token, mask, next_position, live = (
                x[keep] for x in (rows, token, mask, next_position, live))
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=device)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                    use_cache=True, **{cache_arg: cache})
        cache, logits = getattr(out, cache_arg), out.logits[:, -1]
        next_position = next_position + 1
    return result[:, : step + 1]
