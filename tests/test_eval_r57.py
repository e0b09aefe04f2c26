"""The decoding loop's feature buffer (written in place, bit-identical to concatenation) and the
last verification round at the target's context limit (no draft past max_position_embeddings)."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import LAYER_IDS, SHAPE, random_prompts, tiny_eval_draft, tiny_target

from draftforge.eval.baselines import NoDraft
from draftforge.eval.speculative import (
    DecodeSettings,
    DraftProposer,
    Proposal,
    Proposer,
    TargetSession,
    speculative_decode,
)
from draftforge.splitserve.hf_backend import HFTarget
from draftforge.splitserve.random_target import random_llama

LIMIT = 24  # the small target's max_position_embeddings
PROMPT_LEN = 10
MAX_NEW = LIMIT - PROMPT_LEN  # prompt + max_new_tokens == the limit: the harness lets it run


def _draft_proposer(draft) -> DraftProposer:
    return DraftProposer(draft, temperature=0.0, generator=torch.Generator().manual_seed(0))


class Recording(Proposer):
    """Passes the features it is given on to ``inner``, keeping a copy of each and its storage;
    with ``replace``, hands ``inner`` ``replace(round)`` instead."""

    def __init__(self, inner, replace=None) -> None:
        self.inner, self.replace = inner, replace
        self.name, self.needs_features = inner.name, inner.needs_features
        self.seen: list[torch.Tensor] = []
        self.storages: list[int] = []

    def start(self) -> None:
        self.inner.start()

    def propose(self, sequence, features):
        self.seen.append(features.clone())
        self.storages.append(features.untyped_storage().data_ptr())
        if self.replace is not None:
            features = self.replace(len(self.seen) - 1)
        return self.inner.propose(sequence, features)


def _recorded_session(model, layer_ids):
    """A session that keeps the aux features of its prefill and of each verification, and the
    length of each crop."""
    session = TargetSession(model, layer_ids)
    log = {"prefill": None, "verify": [], "crops": []}
    prefill, extend, crop = session.prefill, session.extend, session.crop

    def recorded_prefill(ids):
        logits, aux = prefill(ids)
        log["prefill"] = aux.clone()
        return logits, aux

    def recorded_extend(ids):
        logits, aux = extend(ids)
        log["verify"].append(aux.clone())
        return logits, aux

    def recorded_crop(length):
        log["crops"].append(length)
        crop(length)

    session.prefill, session.extend, session.crop = recorded_prefill, recorded_extend, recorded_crop
    return session, log


def _concatenated(log, prompt_len: int) -> list[torch.Tensor]:
    """The features each round's proposer must see, built as the loop used to build them: the
    prefill's, then each verification's anchor and accepted drafts, with ``torch.cat``."""
    features, per_round = log["prefill"], [log["prefill"]]
    position = prompt_len  # the first round's anchor
    for aux, crop in zip(log["verify"], log["crops"], strict=True):
        features = torch.cat([features, aux[: crop - position]], dim=0)  # crop = anchor_pos + 1 + accepted
        per_round.append(features)
        position = crop
    return per_round


def test_features_are_written_in_place_and_equal_the_concatenation_bit_for_bit():
    target = tiny_target()
    draft = tiny_eval_draft(target)
    prompt = random_prompts(1, length=12, seed=5)[0]
    settings = DecodeSettings(max_new_tokens=64)

    session, log = _recorded_session(target.model, LAYER_IDS)
    recording = Recording(_draft_proposer(draft))
    result = speculative_decode(session, prompt, recording, settings)
    rounds = len(result.rounds)
    assert rounds > 15 and len(result.tokens) == 64
    expected = _concatenated(log, len(prompt))
    for index, seen in enumerate(recording.seen):
        assert seen.shape[0] == len(prompt) + sum(r.acceptance_length for r in result.rounds[:index])
        assert torch.equal(seen, expected[index]), f"round {index}: other features than concatenated"
    # one buffer for the whole decode: no round copied the context into a new tensor
    assert len(set(recording.storages)) == 1, f"{len(set(recording.storages))} buffers over {rounds} rounds"

    # the same features, each round in a fresh concatenated tensor: the same decode, bit for bit
    fresh_session, fresh_log = _recorded_session(target.model, LAYER_IDS)
    fed = Recording(_draft_proposer(draft), replace=lambda index: _concatenated(fresh_log, len(prompt))[index])
    reference = speculative_decode(fresh_session, prompt, fed, settings)
    assert reference.tokens == result.tokens
    assert [vars(r) for r in reference.rounds] == [vars(r) for r in result.rounds]

    # and they are the target's layer outputs at those positions (a full forward, no cache)
    sequence = prompt + result.tokens
    with torch.no_grad():
        hidden = target.model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    full = torch.cat([hidden[i + 1][0] for i in LAYER_IDS], dim=-1)
    last = recording.seen[-1]
    torch.testing.assert_close(last, full[: last.shape[0]], rtol=1e-4, atol=1e-4)


def _small_context_target(rope: str = "default"):
    """The tiny random Llama with ``max_position_embeddings`` LIMIT (``dynamic``: NTK scaling
    that follows the longest position of each forward), sharp logits."""
    model = random_llama(SHAPE.model_copy(update={"max_position_embeddings": LIMIT}), seed=0)
    if rope == "dynamic":
        from transformers import LlamaForCausalLM

        config = model.config
        config.rope_parameters = {"rope_type": "dynamic", "rope_theta": SHAPE.rope_theta, "factor": 2.0}
        weights = model.state_dict()
        model = LlamaForCausalLM(config)
        model.load_state_dict(weights)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model.lm_head.weight.normal_(0.0, 1.0)
    return HFTarget(model.eval(), None, LAYER_IDS, name="random")


def _positions_run(model) -> list[int]:
    """The highest position of every forward of ``model``, as its rotary embedding sees it."""
    highest: list[int] = []

    def hook(_module, args, kwargs, _out):
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        highest.append(int(positions.max()))

    model.model.rotary_emb.register_forward_hook(hook, with_kwargs=True)
    return highest


class Constant(Proposer):
    """Always proposes ``gamma`` copies of one token."""

    name = "constant"

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def propose(self, sequence, features):
        return Proposal(tokens=[7] * self.gamma)


@pytest.mark.parametrize("method", ["dspark", "constant"])
def test_no_draft_is_verified_past_the_target_context(method):
    target = _small_context_target()
    draft = tiny_eval_draft(target, max_position_embeddings=LIMIT)
    gamma = draft.config.block_size
    highest = _positions_run(target.model)
    for prompt in random_prompts(4, length=PROMPT_LEN):
        settings = DecodeSettings(max_new_tokens=MAX_NEW)
        plain = speculative_decode(TargetSession(target.model, None), prompt, NoDraft(), settings)
        highest.clear()
        proposer = _draft_proposer(draft) if method == "dspark" else Constant(gamma)
        result = speculative_decode(TargetSession(target.model, LAYER_IDS), prompt, proposer, settings)
        assert max(highest) <= LIMIT - 1, f"the target ran position {max(highest)} of {LIMIT}"
        assert result.tokens == plain.tokens
        # each round sends a full block, but the one whose block reaches past the context
        produced = 1  # the prefill's token
        for r in result.rounds:
            anchor_pos = PROMPT_LEN + produced - 1
            assert r.num_proposed == gamma
            assert r.num_sent == min(gamma, LIMIT - 1 - anchor_pos)
            produced += r.acceptance_length
        assert result.rounds[-1].num_sent < gamma  # the limit did cut the last block here

        # the same decode with no limit in sight: the same output; every round before the
        # cut one the same, the cut one a full block
        session = TargetSession(target.model, LAYER_IDS)
        session.max_positions = None
        proposer = _draft_proposer(draft) if method == "dspark" else Constant(gamma)
        unlimited = speculative_decode(session, prompt, proposer, settings)
        assert unlimited.tokens == result.tokens
        cut = next(i for i, r in enumerate(result.rounds) if r.num_sent < gamma)
        assert [vars(r) for r in unlimited.rounds[:cut]] == [vars(r) for r in result.rounds[:cut]]
        assert unlimited.rounds[cut].num_sent == gamma


def _logits_by_position(session) -> dict[int, torch.Tensor]:
    """Every position's logits row the session's verifications computed (the last, where a
    position was run again after a rejection)."""
    rows: dict[int, torch.Tensor] = {}
    extend = session.extend

    def recorded(ids):
        start = session.length
        logits, aux = extend(ids)
        for k in range(len(ids)):
            rows[start + k] = logits[k].clone()
        return logits, aux

    session.extend = recorded
    return rows


def test_a_dynamic_rope_target_verifies_with_the_logits_plain_decoding_computes():
    # a forward reaching past the limit rescales the rotary frequencies of all its positions
    # (transformers' dynamic NTK): a block run past it changed the logits within it by ~1e-2
    target = _small_context_target("dynamic")
    draft = tiny_eval_draft(target, max_position_embeddings=LIMIT)
    for prompt in random_prompts(3, length=PROMPT_LEN):
        settings = DecodeSettings(max_new_tokens=MAX_NEW)
        plain_session = TargetSession(target.model, None)
        plain_rows = _logits_by_position(plain_session)
        plain = speculative_decode(plain_session, prompt, NoDraft(), settings)
        session = TargetSession(target.model, LAYER_IDS)
        rows = _logits_by_position(session)
        result = speculative_decode(session, prompt, _draft_proposer(draft), settings)
        assert result.tokens == plain.tokens
        # plain decoding ran each position once on the tokens of the output: the positions the
        # speculative decode last ran on the same tokens (its accepted prefix) must agree
        kept = PROMPT_LEN + len(result.tokens) - 1
        for position in range(PROMPT_LEN, kept):
            torch.testing.assert_close(rows[position], plain_rows[position], rtol=0, atol=1e-4)
