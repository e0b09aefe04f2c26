"""Real speculative decoding with the target: the loop, its verification rules and the lossless check.

One prompt at a time (batch 1), the target runs with a KV cache:

1. Prefill the prompt; the target's next token (greedy or sampled) is the
   first output token and the first anchor ``x_p``.
2. A round: the proposer drafts up to γ tokens after the anchor. The DSpark
   draft runs the block ``[x_p, MASK, ...]`` at positions ``p .. p+γ-1`` over
   the context features of positions ``< p`` (a buffer of the auxiliary layer
   outputs the target produced while verifying, preallocated and written in
   place: a round copies only the positions it adds), then the sequential
   Markov drafting. As a server keeps its draft KV cache, the
   draft keeps the context's projected keys and values across rounds and
   projects only the positions accepted since the last one.
3. The target verifies ``[x_p, d_0 .. d_{n-1}]`` (width ``n + 1``, cut so that
   no draft lies past the target's ``max_position_embeddings``) in one
   forward with its cache: greedy accepts the longest prefix with
   ``d_k == argmax``, sampling uses standard rejection sampling; the target's
   token after the accepted prefix is the bonus, the next anchor. Sampling
   draws from the temperature-scaled distribution restricted to the top-k
   tokens and then to the top-p nucleus (:func:`sampling_probs`). The draft
   proposes either its most likely tokens (``greedy``, the default: llama.cpp
   verifies deterministic drafts, each accepted with the target's probability
   of it) or tokens drawn from its own cut distribution (``sample``, accepted
   with ``min(1, p_t/p_d)``; SGLang's DSPARK draws a sampled request's drafts
   from the draft's temperature-scaled distribution).
4. The cache is cropped to the accepted length. Acceptance length of the round
   = accepted drafts + 1 (a round whose accepted drafts contain EOS counts up to
   the EOS, without the bonus, as DeepSpec does). The round that reaches past
   ``max_new_tokens`` counts its whole run and the output is cut after it, as
   DeepSpec's evaluator counts: at most one such round a prompt. No round runs
   once the output holds ``max_new_tokens`` tokens, nor after an EOS from the
   prefill. There DeepSpec differs: when a round ends exactly at
   ``max_new_tokens`` its loop runs and counts one more round, all of whose
   tokens it then cuts; draftforge does not count a round that adds nothing.

Verification modes: ``full`` verifies every draft; ``threshold`` verifies only
the prefix before the first draft whose confidence ``sigmoid(c_k)`` is below
the threshold (static confidence scheduling).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from draftforge.splitserve.hf_backend import captured_outputs, decoder_layers_and_norm
from draftforge.splitserve.sampling import (
    kv_cache_argument,
    prefill_arguments,
    scaled_logits,
    top_k_top_p,
)
from draftforge.train.model import ContextCache


class LosslessCheckError(AssertionError):
    """Greedy speculative decoding produced a different output than plain greedy decoding."""


@dataclass
class Proposal:
    """Drafted tokens after the anchor, with the draft's distributions (sampling) and confidences."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [n, V] fp32, the distributions the tokens were drawn from
    confidence_logits: list[float] | None = None  # [n]
    margins: list[float] | None = None  # greedy drafts: top-1 minus top-2 logit of each slot


@dataclass
class Round:
    """One verification round."""

    num_proposed: int
    num_verified: int  # drafts counted as verified: sent to the target, up to an accepted EOS
    num_accepted: int
    acceptance_length: int  # accepted + 1, or up to the EOS
    confidence_logits: list[float] | None = None
    num_sent: int | None = None  # drafts the target ran (it runs num_sent + 1 tokens); None: num_verified

    @property
    def tokens_run(self) -> int:
        """Tokens the target ran this round: the anchor and every draft sent, the ones after an
        accepted EOS included (the acceptance counts stop at the EOS, the work does not)."""
        return (self.num_verified if self.num_sent is None else self.num_sent) + 1


