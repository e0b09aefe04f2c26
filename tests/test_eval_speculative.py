"""The speculative-decoding evaluator: lossless greedy, rejection sampling, baselines, EOS, threshold mode."""

from __future__ import annotations

import random

import pytest
import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.eval import speculative as spec
from draftforge.eval.baselines import NgramProposer, NoDraft, ngram_lookup
from draftforge.eval.calibration import round_samples
from draftforge.eval.harness import EvalSettings, run_workload, summarize
from draftforge.eval.speculative import (
    DecodeSettings,
    LosslessCheckError,
    Proposal,
    Proposer,
    TargetSession,
    check_lossless,
    rejection_accept,
    sampling_probs,
    speculative_decode,
)

QUIET = dict(progress=lambda _: None)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def draft(target):
    return tiny_eval_draft(target)


class OracleProposer(Proposer):
    """Proposes the reference continuation, wrong from draft position ``wrong_from`` on."""

    name = "oracle"

    def __init__(self, prompt_len, reference, gamma, wrong_from=None):
        self.prompt_len, self.reference, self.gamma, self.wrong_from = prompt_len, reference, gamma, wrong_from

    def propose(self, sequence, features):
        produced = len(sequence) - self.prompt_len  # the anchor is reference[produced - 1]
        tokens = list(self.reference[produced : produced + self.gamma])
        if self.wrong_from is not None:
            tokens = [t if k < self.wrong_from else (t + 1) % 512 for k, t in enumerate(tokens)]
        return Proposal(tokens=tokens)


def _plain(target, prompt, max_new, eos=()):
    session = TargetSession(target.model, None)
    return speculative_decode(session, prompt, NoDraft(), DecodeSettings(max_new_tokens=max_new, eos_token_ids=eos))


