"""The evaluator, review round 13: empty prompts, compare's inputs that could not be paired, the
sampled estimate at an end of sequence, and the lossless check's message when an output ends early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import random_prompts
from test_eval_speculative import QUIET, draft, target  # noqa: F401  (fixtures)

from draftforge.cli import main
from draftforge.errors import InputError
from draftforge.eval.baselines import NoDraft
from draftforge.eval.harness import EvalSettings, run_workload
from draftforge.eval.speculative import DecodeSettings, TargetSession, speculative_decode


def _report(folder: Path, workloads: dict) -> Path:
    """A report.json as draftforge eval writes it, with these ``workloads``."""
    report = {
        "command": "draftforge eval ...", "draft": "d", "target": "smollm2-135m-instruct",
        "target_config": {"model": "smollm2-135m-instruct", "dtype": "float32", "backend": "hf",
                          "seed": 0, "shape": None},
        "settings": {"max_new_tokens": 128, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                     "verify": "full", "threshold": 0.5, "seed": 0, "ngram_max": 3,
                     "ngram_match": "latest"},
        "block_size": 4,
        "workloads": workloads,
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report))
    return folder / "report.json"


def _workload(rounds: list[int], *, num_prompts: int | None = None) -> dict:
    methods = {m: {"prompt_rounds": rounds, "prompt_al_sum": [r * al for r in rounds]}
               for m, al in (("dspark", 1.5), ("ngram", 1.25), ("none", 1.0))}
    entry = {"prompt_digest": "abc", "methods": methods}
    if num_prompts is not None:
        entry["num_prompts"] = num_prompts
    return entry


@pytest.mark.parametrize(("bad", "why"), [(600, "outside the"), (-1, "token ids are never negative")])
def test_a_token_id_the_target_has_no_embedding_for_is_refused_naming_it(target, draft, bad, why):
    """Such an id failed inside the target's forward with a bare "index out of range in self"
    (a device-side assert on a GPU), naming no prompt (review round 62; the CLI refuses it
    earlier, a library caller of run_workload did not)."""
    prompts = random_prompts(2)
    prompts[1] = prompts[1][:3] + [bad] + prompts[1][4:]
    with pytest.raises(InputError, match=r"^workload 'w', prompt 1: ") as refused:
        run_workload("w", prompts, draft, target, EvalSettings(max_new_tokens=4, estimate=False), **QUIET)
    assert "position 3" in str(refused.value) and str(bad) in str(refused.value)
    assert why in str(refused.value), str(refused.value)


def test_an_empty_prompt_is_refused_naming_it(target, draft):
    """An empty prompt reached the target's prefill and failed inside attention ("cannot
    reshape tensor of 0 elements"), naming neither the workload nor the prompt."""
    prompts = random_prompts(2) + [[]]
    with pytest.raises(InputError, match=r"^workload 'w', prompt 2: an empty prompt \(no token ids\): "
                                         "decoding starts from the target's prefill of at least one token"):
        run_workload("w", prompts, draft, target, EvalSettings(max_new_tokens=4, estimate=False), **QUIET)