@dataclass
class DecodeResult:
    """The output of one prompt and how it was produced."""

    prompt_len: int
    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    wall_s: float = 0.0
    top2_margins: list[float] | None = None  # plain decoding only: per output token
    # plain decoding only: per output token, its NEAR_TIE_CANDIDATES most likely tokens and how
    # far each lies below the top logit (which token a near-tie may have swapped in)
    top_gaps: list[dict[int, float]] | None = None

    @property
    def mean_acceptance_length(self) -> float:
        if not self.rounds:
            return float("nan")
        return sum(r.acceptance_length for r in self.rounds) / len(self.rounds)


def target_context(model) -> int | None:
    """The target's ``max_position_embeddings`` (its context), or None where its config has none."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


class TargetSession:
    """The target model with a KV cache, capturing the auxiliary layer outputs of every token it runs.

    ``layer_ids`` follows draftforge's convention (output of decoder layer i =
    ``hidden_states[i + 1]``), as ``HFTarget.features`` does, so the features
    the draft sees at serving equal those it was trained on. ``max_positions`` is the
    target's context (:func:`target_context`), which :func:`speculative_decode` sends no
    draft past.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] | None) -> None:
        self.model = model.eval()
        self.layer_ids = list(layer_ids or [])
        # inputs go to the embedding's device, and the captured layers are gathered there
        # (the first device when the target is spread over several)
        self.device = model.get_input_embeddings().weight.device
        self._layers, _ = decoder_layers_and_norm(model)
        self._cache_arg = kv_cache_argument(model)
        self.max_positions = target_context(model)
        self.cache = None
        self.length = 0
        self._kept = 0  # tokens of one forward whose states the cache keeps for a rollback

    @torch.no_grad()
    def _run(self, token_ids: Sequence[int], **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with captured_outputs({i: self._layers[i] for i in self.layer_ids}) as captured:
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: self.cache}, **kwargs)
        self.cache = getattr(out, self._cache_arg)
        self.length += len(token_ids)
        aux = None
        if self.layer_ids:
            aux = torch.cat([captured[i][0].to(self.device) for i in self.layer_ids], dim=-1)
        return out.logits[0].float(), aux

    def prefill(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start a new sequence: the next-token logits of its last token [1, V] fp32 (the lm_head
        runs on that one where the model's forward takes ``logits_to_keep``: [L, V] of a long
        prompt would not fit; one whose forward lacks it computes every row and the last is
        kept) and aux features [L, K*H_t]."""
        self.cache, self.length, self._kept = None, 0, 0
        logits, aux = self._run(token_ids, **prefill_arguments(self.model))
        return logits[-1:], aux

    def extend(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append tokens at positions ``length ..``; their logits and aux features. A
        :meth:`crop` follows before the next ``extend``."""
        if len(token_ids) > self._kept and hasattr(self.cache, "activate_past_recording"):
            # Sliding-window and linear-attention layers (Ling-3.0's KDA) keep only what the
            # next token needs, so that no rejected draft could be rolled back: told so, they
            # keep the states of this forward's tokens until the crop. Not on the prefill, whose
            # states no crop needs (transformers' assisted decoding waits likewise).
            self.cache.activate_past_recording(recurrent_states_to_keep=len(token_ids))
            self._kept = len(token_ids)
        return self._run(token_ids)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of the cache (also when that is all of them, once
        :meth:`extend` asked the cache to keep states for a rollback: the crop trims them)."""
        remove = self.length - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if remove or self._kept:
            self.cache.crop(-remove)
        self.length = length


# ----------------------------------------------------------------------------- verification rules


def matching_prefix(drafts: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading ``drafts`` equal ``reference`` token for token (the greedy rule)."""
    accepted = 0
    while accepted < min(len(drafts), len(reference)) and drafts[accepted] == reference[accepted]:
        accepted += 1
    return accepted


def greedy_accept(drafts: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix with ``d_k == argmax`` of the target at slot k; returns (accepted, bonus token).

    ``target_logits`` [n + 1, V]: row k is the target's distribution for the token after
    ``[anchor, d_0 .. d_{k-1}]``.
    """
    best = target_logits.argmax(dim=-1).tolist()
    accepted = matching_prefix(drafts, best)
    return accepted, best[accepted]


def rejection_accept(
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Standard speculative sampling: accept ``d_k`` with ``min(1, p_t/p_d)``; on rejection resample
    from ``norm(max(p_t - p_d, 0))``; after a fully accepted prefix the bonus comes from ``p_t``.

    ``draft_probs`` [n, V] (None: deterministic drafts, p_d is one-hot, as for n-gram lookup);
    ``target_probs`` [n + 1, V].
    """
    for k, token in enumerate(drafts):
        p_t = target_probs[k]
        if draft_probs is None:
            p_d = torch.zeros_like(p_t)
            p_d[token] = 1.0
        else:
            p_d = draft_probs[k]
        ratio = (p_t[token] / p_d[token]).item() if p_d[token] > 0 else 0.0
        if not math.isfinite(ratio):  # min(1.0, nan) is 1.0: a broken target row would accept anything
            raise ValueError(f"slot {k}: the target's probability of draft token {token} is {p_t[token].item()} "
                             f"against the draft's {p_d[token].item()}: the target's or the draft's "
                             "distribution holds NaN or infinite values")
        if torch.rand((), generator=generator).item() < min(1.0, ratio):
            continue
        residual = (p_t - p_d).clamp_min(0)
        if residual.sum() <= 0:  # p_t == p_d up to rounding: rejection had probability ~0
            residual = p_t
        return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))