def test_plain_decoding_equals_transformers_generate(target):
    prompt = random_prompts(1)[0]
    ours = _plain(target, prompt, 20)
    reference = target.model.generate(
        input_ids=torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert ours.tokens == reference
    assert all(r.acceptance_length == 1 for r in ours.rounds) and len(ours.rounds) == 19
    assert min(ours.top2_margins) > 1e-3  # the sharpened target has no near-ties here


def test_greedy_dspark_and_ngram_are_lossless_on_a_random_draft(target, draft):
    result = run_workload(
        "random", random_prompts(2), draft, target,
        EvalSettings(max_new_tokens=16, tie_tolerance=0.0, estimate=False), **QUIET,
    )  # fmt: skip
    assert result.near_ties == 0
    assert set(result.methods) == {"none", "dspark", "ngram"}
    dspark = result.methods["dspark"]
    assert 1.0 <= dspark["acceptance_length"] <= 5.0
    assert dspark["tokens_verified_per_round"] == 5.0  # full verification: anchor + 4 drafts
    assert result.methods["none"]["acceptance_length"] == 1.0
    assert result.methods["none"]["tokens"] == dspark["tokens"] == 32
    assert len(result.confidence_samples) >= dspark["rounds"]


def test_a_broken_verifier_is_caught(target, draft, monkeypatch):
    def accept_everything(drafts, target_logits):
        return len(drafts), int(target_logits[len(drafts)].argmax())

    monkeypatch.setattr(spec, "greedy_accept", accept_everything)
    with pytest.raises(LosslessCheckError, match="not lossless"):
        run_workload(
            "random", random_prompts(1), draft, target,
            EvalSettings(max_new_tokens=12, estimate=False, baselines=("none",)), **QUIET,
        )  # fmt: skip


def test_a_wrong_ngram_output_is_caught(target, draft, monkeypatch):
    """The n-gram baseline's greedy output is checked against plain decoding too, not only the
    draft's: an n-gram path whose output differs stops the run, naming the method."""
    from draftforge.eval import harness

    real_decode = harness.speculative_decode

    def decode(session, prompt, proposer, settings, **kwargs):
        result = real_decode(session, prompt, proposer, settings, **kwargs)
        if proposer.name == "ngram":  # as if its verification had accepted a wrong token
            result.tokens[3] = (result.tokens[3] + 1) % 512
        return result

    monkeypatch.setattr(harness, "speculative_decode", decode)
    with pytest.raises(LosslessCheckError, match=r"random prompt 0 \(ngram\): .* output token 3 is"):
        run_workload(
            "random", random_prompts(1), draft, target,
            EvalSettings(max_new_tokens=12, estimate=False, tie_tolerance=0.0), **QUIET,
        )  # fmt: skip


@pytest.mark.parametrize("wrong_from", [None, 2, 0])
def test_oracle_drafts_exercise_acceptance_and_cache_cropping(target, wrong_from):
    """Long accepted prefixes (and rejections mid-block) must still reproduce plain greedy decoding."""
    prompt, gamma, max_new = random_prompts(1, seed=5)[0], 4, 23
    reference = _plain(target, prompt, max_new)
    session = TargetSession(target.model, None)
    proposer = OracleProposer(len(prompt), reference.tokens, gamma, wrong_from)
    result = speculative_decode(session, prompt, proposer, DecodeSettings(max_new_tokens=max_new))
    assert check_lossless(result, reference, tie_tolerance=0.0) == 0
    full_rounds = [r for r in result.rounds if r.num_proposed == gamma]
    expected = {None: gamma + 1, 2: 3, 0: 1}[wrong_from]
    assert full_rounds and all(r.acceptance_length == expected for r in full_rounds)


def test_round_accepting_eos_counts_up_to_the_eos(target):
    prompt = random_prompts(1, seed=5)[0]
    free = _plain(target, prompt, 30).tokens
    eos = free[6]
    first = free.index(eos)
    reference = _plain(target, prompt, 30, eos=(eos,))
    assert reference.tokens == free[: first + 1]
    session = TargetSession(target.model, None)
    result = speculative_decode(
        session, prompt, OracleProposer(len(prompt), free, 4),
        DecodeSettings(max_new_tokens=30, eos_token_ids=(eos,)),
    )  # fmt: skip
    assert result.tokens == reference.tokens
    # Output token 0 comes from the prefill; each round then emits up to 5 tokens.
    lengths = [r.acceptance_length for r in result.rounds]
    assert sum(lengths) == first and lengths[-1] <= 5
    if first % 5:  # the EOS was an accepted draft: no bonus counted after it
        assert lengths[-1] == first % 5


class RecordingOracle(Proposer):
    """Feature-hungry like the draft; records what each round hands it, and proposes the
    reference continuation cut at a random length (then wrong tokens), so that rounds
    accept anything from nothing to the whole block."""

    name, needs_features = "recording", True

    def __init__(self, reference, gamma, seed):
        self.reference, self.gamma, self.rng, self.calls = reference, gamma, random.Random(seed), []

    def propose(self, sequence, features):
        self.calls.append((list(sequence), features.clone()))
        cont = self.reference[len(sequence) : len(sequence) + self.gamma]
        cut = self.rng.randint(0, len(cont))
        return Proposal(tokens=cont[:cut] + [(t + 1) % 512 for t in cont[cut:]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_round_hands_the_draft_the_targets_features_of_exactly_the_context(target, draft, seed):
    """Before every round the draft gets the target's auxiliary features of the tokens before
    the anchor, no more (not the rejected drafts', not the anchor's) and no fewer (also after a
    round that accepted nothing), equal to a cache-free forward over the final sequence."""
    prompt = random_prompts(1, seed=10 + seed)[0]
    reference = _plain(target, prompt, 30)
    full = prompt + reference.tokens
    oracle = RecordingOracle(full, gamma=4, seed=seed)
    session = TargetSession(target.model, draft.config.target_layer_ids)
    result = speculative_decode(session, prompt, oracle, DecodeSettings(max_new_tokens=30))
    assert result.tokens == reference.tokens
    accepted = {r.num_accepted for r in result.rounds}
    assert 0 in accepted and len(accepted) >= 3, accepted  # the cuts vary what rounds accept
    aux = target.features(torch.tensor([full])).aux[0]
    for sequence, features in oracle.calls:
        anchor = len(sequence) - 1
        assert sequence == full[: len(sequence)]
        assert features.shape[0] == anchor
        torch.testing.assert_close(features, aux[:anchor], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("head_type", "top_k", "top_p"),
                         [("vanilla", 0, 1.0), ("gated", 0, 1.0), ("rnn", 0, 1.0), ("vanilla", 6, 0.8)])
def test_sampled_proposals_carry_the_markov_corrected_tempered_probabilities(target, head_type, top_k, top_p):
    """Rejection sampling needs the distribution each draft token was drawn from: the base
    logits plus the Markov term given the token drafted before it, divided by T (and cut to
    top-k and top-p when asked)."""
    draft = tiny_eval_draft(target, markov_head_type=head_type)
    prompt = random_prompts(1, seed=21)[0]
    session = TargetSession(target.model, draft.config.target_layer_ids)
    _, aux = session.prefill(prompt)
    proposer = spec.DraftProposer(draft, temperature=0.7, generator=torch.Generator().manual_seed(4),
                                  top_k=top_k, top_p=top_p, draft_sampling="sample")
    proposal = proposer.propose(prompt, aux[:-1])
    anchor = torch.tensor([prompt[-1]])
    assert proposal.probs is not None and proposal.probs.shape[0] == len(proposal.tokens)
    with torch.no_grad():  # the training side's teacher-forced path, fed the drawn tokens
        hidden = draft.block_forward(anchor, len(prompt) - 1, aux[None, :-1])
        drawn = torch.tensor([proposal.tokens])
        prev = torch.cat([anchor[:, None], drawn[:, :-1]], dim=1)
        latent, _ = draft.markov_head.teacher_forced(prev, hidden)
        logits = draft.base_logits(hidden)[0] + draft.markov_head.markov_w2(latent)[0]
    expected = reference_distribution(logits.float(), 0.7, top_k, top_p)
    torch.testing.assert_close(proposal.probs.float(), expected, rtol=1e-4, atol=1e-6)
    drawn_probs = proposal.probs[torch.arange(len(proposal.tokens)), drawn[0]]
    assert bool((drawn_probs > 0).all())  # every draft was drawn from inside its filtered support
    if top_k:
        assert int((proposal.probs > 0).sum(dim=-1).max()) <= top_k


def test_positions_beyond_the_drafts_range_are_refused(target):
    """A draft with 16 positions: a 10-token prompt with 10 new tokens would draft at
    positions it never trained on (it did, silently, up to 32)."""
    small = tiny_eval_draft(target, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"workload 'w', prompt 0: 10 prompt tokens \+ max_new_tokens 10 exceed "
                                         "the draft's max_position_embeddings 16"):
        run_workload("w", random_prompts(1), small, target,
                     EvalSettings(max_new_tokens=10, estimate=False, baselines=("none",)), **QUIET)
    result = run_workload("w", random_prompts(1), small, target,
                          EvalSettings(max_new_tokens=6, estimate=False, baselines=("none",)), **QUIET)
    assert result.methods["dspark"]["tokens"] == 6
    aux = torch.zeros(1, 16, small.config.num_context_features)
    with pytest.raises(ValueError, match="anchor position 16 is beyond the draft's max_position_embeddings 16"):
        small.block_forward(torch.tensor([1]), 16, aux)


def test_drafts_after_an_accepted_eos_count_as_neither_verified_nor_accepted(target):
    """The request ends at an accepted EOS, so per-position acceptance and the calibration
    samples must not see the drafts behind it (DeepSpec counts so)."""
    gamma = 4
    prompt = random_prompts(1, seed=5)[0]
    free = _plain(target, prompt, 30).tokens
    # output token 0 comes from the prefill and round r emits tokens 5r-4 .. 5r, its drafts
    # first: an EOS at token i with i % 5 in (1, 2, 3) is draft (i - 1) % 5 with drafts after it
    at = next(i for i in range(6, 30) if free.index(free[i]) == i and i % 5 in (1, 2, 3))
    eos, eos_draft = free[at], (at - 1) % 5
    session = TargetSession(target.model, None)
    result = speculative_decode(
        session, prompt, OracleProposer(len(prompt), free, gamma),
        DecodeSettings(max_new_tokens=30, eos_token_ids=(eos,)),
    )  # fmt: skip
    assert result.tokens == free[: at + 1]
    last = result.rounds[-1]
    assert last.num_proposed == gamma
    assert (last.acceptance_length, last.num_accepted, last.num_verified) == (eos_draft + 1,) * 3
    summary = summarize([result], gamma)
    full = len(result.rounds) - 1
    assert summary["position_reached"] == [full + (k <= eos_draft) for k in range(gamma)]
    assert full >= 1 and summary["position_acceptance"] == [1.0] * gamma
    # the target ran every draft of that round all the same: the cost counts them
    assert last.num_sent == gamma and last.tokens_run == gamma + 1
    assert summary["tokens_verified_per_round"] == gamma + 1  # every round ran 1 + 4 tokens
    last.confidence_logits = [0.0] * gamma
    assert round_samples([last]) == [(k, 0.0, 1.0) for k in range(eos_draft + 1)]


def test_threshold_mode_leaves_the_baselines_on_full_verification(target, draft):
    """n-gram lookup has no confidence head; with the default baselines a threshold run used
    to stop at its first proposal."""
    result = run_workload(
        "random", random_prompts(2, seed=3), draft, target,
        EvalSettings(max_new_tokens=12, verify="threshold", threshold=0.5, estimate=False,
                     tie_tolerance=0.0, ngram_max=1), **QUIET,
    )  # fmt: skip
    ngram = result.methods["ngram"]
    assert ngram["rounds"] > 0 and ngram["drafts_proposed_per_round"] > 0
    assert ngram["tokens_verified_per_round"] == pytest.approx(1 + ngram["drafts_proposed_per_round"])


def test_threshold_mode_verifies_only_confident_prefixes(target, draft):
    prompts = random_prompts(1)
    bias = draft.confidence_head.proj.bias
    original = bias.detach().clone()  # the draft fixture is shared by the whole module
    try:
        for value, width in ((-50.0, 1.0), (50.0, 5.0)):
            with torch.no_grad():
                bias.fill_(value)
            result = run_workload(
                "random", prompts, draft, target,
                EvalSettings(max_new_tokens=10, verify="threshold", threshold=0.5, estimate=False,
                             baselines=("none",), tie_tolerance=0.0), **QUIET,
            )  # fmt: skip
            assert result.methods["dspark"]["tokens_verified_per_round"] == width
    finally:
        with torch.no_grad():
            bias.copy_(original)


def test_ngram_lookup_finds_the_latest_repeated_span():
    sequence = [1, 2, 3, 4, 9, 7, 2, 3, 5, 6, 8, 2, 3]
    assert ngram_lookup(sequence, 3) == [5, 6, 8]  # latest earlier "2 3" is followed by 5 6 8
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 2, max_ngram=3) == [3, 4]
    assert ngram_lookup([1, 2, 3], 4) == []
    assert NgramProposer(2).propose([5, 6, 7, 5, 6]).tokens == [7, 5]


def _first_match_lookup(tokens, k, max_ngram, min_ngram=1):
    """vLLM's rule, restated slowly from its documentation: the longest n in
    [min_ngram, max_ngram] whose suffix n-gram occurs earlier, that n-gram's FIRST
    occurrence, and the up to k tokens after it (fewer where the sequence ends)."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tuple(tokens[-n:])
        firsts = [i for i in range(len(tokens) - n) if tuple(tokens[i : i + n]) == suffix]
        if firsts:
            return list(tokens[firsts[0] + n : firsts[0] + n + k])
    return []


def test_ngram_lookup_earliest_is_vllms_rule_and_latest_differs_from_it():
    sequence = [1, 2, 3, 1, 2, 4, 1, 2]
    assert ngram_lookup(sequence, 4, match="earliest") == [3, 1, 2, 4]  # vLLM's documented pick
    assert ngram_lookup(sequence, 4, match="latest") == [4, 1, 2]
    assert NgramProposer(4, match="earliest").propose(sequence).tokens == [3, 1, 2, 4]
    rng = random.Random(7)
    differs = 0
    for _ in range(2000):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        k, max_ngram = rng.randrange(1, 6), rng.randrange(1, 4)
        expected = _first_match_lookup(tokens, k, max_ngram)
        assert ngram_lookup(tokens, k, max_ngram, match="earliest") == expected, tokens
        differs += ngram_lookup(tokens, k, max_ngram, match="latest") != expected
    assert differs > 100  # the two rules are really different proposers
    with pytest.raises(ValueError, match="match must be one of latest, earliest"):
        NgramProposer(4, match="first")


def test_ngram_baseline_accepts_a_repeated_span(target):
    """This prompt sends the random target into a loop (a repeated 4-token span): prompt lookup
    drafts the span from the earlier occurrence and the target accepts whole blocks."""
    prompt = random_prompts(1, seed=13)[0]
    plain = _plain(target, prompt, 30)
    tail = plain.tokens[-8:]
    assert tail[:4] == tail[4:]  # the loop this test relies on
    session = TargetSession(target.model, None)
    result = speculative_decode(session, prompt, NgramProposer(4), DecodeSettings(max_new_tokens=30))
    assert check_lossless(result, plain, tie_tolerance=0.0) == 0
    assert any(r.num_proposed == 4 and r.num_accepted == 4 for r in result.rounds)
    assert result.mean_acceptance_length > 1.3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _emitted_counts(draft_probs, target_probs, samples, accept, fixed_drafts=None):
    """Counts [n + 1, V] of the token emitted at each output index j of a round
    (``drafts[:accepted] + [bonus]``). The toy target rows do not depend on the prefix and the
    drafts of different slots are drawn independently, so whenever index j is reached its token
    must follow ``target_probs[j]``: the first token checks the acceptance and residual rule of
    slot 0, the later ones each slot's row and the bonus's row."""
    gen = torch.Generator().manual_seed(0)
    num_drafts = target_probs.shape[0] - 1
    counts = torch.zeros(target_probs.shape)
    for _ in range(samples):
        if fixed_drafts is not None:
            drafts = list(fixed_drafts)  # a deterministic (n-gram) draft
        else:
            drafts = [int(torch.multinomial(draft_probs[k], 1, generator=gen)) for k in range(num_drafts)]
        accepted, bonus = accept(drafts, draft_probs, target_probs, gen)
        for index, token in enumerate(drafts[:accepted] + [bonus]):
            counts[index, token] += 1
    return counts


# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_BY_DF = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
MIN_REACHED = 500  # an output index checked on fewer samples would prove little


def _chi_square_by_position(counts, target_probs):
    """(chi-square, critical value at p = 0.001) of each output index over the target's support."""
    stats = []
    for index in range(counts.shape[0]):
        support = target_probs[index] > 0
        chi2 = _chi_square(counts[index][support], target_probs[index][support])
        df = int(support.sum()) - 1  # a one-token row: the support check is the whole test
        stats.append((chi2, CHI2_CRIT_BY_DF[df] if df else float("inf")))
    return stats


def _assert_every_position_follows_the_target(counts, target_probs):
    for index, (chi2, crit) in enumerate(_chi_square_by_position(counts, target_probs)):
        reached = int(counts[index].sum())
        assert reached >= MIN_REACHED, f"output index {index} reached in {reached} rounds only"
        outside = counts[index][target_probs[index] == 0]
        assert outside.sum() == 0, f"output index {index} emitted tokens outside the target's support"
        assert chi2 < crit, (f"output index {index} does not follow target row {index}: chi2 {chi2:.1f} "
                             f">= {crit}; counts {counts[index].tolist()}, probs {target_probs[index].tolist()}")


def _toy_rows(deterministic):
    torch.manual_seed(1)
    target_probs = torch.softmax(torch.randn(3, 6) * 1.5, dim=-1)
    draft_probs = torch.softmax(torch.randn(2, 6) * 1.5, dim=-1)
    if deterministic:  # an n-gram draft that is often right: each slot's most likely token
        return target_probs, None, target_probs[:2].argmax(dim=-1).tolist()
    return target_probs, draft_probs, None


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(deterministic):
    target_probs, draft_probs, fixed = _toy_rows(deterministic)
    counts = _emitted_counts(draft_probs, target_probs, 12000, rejection_accept, fixed)
    _assert_every_position_follows_the_target(counts, target_probs)


def _resample_from_the_target(drafts, draft_probs, target_probs, gen):
    """Resamples from p_t instead of the residual."""
    for k, token in enumerate(drafts):
        ratio = float(target_probs[k, token] / draft_probs[k, token])
        if torch.rand((), generator=gen).item() >= min(1.0, ratio):
            return k, int(torch.multinomial(target_probs[k], 1, generator=gen))
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=gen))