def test_compare_refuses_a_report_without_workloads(tmp_path, capsys):
    """A report whose workloads table is empty ended in a ValueError traceback from the bootstrap."""
    empty = _report(tmp_path / "e", {})
    assert main(["eval", "compare", str(empty)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"draftforge eval compare: error: {empty}: its 'workloads' table is empty: no workload was "
        "evaluated, so there is nothing to compare"
    )
    assert captured.out == ""


def test_compare_refuses_per_prompt_totals_that_disagree_with_the_prompt_count(tmp_path, capsys):
    """prompt_rounds of 4 prompts in a workload of 5 printed the table's header, then ended in
    a ValueError traceback from the bootstrap ("a paired comparison needs the same prompts")."""
    sound = _report(tmp_path / "a", {"w": _workload([4, 3, 5, 2, 6], num_prompts=5)})
    damaged = _workload([4, 3, 5, 2, 6], num_prompts=5)
    damaged["methods"]["dspark"] = {"prompt_rounds": [4, 3, 5, 2], "prompt_al_sum": [6, 4.5, 7.5, 3]}
    bad = _report(tmp_path / "b", {"w": damaged})
    for args in ([str(bad)], [str(sound), str(bad)]):
        assert main(["eval", "compare", *args]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no half-printed table
        assert captured.err.strip() == (
            f"draftforge eval compare: error: {bad}: workload 'w', method 'dspark': prompt_rounds "
            "holds 4 prompts but the workload's num_prompts is 5; the report is damaged: evaluate it again"
        )
    # older reports record no num_prompts: the two sides' totals must still pair prompt by prompt
    old_a = _report(tmp_path / "c", {"w": _workload([4, 3, 5, 2, 6])})
    old_b = _report(tmp_path / "d", {"w": _workload([4, 3, 5, 2])})
    assert main(["eval", "compare", str(old_a), str(old_b)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"draftforge eval compare: error: workload 'w': dspark of {old_a} has per-prompt totals of 5 "
        f"prompts but dspark of {old_b} of 4, so they cannot be paired prompt by prompt; the report is "
        "damaged: evaluate it again"
    )
    # sound reports still compare: 1.5 against 1.25 on every prompt
    assert main(["eval", "compare", str(sound)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "diff_macro=0.2500 low=0.2500 high=0.2500 verdict=ahead"
    )


def test_the_sampled_estimate_counts_an_accepted_end_of_sequence_as_decoding_does(target, draft):
    """Decoding stops at an accepted end of sequence without the bonus, and tau_greedy counts so
    (round 11); tau_sampled still added the EOS's acceptance and a bonus after it, so near
    temperature 0 with greedy drafts it no longer equalled tau_greedy (1.5 against 1.0 here:
    the draft's first slot predicts the output's end of sequence at its last anchor)."""
    from draftforge.eval.estimate import sampled_acceptance, train_time_estimate
    from draftforge.eval.speculative import sampling_probs

    prompt = random_prompts(1, seed=21)[0]
    session = TargetSession(target.model, None)
    output = speculative_decode(session, prompt, NoDraft(), DecodeSettings(max_new_tokens=3)).tokens
    eos = output[-1]
    assert output.index(eos) == 2  # the output ends at its first EOS, as decoding ends
    without = train_time_estimate(draft, target, [(prompt, output)], temperature=1e-4)
    assert without["tau_greedy"] == pytest.approx(1.5) and without["tau_sampled"] == pytest.approx(1.5, abs=1e-4)
    cold = train_time_estimate(draft, target, [(prompt, output)], temperature=1e-4, eos_token_ids=(eos,))
    assert cold["tau_greedy"] == pytest.approx(1.0)  # the accepted EOS ends that round: 1, not 2
    assert cold["tau_sampled"] == pytest.approx(cold["tau_greedy"], abs=1e-4)

    # each slot, by hand: a proposed (greedy) or drawn EOS adds nothing to the round
    gen = torch.Generator().manual_seed(4)
    draft_logits, target_logits = torch.randn(2, 7, generator=gen) * 2, torch.randn(2, 7, generator=gen) * 2
    end = int(draft_logits[0].argmax())
    pi_t, pi_d = sampling_probs(target_logits, 0.8), sampling_probs(draft_logits, 0.8)
    greedy = sampled_acceptance(draft_logits, target_logits, temperature=0.8, eos_token_ids={end})
    expected = [0.0 if int(draft_logits[r].argmax()) == end else float(pi_t[r, draft_logits[r].argmax()])
                for r in range(2)]
    assert greedy.tolist() == pytest.approx(expected) and expected[1] > 0
    drawn = sampled_acceptance(draft_logits, target_logits, temperature=0.8, draft_sampling="sample",
                               eos_token_ids={end})
    others = [x for x in range(7) if x != end]
    assert drawn.tolist() == pytest.approx(torch.minimum(pi_t, pi_d)[:, others].sum(-1).tolist())


def test_the_lossless_check_says_which_output_ended_early(target):
    """An output that stops before the other (a verifier that drops a round's bonus at the token
    limit, or emits past an end of sequence) was reported as "output token 5 is None", with
    the speculative token "at least inf below the reference's"."""
    from draftforge.eval.speculative import DecodeResult, LosslessCheckError, check_lossless

    prompt = random_prompts(1)[0]
    session = TargetSession(target.model, None)
    plain = speculative_decode(session, prompt, NoDraft(), DecodeSettings(max_new_tokens=8))
    ref = plain.tokens
    short = DecodeResult(prompt_len=len(prompt), tokens=ref[:5])
    with pytest.raises(LosslessCheckError) as caught:
        check_lossless(short, plain, label="w prompt 0 (dspark)")
    assert str(caught.value) == (
        "w prompt 0 (dspark): greedy speculative decoding is not lossless: the speculative output ends "
        f"after 5 tokens where the plain greedy output goes on with token 5, {ref[5]} (5 against 8 tokens "
        f"in all); speculative {ref[2:5]} vs plain {ref[2:8]}"
    )
    longer = DecodeResult(prompt_len=len(prompt), tokens=ref + [7])
    with pytest.raises(LosslessCheckError) as caught:
        check_lossless(longer, plain, label="w prompt 0 (dspark)")
    assert str(caught.value) == (
        "w prompt 0 (dspark): greedy speculative decoding is not lossless: the plain greedy output ends "
        f"after 8 tokens where the speculative output goes on with token 8, 7 (9 against 8 tokens in all); "
        f"speculative {ref[5:] + [7]} vs plain {ref[5:]}"
    )