# ----------------------------------------------------------------------------- proposers


class Proposer:
    """Drafts tokens after the anchor (the last token of ``sequence``)."""

    name = "none"
    needs_features = False

    def start(self) -> None:
        """A new sequence begins (:func:`speculative_decode` calls this before its first round)."""

    def propose(self, sequence: list[int], features: torch.Tensor | None) -> Proposal:
        return Proposal(tokens=[])


DRAFT_SAMPLING = ("greedy", "sample")  # what the draft proposes when decoding samples


def check_draft_sampling(draft_sampling: str) -> None:
    """Raise ValueError unless ``draft_sampling`` is one of :data:`DRAFT_SAMPLING`."""
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling {draft_sampling!r} is not one of {', '.join(DRAFT_SAMPLING)}")


class DraftProposer(Proposer):
    """The DSpark draft: block forward over the context features, then sequential Markov drafting."""

    name = "dspark"
    needs_features = True

    def __init__(self, draft, *, temperature: float, generator: torch.Generator,
                 top_k: int = 0, top_p: float = 1.0, draft_sampling: str = "greedy",
                 record_margins: bool = False) -> None:
        check_draft_sampling(draft_sampling)
        self.draft = draft.eval()
        self.temperature = temperature
        self.top_k, self.top_p = top_k, top_p
        self.draws = temperature > 0 and draft_sampling == "sample"  # else its most likely tokens
        self.generator = generator
        self.block_size = draft.config.block_size
        self.record_margins = record_margins  # greedy: keep each slot's top-2 margin (Proposal.margins)
        self.cache = ContextCache()  # the context's keys and values, kept across rounds as servers keep them

    def start(self) -> None:
        self.cache.clear()

    @torch.no_grad()
    def propose(self, sequence: list[int], features: torch.Tensor | None) -> Proposal:
        anchor_pos = len(sequence) - 1
        device = self.draft.fc.weight.device
        anchor = torch.tensor([sequence[-1]], dtype=torch.long, device=device)
        aux = features[:anchor_pos].unsqueeze(0).to(device)
        hidden = self.draft.block_forward(anchor, anchor_pos, aux, cache=self.cache)
        if self.draws:

            def distribution(logits):
                return sampling_probs(logits.float(), self.temperature, self.top_k, self.top_p).cpu()

            drawn_from = []  # each slot's distribution as drawn: rejection sampling needs those

            def sample(logits, _k):
                drawn_from.append(distribution(logits))
                return torch.multinomial(drawn_from[-1], 1, generator=self.generator)[:, 0].to(device)

            tokens, logits, conf = self.draft.draft_block(hidden, anchor, sample=sample)
            probs = torch.cat(drawn_from)
        else:
            tokens, logits, conf = self.draft.draft_block(hidden, anchor)
            probs = None
        return Proposal(
            tokens=tokens[0].tolist(),
            probs=probs,
            confidence_logits=None if conf is None else conf[0].float().tolist(),
            margins=top2_margins(logits[0]).tolist() if self.record_margins and probs is None else None,
        )