def _bonus_from_the_first_row(drafts, draft_probs, target_probs, gen):
    """Draws the bonus after a fully accepted block from row 0 instead of row n."""
    accepted, token = rejection_accept(drafts, draft_probs, target_probs, gen)
    if accepted == len(drafts):
        token = int(torch.multinomial(target_probs[0], 1, generator=gen))
    return accepted, token


def _every_slot_against_the_first_row(drafts, draft_probs, target_probs, gen):
    """Judges (and resamples) every slot against row 0."""
    rows = target_probs.clone()
    rows[: len(drafts)] = target_probs[0]
    return rejection_accept(drafts, draft_probs, rows, gen)


@pytest.mark.parametrize(("wrong_rule", "deterministic", "biased_index"), [
    (_resample_from_the_target, False, 0),
    (_bonus_from_the_first_row, False, 2),
    (_bonus_from_the_first_row, True, 2),
    (_every_slot_against_the_first_row, False, 1),
    (_every_slot_against_the_first_row, True, 1),
])  # fmt: skip
def test_the_statistical_test_catches_a_wrong_rule(wrong_rule, deterministic, biased_index):
    """Each wrong rule biases one output index: the same test must fail there."""
    target_probs, draft_probs, fixed = _toy_rows(deterministic)
    counts = _emitted_counts(draft_probs, target_probs, 12000, wrong_rule, fixed)
    chi2, crit = _chi_square_by_position(counts, target_probs)[biased_index]
    assert chi2 > crit
    with pytest.raises(AssertionError, match=f"output index {biased_index} does not follow"):
        _assert_every_position_follows_the_target(counts, target_probs)


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' processors in generate's order (temperature, top-k, top-p), then softmax."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.reshape(-1, logits.shape[-1]).clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).reshape(logits.shape)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(0.7, 20, 0.8), (1.0, 0, 0.9), (1.3, 4, 1.0), (0.5, 0, 1.0), (0.7, 200, 0.3)])
def test_sampling_probs_are_the_transformers_distribution(temperature, top_k, top_p):
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(7)) * 3
    ours = sampling_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(ours, reference_distribution(logits, temperature, top_k, top_p),
                               rtol=1e-5, atol=1e-7)
    assert ours.shape == logits.shape
    with pytest.raises(ValueError, match="sampling needs a temperature above 0, got 0"):
        sampling_probs(logits, 0.0, top_k, top_p)


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_with_top_k_and_top_p_preserves_the_filtered_target(deterministic):
    """The drafts may come from tokens the target's filters removed (the draft's own top-k
    differs): those must always be rejected, and the output must follow the filtered target."""
    gen = torch.Generator().manual_seed(5)
    target_probs = sampling_probs(torch.randn(3, 10, generator=gen) * 2, 0.7, 5, 0.9)
    draft_probs = None if deterministic else sampling_probs(torch.randn(2, 10, generator=gen) * 2, 0.7, 5, 0.9)
    support = target_probs[0] > 0
    assert 2 <= int(support.sum()) <= 5
    if deterministic:
        assert not bool(support[2])  # the fixed draft (token 2) lies outside the target's support
        reached = 1  # so slot 0 always rejects it
    else:
        assert bool((draft_probs[0] * ~support).sum() > 0.05)  # the draft puts mass where the target has none
        assert float((draft_probs[1] * (target_probs[1] > 0)).sum()) == 0  # slot 1's drafts: none at all
        reached = 2
    counts = _emitted_counts(draft_probs, target_probs, 12000, rejection_accept,
                             [2, 2] if deterministic else None)  # fmt: skip
    assert counts[reached:].sum() == 0, counts  # past a draft the target never emits, nothing
    _assert_every_position_follows_the_target(counts[:reached], target_probs[:reached])


