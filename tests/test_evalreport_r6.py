"""Review round 6, evaluation reports and their command line: options that used to be ignored
or to fail with a traceback are refused with what is wrong and where."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from draftforge.cli import main
from draftforge.errors import InputError


def _report(folder, al_sums=(6.0, 5.0, 7.0, 3.0, 8.0)):
    """A report.json as draftforge eval writes it, with hand-made per-prompt totals."""
    methods = {m: {"prompt_rounds": [4, 3, 5, 2, 6], "prompt_al_sum": [s * scale for s in al_sums]}
               for m, scale in (("dspark", 1.0), ("ngram", 0.8))}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({
        "target": "smollm2-135m-instruct", "block_size": 4,
        "settings": {"temperature": 0.0, "max_new_tokens": 16, "verify": "full"},
        "workloads": {"w": {"num_prompts": 5, "prompt_digest": "abc", "methods": methods}},
    }))  # fmt: skip
    return folder / "report.json"


def test_threshold_without_threshold_verification_is_refused_not_ignored(tmp_path, capsys):
    """--threshold under full verification changed nothing: the run verified every block in
    full and reported it as if the threshold had been applied."""
    argv = ["eval", str(tmp_path / "draft"), "--target", "smollm2-135m-instruct", "--device", "cpu",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main([*argv, "--threshold", "0.7"]) == 2
    err = capsys.readouterr().err
    assert ("--threshold 0.7: only for --verify threshold, but verification is 'full' (the default)"
            in err and "Traceback" not in err)  # fmt: skip
    assert main([*argv, "--threshold", "0.7", "--verify", "full"]) == 2
    assert "verification is 'full', which verifies every block in full" in capsys.readouterr().err
    # with threshold verification it is used: the run goes on (to the missing draft)
    assert main([*argv, "--threshold", "0.7", "--verify", "threshold"]) == 2
    assert "--threshold" not in capsys.readouterr().err


def test_a_prompt_longer_than_the_draft_positions_is_refused_before_the_target_loads(
    tmp_path, capsys, monkeypatch
):
    """It used to load the target, then fail in the harness with a ValueError traceback."""
    from draftforge.eval import cli
    from draftforge.splitserve import target

    monkeypatch.setattr(cli, "_draft_loader", lambda path: (SimpleNamespace(max_position_embeddings=20, enable_confidence_head=True, target_layer_ids=[0]), None, lambda: None))
    monkeypatch.setattr(cli, "_check_fit", lambda *args: None)
    monkeypatch.setattr(target, "build_target", lambda *a, **k: pytest.fail("the target was loaded"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([json.dumps({"workload": "a", "input_ids": [1] * 4}), "",
                                  json.dumps({"workload": "a", "input_ids": [1] * 5})]))  # fmt: skip
    argv = ["eval", str(tmp_path / "draft"), "--target", "smollm2-135m-instruct", "--device", "cpu",
            "--prompts-file", str(prompts), "--out", str(tmp_path / "out"), "--max-new-tokens", "16"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:3: 5 prompt tokens + --max-new-tokens 16 exceed the draft's max_position_embeddings 20" in err
    with pytest.raises(InputError, match=r"workload 'b', prompt 1: 3 prompt tokens \+ --max-new-tokens 18 "):
        cli._check_lengths({"a": [[1, 2]], "b": [[1, 2], [1, 2, 3]]}, 18, 20, lambda n, i: f"workload {n!r}, prompt {i}")
    cli._check_lengths({"a": [[1, 2]], "b": [[1, 2], [1, 2]]}, 18, 20, lambda n, i: "unused")  # 20 fit exactly


def test_compare_refuses_a_negative_seed_and_a_report_against_itself(tmp_path, capsys):
    a = _report(tmp_path / "a")
    with pytest.raises(SystemExit) as info:  # it was numpy's ValueError, a traceback
        main(["eval", "compare", str(a), "--seed", "-1"])
    assert info.value.code == 2 and "argument --seed: must be 0 or more, got -1" in capsys.readouterr().err
    # the same report twice (file and folder) compared dspark with itself: zero, "not distinguishable"
    for other in (a, a.parent, tmp_path / "." / "a"):
        assert main(["eval", "compare", str(a), str(other), "--draws", "2000"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and f"comparing dspark of {a} with itself" in captured.err
    # the same report's two methods, and two reports, still compare
    assert main(["eval", "compare", str(a), str(a), "--b-method", "ngram", "--draws", "2000"]) == 0
    b = _report(tmp_path / "b", al_sums=(5.0, 5.0, 6.0, 3.0, 7.0))
    assert main(["eval", "compare", str(a), str(b), "--draws", "2000", "--seed", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"diff_macro={(29 - 26) / 20:.4f} ")  # pooled: 29 / 20 against 26 / 20
