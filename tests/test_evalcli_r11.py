"""Review round 11 of the evaluation command line and its outputs (``eval/cli.py``,
``eval/report.py``, ``eval/demo.py``, ``eval/compare.py``): the report's figures recomputed
from the rounds that were decoded, and the fixes of this round."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eval_helpers import random_prompts, tiny_debug_recipe, tiny_eval_draft

from draftforge.config import load_recipe
from draftforge.splitserve.target import build_target
from draftforge.train.export import export_draft

BLOCK = 4  # eval_helpers' draft


@pytest.fixture
def recipe_path(tmp_path):
    """tiny-debug with the eval helpers' 512-token vocabulary (prompts come as token ids)."""
    return tiny_debug_recipe(tmp_path)


@pytest.fixture
def tiny_export(recipe_path, tmp_path):
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    return export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)


def _prompts_file(tmp_path: Path, names: list[str], length: int = 10) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = zip(names, random_prompts(len(names), length=length), strict=True)
    path.write_text("\n".join(json.dumps({"workload": w, "input_ids": ids}) for w, ids in rows) + "\n")
    return path


def _method_of(proposer) -> str:
    from draftforge.eval.baselines import NgramProposer, NoDraft
    from draftforge.eval.speculative import DraftProposer

    return {DraftProposer: "dspark", NgramProposer: "ngram", NoDraft: "none"}[type(proposer)]


def _expected(decoded: list[tuple[list[int], object]]) -> dict:
    """One method's figures over a workload, from each prompt's rounds as decoded: the mean
    over rounds of accepted + 1, position k's share accepted among the rounds that verified
    it after accepting 0..k-1, the tokens the target ran a round, and the wall time."""
    rounds = [r for _, res in decoded for r in res.rounds]
    outcomes = []  # per round, per drafted slot verified: accepted or not, in order
    for r in rounds:
        outcomes.append([k < r.num_accepted for k in range(r.num_verified)])
    position = []
    for k in range(BLOCK):
        reached = [o[k] for o in outcomes if len(o) > k and all(o[:k])]
        position.append(sum(reached) / len(reached) if reached else None)
    wall = sum(res.wall_s for _, res in decoded)
    return {
        "acceptance_length": sum(r.num_accepted + 1 for r in rounds) / len(rounds),
        "position_acceptance": position,
        "tokens_verified_per_round": sum(r.tokens_run for r in rounds) / len(rounds),
        "wall_s": wall,
        "tokens_per_s": sum(len(res.tokens) for _, res in decoded) / wall,
        "prompts": [p for p, _ in decoded],
    }