# ----------------------------------------------------------------------------- the loop


@dataclass
class DecodeSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # sampling only; 0 keeps every token
    top_p: float = 1.0  # sampling only; 1 keeps every token
    verify: str = "full"  # full | threshold
    threshold: float = 0.5
    eos_token_ids: tuple[int, ...] = ()


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampling draws from, over the whole vocabulary (last dimension): the
    softmax of ``logits / temperature`` restricted to the ``top_k`` most likely tokens (all when
    0), then to the smallest set of those, most likely first, whose mass reaches ``top_p``, and
    renormalised. The order and the rules are transformers' (temperature, top-k, top-p: a token
    stays while the mass before it is below ``top_p``) and the regenerating sampler's
    (``draftforge.splitserve.sampling``), except that ties at the k-th place keep exactly k."""
    if temperature <= 0:
        raise ValueError(f"sampling needs a temperature above 0, got {temperature}")
    if (top_k <= 0 or top_k >= logits.shape[-1]) and top_p >= 1.0:
        return torch.softmax(scaled_logits(logits, temperature), dim=-1)  # no cut: no sort of the vocabulary
    kept, indices = top_k_top_p(logits, temperature, top_k, top_p)
    if top_p < 1.0:
        kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=kept.dtype, device=kept.device).scatter(-1, indices, kept)


def _choose(logits: torch.Tensor, settings: DecodeSettings, generator: torch.Generator) -> int:
    if settings.temperature <= 0:
        return int(logits.argmax())
    probs = sampling_probs(logits, settings.temperature, settings.top_k, settings.top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _verified_prefix(proposal: Proposal, settings: DecodeSettings) -> int:
    if settings.verify == "full" or not proposal.tokens:
        return len(proposal.tokens)
    if settings.verify != "threshold":
        raise ValueError(f"verify mode {settings.verify!r} is not one of 'full', 'threshold'")
    if proposal.confidence_logits is None:
        raise ValueError("verify mode 'threshold' needs a draft with a confidence head")
    return confidence_cut(proposal.confidence_logits[: len(proposal.tokens)], settings.threshold)


def confidence_cut(confidence_logits: Sequence[float], threshold: float) -> int:
    """How many slots a static confidence threshold verifies: those before the first whose
    predicted acceptance (sigmoid of its confidence logit) is below ``threshold``."""
    for k, z in enumerate(confidence_logits):
        if torch.sigmoid(torch.tensor(z)).item() < threshold:
            return k
    return len(confidence_logits)


class FeatureBuffer:
    """The target's auxiliary features of positions ``0 .. length - 1`` of the sequence being
    decoded, [length, K*H_t], appended in place: preallocated for ``capacity`` positions, so
    that a round copies only the positions it adds (growing it with ``torch.cat`` copied the
    whole context every round). :meth:`view` is what the proposer reads; a row once written
    never changes."""

    def __init__(self, first: torch.Tensor, capacity: int) -> None:
        self.data = first.new_empty((max(capacity, first.shape[0]), first.shape[1]))
        self.data[: first.shape[0]] = first
        self.length = first.shape[0]

    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[0]
        if end > self.data.shape[0]:  # past the capacity asked for: grow geometrically
            grown = self.data.new_empty((max(end, 2 * self.data.shape[0]), self.data.shape[1]))
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : end] = rows
        self.length = end

    def view(self) -> torch.Tensor:
        return self.data[: self.length]


def draft_room(max_positions: int | None, anchor_pos: int) -> int | None:
    """How many drafts after the anchor at ``anchor_pos`` fit in a target context of
    ``max_positions`` (the last at position ``max_positions - 1``); None: no limit known."""
    return None if max_positions is None else max(0, max_positions - 1 - anchor_pos)


@torch.no_grad()
def speculative_decode(
    session: TargetSession,
    prompt: Sequence[int],
    proposer: Proposer,
    settings: DecodeSettings,
    *,
    generator: torch.Generator | None = None,
    accept_greedy: Callable = None,
    accept_sampled: Callable = None,
) -> DecodeResult:
    """Decode one prompt with ``proposer`` (``Proposer()`` = plain autoregressive decoding)."""
    accept_greedy = accept_greedy or greedy_accept
    accept_sampled = accept_sampled or rejection_accept
    generator = generator or torch.Generator().manual_seed(0)
    eos = set(settings.eos_token_ids)
    # plain greedy decoding: record the lossless check's reference margins, untimed (a decoder
    # would not compute them, and the speed-ups divide by this method's tokens/s)
    plain = proposer.name == "none" and settings.temperature <= 0
    untimed = 0.0
    start = time.perf_counter()

    proposer.start()
    logits, aux = session.prefill(list(prompt))
    sequence = list(prompt)
    # the features of every position before the anchor; a proposer reads at most
    # len(prompt) + max_new_tokens - 2 of them (no round follows the one that fills the output)
    features = None
    if proposer.needs_features and aux is not None:
        features = FeatureBuffer(aux, len(prompt) + settings.max_new_tokens)
    added = None  # the features of the last round's anchor and accepted drafts, not yet appended
    limit = getattr(session, "max_positions", None)
    anchor = _choose(logits[-1], settings, generator)
    output = [anchor]
    margins: list[float] | None = [] if plain else None
    gaps: list[dict[int, float]] | None = [] if plain else None
    if plain:
        untimed += _reference(logits[-1], margins, gaps)
    rounds: list[Round] = []
    while len(output) < settings.max_new_tokens and anchor not in eos:
        sequence.append(anchor)  # the anchor sits at position len(sequence) - 1
        if added is not None:
            features.append(added)
        proposal = proposer.propose(sequence, None if features is None else features.view())
        num_verified = _verified_prefix(proposal, settings)
        anchor_pos = len(sequence) - 1
        room = draft_room(limit, anchor_pos)
        if room is not None and num_verified > room:
            # no draft past the target's context: the output stops within it (the harness
            # checks the prompts so), positions beyond it would be run only to be cut, and a
            # target whose rotary scaling follows the longest position of a forward (dynamic
            # NTK, LongRoPE) would change the logits of the positions within it too
            num_verified = room
        drafts = proposal.tokens[:num_verified]
        target_logits, verify_aux = session.extend([anchor] + drafts)
        if settings.temperature <= 0:
            accepted, bonus = accept_greedy(drafts, target_logits)
        else:
            target_probs = sampling_probs(target_logits, settings.temperature, settings.top_k, settings.top_p).cpu()
            probs = None if proposal.probs is None else proposal.probs[:num_verified]
            accepted, bonus = accept_sampled(drafts, probs, target_probs, generator)
        session.crop(anchor_pos + 1 + accepted)
        if features is not None:  # appended when a next round needs them
            added = verify_aux[: accepted + 1]
        emitted = drafts[:accepted] + [bonus]
        for index, token in enumerate(emitted):
            if token in eos:
                emitted = emitted[: index + 1]
                break
        counted_verified, counted_accepted = num_verified, accepted
        if len(emitted) <= accepted:
            # an accepted draft ends the answer and the request stops there (DeepSpec counts so):
            # the drafts after it count as neither verified nor accepted
            counted_verified = counted_accepted = len(emitted)
        if plain:
            untimed += _reference(target_logits[0], margins, gaps)
        rounds.append(
            Round(
                num_proposed=len(proposal.tokens),
                num_verified=counted_verified,
                num_sent=num_verified,
                num_accepted=counted_accepted,
                acceptance_length=len(emitted),
                confidence_logits=proposal.confidence_logits,
            )
        )
        sequence.extend(drafts[:accepted])
        output.extend(emitted)
        anchor = output[-1]
    output = output[: settings.max_new_tokens]
    return DecodeResult(
        prompt_len=len(prompt),
        tokens=output,
        rounds=rounds,
        wall_s=time.perf_counter() - start - untimed,
        top2_margins=margins[: len(output)] if margins is not None else None,
        top_gaps=gaps[: len(output)] if gaps is not None else None,
    )


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit along the last dimension: how close a greedy choice was."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def _reference(logits: torch.Tensor, margins: list[float], gaps: list[dict[int, float]]) -> float:
    """Append the plain decode's top-2 margin and near-tie gaps of one position's ``logits``;
    returns the seconds it took, which the decode's wall time leaves out."""
    start = time.perf_counter()
    margins.append(float(top2_margins(logits)))
    gaps.append(_gaps(logits))
    return time.perf_counter() - start


