"""The train-time estimate of acceptance, computed on the evaluator's own data (metric honesty).

Training logs ``tau = 1 + sum_k prod_{i<=k} c*_i`` with ``c*_k = 1 - 0.5 ||p_d,k - p_t,k||_1``,
teacher-forced on target-generated text. Here it is computed through the
training objective itself (``DSparkDraft.forward``) on the target's outputs for
the evaluation prompts, so users see how far the training metric is from the
acceptance length measured by real decoding. A second estimate, ``tau_greedy``,
replaces ``c*_k`` by the greedy indicator ``argmax p_d,k == x_{p+k+1}`` (still
teacher-forced): on the target's greedy outputs it is what greedy decoding
would measure if every response position were an anchor (a run whose accepted
drafts reach the end of sequence counts up to it, without the bonus, as decoding
counts that round). When the evaluation
samples, a third, ``tau_sampled``, replaces ``c*_k`` by the acceptance probability
of the evaluator's own sampling rule at its settings (still teacher-forced):
``pi_t(argmax p_d,k)`` for greedy drafts (llama.cpp's rule) or
``sum_x min(pi_t(x), pi_d(x))`` for drawn drafts, where ``pi`` is the distribution
at the evaluation's temperature after its top-k and top-p cut; an accepted end of
sequence counts nothing there (decoding stops at it without the bonus), so near
temperature 0 with greedy drafts it is ``tau_greedy``. At temperature 1 with no cut,
drawn drafts and no end of sequence it is ``tau`` again.

Known gaps (documented in the report):

* ``c*`` is the acceptance probability of speculative *sampling* at temperature
  1; greedy verification accepts iff the argmax matches, which can be higher or
  lower than ``c*`` per slot, and sampling at another temperature, with a top-k
  or top-p cut or with greedy drafts accepts with another probability
  (``tau_sampled`` measures it).
* The estimate averages over up to 64 randomly drawn response positions a prompt as
  anchors; decoding
  only anchors where the previous round ended (after rejections), which are the
  harder positions, so measured AL is usually below the estimate.
* Blocks near the end of a response are cut (fewer valid slots) in the estimate.

Where n-gram lookup wins is measured on the same anchors: ``lookup_share`` is the share
of anchors where prompt lookup (the evaluator's ``ngram`` baseline, same n-gram sizes)
has a proposal; there, ``ngram_run_at_lookup`` is its teacher-forced accepted run (1 +
the proposal's prefix that equals the target's output) and ``tau_greedy_at_lookup`` the
draft's; ``tau_greedy_elsewhere`` is the draft's on the other anchors. A draft that
copies from the context scores higher at lookup anchors than elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from draftforge.errors import InputError
from draftforge.eval.baselines import ngram_lookup
from draftforge.eval.speculative import check_draft_sampling, matching_prefix, sampling_probs
from draftforge.train.blocks import sample_anchors


def accepted_run(proposal: Sequence[int], truth: Sequence[int], eos_token_ids: Collection[int] = ()) -> int:
    """1 + the length of ``proposal``'s prefix equal to ``truth`` (greedy verification). An
    accepted end-of-sequence token ends the request, so the run counts up to it without the
    bonus, as :func:`~draftforge.eval.speculative.speculative_decode` counts such a round."""
    accepted = matching_prefix(proposal, truth)
    for index, token in enumerate(truth[:accepted]):
        if token in eos_token_ids:
            return index + 1
    return accepted + 1


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def sampled_acceptance(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_sampling: str = "greedy",
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """Each slot's probability of acceptance when decoding samples, from its logits [n, V].

    ``greedy``: the draft proposes its most likely token x and the target accepts it with
    ``pi_t(x)``. ``sample``: the draft draws from ``pi_d`` and rejection sampling accepts with
    probability ``sum_x min(pi_t(x), pi_d(x))``. Both distributions are cut as the evaluator
    cuts them (:func:`~draftforge.eval.speculative.sampling_probs`). An accepted
    end-of-sequence token (``eos_token_ids``) ends the request without the bonus, so it adds
    nothing to the round: only the acceptance of other tokens counts, and then
    ``1 + sum_k prod_{i<=k}`` of these is the round's expected count as decoding counts it.
    """
    check_draft_sampling(draft_sampling)
    target = sampling_probs(target_logits.float(), temperature, top_k, top_p)
    if draft_sampling == "greedy":
        proposed = draft_logits.argmax(-1, keepdim=True)
        accept = target.gather(-1, proposed)[..., 0]
        return accept.masked_fill(torch.isin(proposed[..., 0], _ids(eos_token_ids, proposed.device)), 0.0)
    both = torch.minimum(target, sampling_probs(draft_logits.float(), temperature, top_k, top_p))
    # an end-of-sequence id beyond the vocabulary (a tokenizer larger than the embedding) is
    # never drawn: nothing of it to leave out
    both[..., _ids([i for i in eos_token_ids if 0 <= i < both.shape[-1]], both.device)] = 0.0
    return both.sum(-1)


def check_target_layers(draft, target) -> None:
    """Refuse a target that captures other layers than the draft reads: the estimate takes the
    draft's auxiliary features from ``target.features`` (the layers the target was built with),
    while decoding captures the draft's ``target_layer_ids``, so a mismatch of the same count
    would give a plausible but wrong tau (and of another count, a shape error naming nothing)."""
    built, wanted = getattr(target, "layer_ids", None), list(draft.config.target_layer_ids)
    if built is not None and list(built) != wanted:
        raise InputError(
            f"train-time estimate: target {getattr(target, 'name', '?')!r} captures layers {list(built)} "
            f"but the draft reads target_layer_ids {wanted}; build the target with the draft's "
            "target_layer_ids"
        )


def _ids(token_ids: Collection[int], device) -> torch.Tensor:
    return torch.tensor(sorted(token_ids), dtype=torch.long, device=device)


@torch.no_grad()
def train_time_estimate(
    draft,
    target,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_anchors: int = 64,
    seed: int = 0,
    max_ngram: int = 3,
    ngram_match: str = "latest",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_sampling: str = "greedy",
    eos_token_ids: Sequence[int] = (),
) -> dict:
    """``tau`` (objective c*) and ``tau_greedy`` over up to ``max_anchors`` response anchors per sequence.

    ``sequences``: (prompt ids, target output ids). ``target`` provides
    ``features(input_ids)`` (an HFTarget). ``max_ngram``, ``ngram_match``: the n-gram baseline's largest n and match rule.
    A ``temperature`` above 0 adds ``tau_sampled``, the estimate under the evaluator's
    sampling rule with these ``top_k``, ``top_p`` and ``draft_sampling`` settings
    (:func:`sampled_acceptance`). ``eos_token_ids``: the decoding's end-of-sequence tokens,
    where the greedy runs (``tau_greedy``, the lookup's) stop without the bonus (:func:`accepted_run`),
    and whose acceptance ``tau_sampled`` does not count (:func:`sampled_acceptance`).
    """
    check_target_layers(draft, target)
    draft = draft.eval()
    gamma = draft.config.block_size
    device = draft.fc.weight.device
    generator = torch.Generator().manual_seed(seed)
    eos = frozenset(eos_token_ids)
    c_stars, valids, greedy_taus, sampled_taus = [], [], [], []
    at_lookup, elsewhere, ngram_runs = [], [], []
    for prompt, output in sequences:
        ids = list(prompt) + list(output)
        prompt_len = len(prompt)
        if len(output) < 2:
            continue
        input_ids = torch.tensor([ids], dtype=torch.long)
        feats = target.features(input_ids)
        aux, final = feats.aux.to(device), feats.final.to(device)
        loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
        loss_mask[0, prompt_len:] = True
        anchors, valid = sample_anchors(loss_mask, max_anchors, generator=generator)
        out = draft(input_ids.to(device), loss_mask.to(device), aux, final, anchors.to(device), valid.to(device))
        blocks = out.valid[:, 0]
        c_stars.append(out.c_star[blocks].float().cpu())
        valids.append(out.valid[blocks].float().cpu())
        for p in anchors[0][valid[0]].tolist():
            truth = ids[p + 1 : p + 1 + gamma]
            anchor = torch.tensor([ids[p]], device=device)
            hidden = draft.block_forward(anchor, p, aux[:, :p])
            forced = torch.tensor(truth + [0] * (gamma - len(truth)), device=device)
            _, logits, _ = draft.draft_block(hidden, anchor, sample=lambda _l, k, forced=forced: forced[k : k + 1])
            run = accepted_run(logits[0, : len(truth)].argmax(-1).tolist(), truth, eos)
            greedy_taus.append(run)
            if temperature > 0:
                # slot k predicts token p + k + 1 from the target's final state at p + k
                target_logits = draft.base_logits(final[0, p : p + len(truth)].to(draft.lm_head.weight.dtype))
                accept = sampled_acceptance(logits[0, : len(truth)], target_logits, temperature=temperature,
                                            top_k=top_k, top_p=top_p, draft_sampling=draft_sampling,
                                            eos_token_ids=eos)
                sampled_taus.append(float(1.0 + accept.cumprod(0).sum()))
            lookup = ngram_lookup(ids[: p + 1], gamma, max_ngram, match=ngram_match)
            if lookup:
                at_lookup.append(run)
                ngram_runs.append(accepted_run(lookup, truth, eos))
            else:
                elsewhere.append(run)
    if not c_stars:
        nan = float("nan")
        empty = {"tau": nan, "tau_greedy": nan, "slot_c_star": [], "num_blocks": 0,
                 "lookup_share": nan, "tau_greedy_at_lookup": nan, "tau_greedy_elsewhere": nan,
                 "ngram_run_at_lookup": nan}  # fmt: skip
        return empty | ({"tau_sampled": nan} if temperature > 0 else {})
    c_star, slot_valid = torch.cat(c_stars), torch.cat(valids)
    tau = float((1.0 + (c_star * slot_valid).cumprod(-1).sum(-1)).mean())
    slot_means = (c_star * slot_valid).sum(0) / slot_valid.sum(0)  # NaN where never valid, as in training
    result = {
        "tau": tau,
        "tau_greedy": sum(greedy_taus) / len(greedy_taus),
        "slot_c_star": [float(x) for x in slot_means],
        "num_blocks": int(c_star.shape[0]),
        "lookup_share": len(at_lookup) / len(greedy_taus),
        "tau_greedy_at_lookup": _mean(at_lookup),
        "tau_greedy_elsewhere": _mean(elsewhere),
        "ngram_run_at_lookup": _mean(ngram_runs),
    }
    if temperature > 0:
        result["tau_sampled"] = _mean(sampled_taus)
    return result