def test_the_reports_figures_are_those_of_the_rounds_decoded(recipe_path, tmp_path, tiny_export, monkeypatch,
                                                            capsys):
    """Every decode the run makes is recorded; report.json, report.md and the summary line
    must hold what those rounds give, each method on the same prompts."""
    from draftforge.eval import harness
    from draftforge.eval import report as report_mod
    from draftforge.eval.cli import main

    decoded: dict[tuple[str, str], list] = {}
    real = harness.speculative_decode
    current = {}

    def recording(session, prompt, proposer, settings, **kw):
        result = real(session, prompt, proposer, settings, **kw)
        if current.get("warming"):  # the untimed warm-up's decodes, discarded
            return result
        decoded.setdefault((current["workload"], _method_of(proposer)), []).append((list(prompt), result))
        return result

    real_run = harness.run_workload

    def run_workload(name, *args, **kw):
        current["workload"] = name
        return real_run(name, *args, **kw)

    real_warm_up = harness.warm_up

    def warm_up(*args):
        current["warming"] = True
        try:
            real_warm_up(*args)
        finally:
            current["warming"] = False

    monkeypatch.setattr(harness, "speculative_decode", recording)
    monkeypatch.setattr(harness, "warm_up", warm_up)
    drawn = {}
    real_plot = report_mod.plot

    def plot(results, out_dir, *, block_size, save):
        def spy(fig, path):  # what each PNG shows, read off its figure
            ax = fig.axes[0]
            drawn[path.name] = {
                "bars": [p.get_height() for p in ax.patches],
                "bar_labels": [t.get_text() for t in ax.get_legend().get_texts()],
                "lines": {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
                          if not line.get_label().startswith("_")},
            }
            return save(fig, path)

        return real_plot(results, out_dir, block_size=block_size, save=spy)

    monkeypatch.setattr(report_mod, "plot", plot)
    monkeypatch.setattr(harness, "run_workload", run_workload)
    prompts = _prompts_file(tmp_path, ["alpha", "alpha", "beta"])
    out = tmp_path / "r"
    assert main([str(tiny_export), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "14", "--out", str(out), "--no-estimate"]) == 0  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    table = (out / "report.md").read_text()
    assert set(report["workloads"]) == {"alpha", "beta"}
    macro = {}
    for name, entry in report["workloads"].items():
        expected = {m: _expected(decoded[(name, m)]) for m in ("dspark", "ngram", "none")}
        # the baselines decoded exactly the draft's prompts
        assert expected["dspark"]["prompts"] == expected["ngram"]["prompts"] == expected["none"]["prompts"]
        assert entry["num_prompts"] == len(expected["dspark"]["prompts"])
        for method, want in expected.items():
            got = entry["methods"][method]
            assert got["acceptance_length"] == pytest.approx(want["acceptance_length"]), (name, method)
            assert got["tokens_verified_per_round"] == pytest.approx(want["tokens_verified_per_round"])
            assert got["wall_s"] == pytest.approx(want["wall_s"])
            assert got["tokens_per_s"] == pytest.approx(want["tokens_per_s"])
            assert got["position_acceptance"] == [None if v is None else pytest.approx(v)
                                                  for v in want["position_acceptance"]], (name, method)
            speedup = want["tokens_per_s"] / expected["none"]["tokens_per_s"]
            row = (f"| {name} | {method} | {want['acceptance_length']:.2f} | "
                   f"{want['tokens_verified_per_round']:.2f} | {want['tokens_per_s']:.1f} | "
                   f"{speedup:.2f}x | {want['wall_s']:.1f} |")
            assert row in table, row
            macro.setdefault(method, []).append(want["acceptance_length"])
        cells = " | ".join("-" if v is None else f"{v:.2f}" for v in expected["dspark"]["position_acceptance"])
        assert f"| {name} | {cells} |" in table
    # acceptance_length.png: one bar per workload and method, method by method
    names = list(report["workloads"])
    methods = drawn["acceptance_length.png"]["bar_labels"]
    assert methods == ["dspark", "ngram", "none"]
    assert drawn["acceptance_length.png"]["bars"] == [
        pytest.approx(_expected(decoded[(n, m)])["acceptance_length"]) for m in methods for n in names]
    # position_acceptance.png: the draft's and n-gram's conditional acceptance per position
    lines = drawn["position_acceptance.png"]["lines"]
    assert set(lines) == {f"{n} {m}" for n in names for m in ("dspark", "ngram")}
    for label, ys in lines.items():
        name, method = label.split()
        want = _expected(decoded[(name, method)])["position_acceptance"]
        assert [None if y != y else pytest.approx(y) for y in ys] == [
            None if v is None else pytest.approx(v) for v in want], label
    summary = []
    for method, values in macro.items():
        assert report["macro_acceptance_length"][method] == pytest.approx(sum(values) / len(values))
        summary.append(f"al_{method}={sum(values) / len(values):.3f}")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"eval_dir={out} " + " ".join(summary)


