"""Regressions found reviewing the round-13..16 fixes of core/, data/, eval/ and recipes/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_command_started_with_stdout_closed_still_succeeds(monkeypatch, capsys):
    """``draftforge ... >&-`` (or a service manager without a standard output): Python sets
    ``sys.stdout`` to None and ``print`` writes nothing. The flush added after the command to
    find a closed pipe raised AttributeError there: a finished command ended in a traceback
    and exit status 1."""
    from draftforge import cli

    def handler(argv):
        print("what the command says")  # nothing, without a standard output
        return 0

    monkeypatch.setattr(cli, "_load", lambda name: handler)
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["train", "recipes/tiny-debug.yaml", "--dry-run"]) == 0


def test_a_command_run_with_fd_1_closed_exits_0():
    """The same as a real process: file descriptor 1 closed before the interpreter starts."""
    proc = subprocess.run(
        [sys.executable, "-m", "draftforge", "train", "recipes/tiny-debug.yaml", "--dry-run"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=120,
        preexec_fn=lambda: os.close(1),  # noqa: PLW1509 - only closes this child's stdout
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_tau_sampled_with_an_end_of_sequence_id_beyond_the_vocabulary():
    """An end-of-sequence id the target's logits have no column for (a tokenizer with more tokens
    than the model has embedding rows) can be neither drawn nor accepted: tau_sampled is what it
    was without it. Leaving an accepted end of sequence out of tau_sampled indexed the
    probabilities with it: IndexError after every prompt had been decoded."""
    import torch

    from draftforge.eval.estimate import sampled_acceptance

    generator = torch.Generator().manual_seed(0)
    draft, target = torch.randn(3, 10, generator=generator), torch.randn(3, 10, generator=generator)
    for rule in ("sample", "greedy"):
        plain = sampled_acceptance(draft, target, temperature=1.0, draft_sampling=rule)
        beyond = sampled_acceptance(draft, target, temperature=1.0, draft_sampling=rule, eos_token_ids=(12,))
        assert torch.equal(beyond, plain)
    eos = int(draft.argmax(-1)[0])  # an id inside the vocabulary still counts nothing
    assert sampled_acceptance(draft, target, temperature=1.0, draft_sampling="greedy", eos_token_ids=(eos, 12))[0] == 0


def test_compare_runs_the_default_draws_on_any_workload_and_bounds_only_more(tmp_path, capsys, monkeypatch):
    """The --draws bound refused the default 10,000 draws on a workload of more than 10,000
    prompts, although draftforge eval had run that very bootstrap for the report. A bound
    lowered to 1,000 stands in for a workload of 100,000 prompts (the real one would take GBs)."""
    from test_eval_r14 import _report

    from draftforge.cli import main
    from draftforge.eval import compare

    monkeypatch.setattr(compare, "MAX_RESAMPLED", 1_000)
    report = _report(tmp_path / "a", [4, 3, 5, 2, 6])
    assert main(["eval", "compare", str(report)]) == 0  # 10,000 draws x 5 prompts > 1,000
    assert capsys.readouterr().out.splitlines()[-1].startswith("diff_macro=0.2500")
    assert main(["eval", "compare", str(report), "--draws", "20000"]) == 2
    assert capsys.readouterr().err.strip().endswith("give at most 10,000 draws (the default is 10,000)")