def test_greedy_drafting_under_sampling_proposes_the_drafts_argmax_as_deterministic_drafts(target, draft):
    """llama.cpp's verification: the draft proposes what it proposes when
    greedy, and rejection sampling treats the drafts as certain (no draft distribution)."""
    prompt = random_prompts(1, seed=22)[0]
    session = TargetSession(target.model, draft.config.target_layer_ids)
    _, aux = session.prefill(prompt)
    greedy = spec.DraftProposer(draft, temperature=0.0, generator=torch.Generator()).propose(prompt, aux[:-1])
    for top_k, top_p in ((0, 1.0), (3, 0.5)):
        proposal = spec.DraftProposer(draft, temperature=0.9, generator=torch.Generator().manual_seed(1),
                                      top_k=top_k, top_p=top_p).propose(prompt, aux[:-1])  # fmt: skip
        assert proposal.probs is None and proposal.tokens == greedy.tokens
    sampled = spec.DraftProposer(draft, temperature=0.9, generator=torch.Generator().manual_seed(1),
                                 draft_sampling="sample").propose(prompt, aux[:-1])  # fmt: skip
    assert sampled.probs is not None and sampled.tokens != greedy.tokens  # a random draft is far from peaked
    with pytest.raises(ValueError, match="draft_sampling 'top' is not one of greedy, sample"):
        spec.DraftProposer(draft, temperature=0.9, generator=torch.Generator(), draft_sampling="top")


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_sampled_decoding_runs_and_reports(target, draft, draft_sampling):
    settings = EvalSettings(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, estimate=False,
                            draft_sampling=draft_sampling)  # fmt: skip
    result = run_workload("random", random_prompts(1), draft, target, settings, **QUIET)
    dspark = result.methods["dspark"]
    assert dspark["tokens"] == 12 and dspark["tokens_verified_per_round"] == 5  # 4 drafts + the bonus
    # the prefill's token, then each round's accepted run: the 11 after it, the last round cut
    al_sum = dspark["prompt_al_sum"][0]
    assert 11 <= al_sum <= 11 + 4 and dspark["acceptance_length"] == al_sum / dspark["rounds"]
    # seeded: the same settings decode the same rounds
    again = run_workload("random", random_prompts(1), draft, target, settings, **QUIET).methods["dspark"]
    assert (again["prompt_al_sum"], again["rounds"]) == (dspark["prompt_al_sum"], dspark["rounds"])