@pytest.fixture
def no_target(monkeypatch):
    """Fails a test that gets as far as loading the target."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr("draftforge.splitserve.target.build_target", refuse)


def test_compare_names_a_file_that_is_not_a_report_instead_of_a_traceback(tmp_path, capsys):
    """`draftforge eval compare runs/eval/acceptance_length.png` (the report folder's plot,
    one tab away from report.json) died with a UnicodeDecodeError traceback, and a report
    whose workload entry or methods were not tables with an AttributeError."""
    from draftforge.cli import main

    png = tmp_path / "acceptance_length.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    assert main(["eval", "compare", str(png)]) == 2
    err = capsys.readouterr().err
    assert f"{png}: not a text file (byte 0: invalid start byte); give the report's report.json" in err
    assert "Traceback" not in err
    for workloads, key, kind in (({"w": [1, 2]}, "workloads.w", "list"),
                                 ({"w": {"methods": ["dspark"]}}, "workloads.w.methods", "list"),
                                 ({"w": {"methods": {}}, "v": "x"}, "workloads.v", "str")):  # fmt: skip
        path = tmp_path / "report.json"
        path.write_text(json.dumps({"workloads": workloads}))
        assert main(["eval", "compare", str(tmp_path)]) == 2
        assert f"{path}: {key} must be a table, got {kind}; not a draftforge eval report" in capsys.readouterr().err


def test_the_tie_tolerance_is_refused_when_sampling_which_it_would_not_change(recipe_path, tmp_path, no_target,
                                                                             capsys):
    """Only greedy outputs are checked against plain decoding; a sampled run ignored
    --tie-tolerance (and recorded it in report.json's settings) where greedy refuses the
    sampling options it would ignore."""
    from draftforge.cli import main

    prompts = _prompts_file(tmp_path, ["w"])
    base = ["eval", "some/draft", "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--tie-tolerance", "0.5", "--out", str(tmp_path / "r")]
    assert main([*base, "--temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert ("--tie-tolerance 0.5: only for greedy decoding, whose outputs are checked against plain "
            "decoding, but the temperature is 0.7 (sampled outputs") in err
    assert "give --temperature 0, or leave it out" in err
    head, section = recipe_path.read_text().split("\neval:\n", 1)
    sampled = tmp_path / "sampled.yaml"
    sampled.write_text(head + "\neval:\n  temperature: 0.9\n" + section)
    assert main([*base[:3], str(sampled), *base[4:]]) == 2
    assert "but the temperature is 0.9 (the recipe's eval.temperature)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_each_option_says_its_default_in_help():
    """--seed's help gave the recipe's eval.seed as its default and not what runs without a
    recipe (0, as the README says); every default is checked here against the code's."""
    from draftforge.eval import compare, demo
    from draftforge.eval.cli import build_parser
    from draftforge.eval.config import EvalConfig

    def helps(parser) -> dict[str, tuple[object, str]]:
        return {a.option_strings[0] if a.option_strings else a.dest: (a.default, " ".join(a.help.split()))
                for a in parser._actions if a.help and a.dest != "help"}  # fmt: skip

    defaults = EvalConfig()
    # options whose default, without a recipe, is the eval section's
    from_section = {"--temperature": defaults.temperature, "--top-k": defaults.top_k, "--top-p": defaults.top_p,
                    "--draft-sampling": defaults.draft_sampling, "--max-new-tokens": defaults.max_new_tokens,
                    "--verify": defaults.verify, "--threshold": defaults.confidence_threshold,
                    "--seed": defaults.seed}  # fmt: skip
    eval_help = helps(build_parser())
    for option, value in from_section.items():
        assert f"else {value})" in eval_help[option][1], (option, eval_help[option][1])
    assert "else all)" in eval_help["--num-prompts"][1] and defaults.num_prompts is None
    assert "else both)" in eval_help["--baselines"][1] and defaults.baselines == ["none", "ngram"]
    assert "else all three)" in eval_help["--workloads"][1] and len(defaults.workloads) == 3
    for parser in (build_parser(), compare.build_parser(), demo.build_parser()):
        for option, (default, text) in helps(parser).items():
            if default not in (None, False):  # a default argparse itself applies
                assert re.search(rf"\b{re.escape(str(default))}\b.*default|default.*\b{re.escape(str(default))}\b",
                                 text), (parser.prog, option, default, text)


def test_a_prompts_file_and_an_out_folder_under_home_are_found(tmp_path, recipe_path, no_target, monkeypatch, capsys):
    """`--prompts-file=~/p.jsonl` (no shell expands a tilde after '=') was refused as 'no such
    file' though the draft, --out and --calibrate expand it; and an earlier report in
    `--out ~/r` went unannounced, although the run replaced it."""
    from draftforge.cli import main
    from draftforge.eval.cli import _prompts_from_file

    monkeypatch.setenv("HOME", str(tmp_path))
    _prompts_file(tmp_path, ["w", "w"])
    assert _prompts_from_file("~/prompts.jsonl", None)[0] == {"w": random_prompts(2)}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(json.dumps({"draft": "the/earlier/draft", "workloads": {}}))
    recipe = load_recipe(recipe_path)
    export = export_draft(tiny_eval_draft(build_target(recipe.target, recipe.draft.target_layer_ids)),
                          tmp_path / "export", progress=lambda _: None)
    one = tmp_path / "one.jsonl"  # one prompt a workload: --calibrate is refused, after the announcement
    one.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}) + "\n")
    assert main(["eval", str(export), "--recipe", str(recipe_path), f"--prompts-file=~/{one.name}",
                 "--out", "~/r", "--calibrate", "~/sts.json"]) == 2  # fmt: skip
    captured = capsys.readouterr()
    assert "no such file" not in captured.err
    assert "holds one prompt a workload" in captured.err  # it got as far as the prompts
    assert f"eval: {tmp_path / 'r'} holds a report of draft the/earlier/draft from" in captured.out


def test_compare_refuses_too_few_draws_for_the_interval(tmp_path, capsys):
    """With one draw the 95 % interval was that draw: -0.571 to -0.571 around -0.533. Each tail
    of a level-L interval needs at least one draw: 2 / (1 - L) of them (40 at 0.95, 200 at 0.99)."""
    from draftforge.cli import main

    for draws, level, least in (("1", "0.95", 40), ("39", "0.95", 40), ("199", "0.99", 200)):
        with pytest.raises(SystemExit) as info:
            main(["eval", "compare", str(tmp_path), "--draws", draws, "--level", level])
        assert info.value.code == 2
        assert (f"--draws {draws} is too few for a {level} interval: each of its tails needs a draw, "
                f"so at least {least}") in capsys.readouterr().err