NEAR_TIE_CANDIDATES = 8  # the reference tokens whose distance below its choice plain decoding keeps


def _gaps(logits: torch.Tensor) -> dict[int, float]:
    values, indices = logits.topk(min(NEAR_TIE_CANDIDATES, logits.shape[-1]))
    values = values.tolist()
    return {token: values[0] - value for token, value in zip(indices.tolist(), values, strict=True)}


def check_lossless(
    speculative: DecodeResult, reference: DecodeResult, *, tie_tolerance: float = 1e-3, label: str = ""
) -> int:
    """Raise :class:`LosslessCheckError` when greedy speculative output differs from plain greedy output.

    A divergence where the speculative token's logit lies less than ``tie_tolerance``
    below the reference token's, in the reference's logits, is a numerical near-tie
    (batched verification computes the same logits in a different order), not a
    verification bug: the comparison stops there and 1 is returned (0 when identical).
    A token outside the reference's :data:`NEAR_TIE_CANDIDATES` most likely is never
    excused (how far below it lies is not known); a reference that recorded no
    candidates (``top_gaps``) has only its top-2 margin to judge by.
    """
    spec, ref = speculative.tokens, reference.tokens
    for index in range(max(len(spec), len(ref))):
        a = spec[index] if index < len(spec) else None
        b = ref[index] if index < len(ref) else None
        if a == b:
            continue
        if a is None or b is None:  # one output ended: no token of it to weigh as a near-tie
            ended, other, token = ("speculative", "plain greedy", b) if a is None else ("plain greedy", "speculative", a)
            raise LosslessCheckError(
                f"{label}: greedy speculative decoding is not lossless: the {ended} output ends after "
                f"{index} tokens where the {other} output goes on with token {index}, {token} "
                f"({len(spec)} against {len(ref)} tokens in all); "
                f"speculative {spec[max(0, index - 3) : index + 4]} vs plain {ref[max(0, index - 3) : index + 4]}"
            )
        margin = gap = None
        distance = "at least {gap} below the reference's"
        if reference.top2_margins is not None and index < len(reference.top2_margins):
            margin = gap = reference.top2_margins[index]
        if reference.top_gaps is not None and index < len(reference.top_gaps):
            candidates = reference.top_gaps[index]
            gap = candidates.get(a, math.inf)  # beyond them: its distance is not known
            if a is not None and a not in candidates and candidates:  # no higher than the last of them
                distance = (f"outside the reference's {len(candidates)} most likely tokens, at least "
                            f"{max(candidates.values())} below its choice")
        if gap is not None and gap < tie_tolerance and a is not None and b is not None:
            return 1
        raise LosslessCheckError(
            f"{label}: greedy speculative decoding is not lossless: output token {index} is {a} but "
            f"plain greedy decoding gives {b} (reference top-2 logit margin there: {margin}, "
            f"the speculative token {distance.format(gap=gap)}); "
            f"speculative {spec[max(0, index - 3) : index + 4]} vs plain {ref[max(0, index - 3) : index + 4]}"
        )
    return 0