def test_train_time_estimate_is_in_range(target, draft):
    from draftforge.eval.estimate import train_time_estimate

    prompt = random_prompts(1)[0]
    output = _plain(target, prompt, 16).tokens
    est = train_time_estimate(draft, target, [(prompt, output)], max_anchors=8)
    assert 1.0 <= est["tau"] <= 5.0 and 1.0 <= est["tau_greedy"] <= 5.0
    assert est["num_blocks"] == 8 and len(est["slot_c_star"]) == 4

    # the lookup split, recomputed on the same anchors by a slow lookup written here
    from draftforge.train.blocks import sample_anchors

    ids = list(prompt) + list(output)
    mask = torch.zeros(1, len(ids), dtype=torch.bool)
    mask[0, len(prompt):] = True
    anchors, valid = sample_anchors(mask, 8, generator=torch.Generator().manual_seed(0))
    runs = []
    for p in anchors[0][valid[0]].tolist():
        seen, proposal = ids[: p + 1], None
        for n in (3, 2, 1):
            starts = [s for s in range(len(seen) - n) if seen[s:s + n] == seen[-n:]]
            if n < len(seen) and starts:
                proposal = seen[starts[-1] + n:][:4]
                break
        if proposal:
            truth = ids[p + 1:p + 5]
            run = 1
            while run - 1 < len(proposal) and run - 1 < len(truth) and proposal[run - 1] == truth[run - 1]:
                run += 1
            runs.append(run)
    assert runs, "the fixture's output repeats itself, so lookup must propose somewhere"
    assert est["lookup_share"] == pytest.approx(len(runs) / 8)
    assert est["ngram_run_at_lookup"] == pytest.approx(sum(runs) / len(runs))
    # the two groups' draft runs average back to tau_greedy
    parts = [(est["lookup_share"], est["tau_greedy_at_lookup"]),
             (1 - est["lookup_share"], est["tau_greedy_elsewhere"])]
    assert sum(w * v for w, v in parts if w > 0) == pytest.approx(est["tau_greedy"])


