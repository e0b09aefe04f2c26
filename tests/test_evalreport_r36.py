"""Round 36 of the evaluation report's review: what compare's refusals name, what report.md
says of the acceptance length's last round and of tokens/s, and what the plots are labelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftforge.cli import main
from draftforge.eval import report
from draftforge.eval.harness import WorkloadResult, summarize
from draftforge.eval.speculative import DecodeResult, Round


def _write(folder: Path, **settings) -> Path:
    """A report.json as draftforge eval writes it (hand-made metrics, 5 prompts), with
    ``settings`` changed."""
    report_json = {
        "command": "draftforge eval ...",
        "target": "smollm2-135m-instruct",
        "target_config": {"model": "smollm2-135m-instruct", "dtype": "float32", "backend": "hf",
                          "seed": 0, "shape": None},
        "settings": {"max_new_tokens": 128, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                     "draft_sampling": "greedy", "verify": "full", "threshold": 0.5, "seed": 0,
                     "baselines": ["none", "ngram"], "ngram_max": 3, "ngram_match": "latest"} | settings,
        "block_size": 4,
        "workloads": {"w": {
            "num_prompts": 5, "prompt_digest": "abc",
            "methods": {m: {"prompt_rounds": [4, 3, 5, 2, 6], "prompt_al_sum": [s, 5.0, 7.0, 3.0, 8.0]}
                        for m, s in (("dspark", 6.0), ("ngram", 5.0), ("none", 4.0))},
        }},
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report_json))
    return folder / "report.json"


def test_compare_refusal_names_only_the_settings_in_effect(tmp_path, capsys):
    """A greedy report against a sampled one differs in its temperature; its seed, which
    greedy decoding does not use, is no difference to match, and the advice named --seed."""
    greedy = _write(tmp_path / "greedy", seed=0)
    sampled = _write(tmp_path / "sampled", temperature=0.7, seed=1, top_k=20)
    assert main(["eval", "compare", str(greedy), str(sampled)]) == 2
    err = capsys.readouterr().err
    assert "settings.temperature is 0.0 in A, 0.7 in B" in err
    assert "settings.seed" not in err and "settings.top_k" not in err, err
    assert "(--temperature)" in err, err
    # full verification against a threshold: the mode differs, not the unused threshold
    full = _write(tmp_path / "full", threshold=0.5)
    cut = _write(tmp_path / "cut", verify="threshold", threshold=0.9)
    assert main(["eval", "compare", str(full), str(cut)]) == 2
    err = capsys.readouterr().err
    assert "settings.verify is 'full' in A, 'threshold' in B" in err
    assert "settings.threshold" not in err and "--threshold" not in err, err
    # two sampled or two threshold reports are still held to the same seed and threshold
    assert main(["eval", "compare", str(sampled), str(_write(tmp_path / "s2", temperature=0.7, seed=2,
                                                             top_k=20))]) == 2  # fmt: skip
    assert "settings.seed is 1 in A, 2 in B" in capsys.readouterr().err
    assert main(["eval", "compare", str(cut), str(_write(tmp_path / "c2", verify="threshold",
                                                         threshold=0.5))]) == 2  # fmt: skip
    assert "settings.threshold is 0.9 in A, 0.5 in B" in capsys.readouterr().err


def _workload() -> WorkloadResult:
    # max_new_tokens 6: the prefill gives 1 token, a round of 3, then a round accepting 3
    # drafts + bonus (4) that reaches past the limit: AL sum 7 for 5 new tokens after the first
    decoded = [DecodeResult(prompt_len=3, tokens=[1, 2, 3, 4, 5, 6], wall_s=0.5, rounds=[
        Round(num_proposed=4, num_verified=4, num_accepted=2, acceptance_length=3),
        Round(num_proposed=4, num_verified=4, num_accepted=3, acceptance_length=4),
    ])]  # fmt: skip
    result = WorkloadResult(name="w", num_prompts=1)
    result.methods = {m: summarize(decoded, 4) for m in ("dspark", "none")}
    return result


def test_report_md_says_how_the_last_round_and_tokens_per_s_are_counted():
    """report.md's AL (3.50 here) summed over the rounds (7) exceeds the new tokens after the
    first (5): the note under the table said nothing of the round that reaches past
    max_new_tokens (README: it counts its whole run), nor what tokens/s divides."""
    result = _workload()
    m = result.methods["dspark"]
    assert m["acceptance_length"] == 3.5 and sum(m["prompt_al_sum"]) == 7 and m["tokens"] == 6
    text = report.markdown_table([result], block_size=4)
    assert "| w | dspark | 3.50 | 5.00 | 12.0 | 1.00x | 0.5 |" in text
    assert "reach past max_new_tokens: it counts its whole accepted run" in text
    assert "can exceed its new tokens" in text
    assert "Tokens/s: the new tokens (the prefill's first one included" in text


def test_plots_say_what_they_show(tmp_path, monkeypatch):
    """The acceptance plot's dotted line (the ceiling, block size + 1) was unlabelled, and
    neither plot said what its figure is."""
    seen = {}

    def keep(fig, path):
        ax = fig.axes[0]
        seen[path.name] = {"title": ax.get_title(), "texts": [t.get_text() for t in ax.texts],
                           "legend": [t.get_text() for t in ax.get_legend().get_texts()]}
        return path

    monkeypatch.setattr(report, "_save", keep)
    report.plot([_workload()], tmp_path, block_size=4)
    bars = seen["acceptance_length.png"]
    assert "accepted drafts + 1 bonus token, mean per verification round" in bars["title"]
    assert "at most block size + 1 = 5" in bars["texts"]
    assert bars["legend"] == ["dspark", "none"]  # the legend still names the methods alone
    assert "accepted / reached" in seen["position_acceptance.png"]["title"]


@pytest.mark.parametrize(("rounds", "al_sum", "says"), [
    ([3, 0], [5, 2], "prompt 1: prompt_al_sum 2 with prompt_rounds 0"),
    ([2.5, 1], [4, 1], "prompt 0: prompt_rounds 2.5 is not a whole number of rounds"),
])
def test_a_damaged_reports_impossible_per_prompt_totals_are_refused(rounds, al_sum, says):
    """A prompt with no round but a summed AL added tokens to the pooled AL out of nothing, and
    half a round was taken as it came: both are refused naming the prompt."""
    from draftforge.errors import InputError
    from draftforge.eval.uncertainty import PromptTotals

    with pytest.raises(InputError) as refused:
        PromptTotals.from_summary({"prompt_rounds": rounds, "prompt_al_sum": al_sum}, "r.json: gsm8k dspark")
    assert str(refused.value).startswith(f"r.json: gsm8k dspark: {says}")
    assert len(PromptTotals.from_summary({"prompt_rounds": [3, 0], "prompt_al_sum": [5, 0]}, "ok")) == 2