def test_the_sampled_estimate_reduces_to_tau_and_to_tau_greedy(target, draft):
    """At temperature 1 with no cut and drawn drafts the acceptance probability is c*, so
    ``tau_sampled`` must equal ``tau``, which the training objective computes by another path;
    near temperature 0 with greedy drafts, on the target's greedy output, it is the greedy match."""
    from draftforge.eval.estimate import train_time_estimate

    prompt = random_prompts(1, seed=5)[0]
    output = _plain(target, prompt, 16).tokens
    sequences = [(prompt, output)]
    at_one = train_time_estimate(draft, target, sequences, max_anchors=8, temperature=1.0, draft_sampling="sample")
    assert at_one["tau_sampled"] == pytest.approx(at_one["tau"], rel=1e-5)
    cold = train_time_estimate(draft, target, sequences, max_anchors=8, temperature=1e-4)
    assert cold["tau_sampled"] == pytest.approx(cold["tau_greedy"], abs=1e-4)
    assert "tau_sampled" not in train_time_estimate(draft, target, sequences, max_anchors=8)
    # a cut changes it; drawn and greedy drafts are estimated apart
    cut = [train_time_estimate(draft, target, sequences, max_anchors=8, temperature=0.7, top_k=20, top_p=0.8,
                               draft_sampling=rule)["tau_sampled"] for rule in ("greedy", "sample")]  # fmt: skip
    assert all(1.0 <= t <= 5.0 for t in cut) and cut[0] != cut[1] != at_one["tau_sampled"]


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_sampled_acceptance_is_the_verifiers_first_slot_acceptance_rate(draft_sampling):
    """The estimate's per-slot probability, against transformers' distributions written out by hand
    and against how often the evaluator's own rejection step accepts a first draft."""
    from draftforge.eval.estimate import sampled_acceptance

    torch.manual_seed(8)  # slot 0 accepts with 0.38 (greedy) and 0.61 (drawn): far from 0, 1 and each other
    temperature, top_k, top_p = 0.8, 4, 0.9
    draft_logits, target_logits = torch.randn(2, 7) * 2, torch.randn(2, 7) * 2
    accept = sampled_acceptance(draft_logits, target_logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                draft_sampling=draft_sampling)  # fmt: skip
    pi_t = reference_distribution(target_logits, temperature, top_k, top_p)
    pi_d = reference_distribution(draft_logits, temperature, top_k, top_p)
    if draft_sampling == "greedy":
        expected = pi_t[torch.arange(2), draft_logits.argmax(-1)]
    else:
        expected = torch.minimum(pi_t, pi_d).sum(-1)
    assert torch.allclose(accept, expected, atol=1e-6)
    gen, samples, accepted = torch.Generator().manual_seed(0), 20000, 0
    target_probs = torch.cat([pi_t[:1], pi_t[:1]])  # slot 0's distribution, then the bonus's
    for _ in range(samples):
        if draft_sampling == "greedy":
            drafts, probs = [int(draft_logits[0].argmax())], None
        else:
            drafts, probs = [int(torch.multinomial(pi_d[0], 1, generator=gen))], pi_d[:1]
        accepted += spec.rejection_accept(drafts, probs, target_probs, gen)[0]
    rate, p = accepted / samples, float(expected[0])
    assert 0.3 < p < 0.7
    assert abs(rate - p) < 4 * (p * (1 - p) / samples) ** 0.5 + 1e-9
    with pytest.raises(ValueError, match="draft_sampling 'top' is not one of greedy, sample"):
        sampled_acceptance(draft_logits, target_logits, temperature=1.0, draft_sampling="top")


def test_accepted_run_counts_the_matching_prefix_plus_the_bonus():
    from draftforge.eval.estimate import accepted_run

    assert accepted_run([5, 6, 7], [5, 6, 9]) == 3
    assert accepted_run([5, 6, 7], [4, 6, 7]) == 1
    assert accepted_run([5, 6], [5, 6, 7, 8]) == 3  # a short proposal stops the run
    assert accepted_run([], [1]) == 1


def test_check_lossless_reports_the_first_divergence():
    from draftforge.eval.speculative import DecodeResult

    ref = DecodeResult(prompt_len=3, tokens=[1, 2, 3, 4], top2_margins=[5.0, 5.0, 1e-6, 5.0])
    with pytest.raises(LosslessCheckError, match="output token 1 is 9"):
        check_lossless(DecodeResult(prompt_len=3, tokens=[1, 9, 3, 4]), ref)
    # a divergence at a numerical near-tie is counted, not raised
    assert check_lossless(DecodeResult(prompt_len=3, tokens=[1, 2, 7, 4]), ref, tie_tolerance=1e-3) == 1
    with pytest.raises(LosslessCheckError):
        check_lossless(DecodeResult(prompt_len=3, tokens=[1, 2, 3]), ref)
