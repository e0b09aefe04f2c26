"""The benchmarks' refusals and failure messages: exit status 2 naming the option, and a
failed objective path that says what ended it."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.errors import InputError
from draftforge.train import bench_objective
from draftforge.train import bench_train as bt


def test_bench_train_on_cuda_without_a_gpu_exits_2_naming_the_option(monkeypatch, capsys):
    """It exited with status 1 (a bare SystemExit) where a wrong option exits 2."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "train", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge bench train: error: device 'cuda' (--device")
    assert "use --device cpu" in err


def test_bench_train_refuses_a_sequence_that_holds_no_anchor(capsys):
    """--seq 1 has no position p with p and p + 1 supervised: the step trained nothing and the
    bench printed train_mfu=0.000 step_tokens_s=0.0 with status 0."""
    with pytest.raises(SystemExit) as exit_info:
        bt._parser().parse_args(["--seq", "1"])
    assert exit_info.value.code == 2
    assert "argument --seq: must be at least 2" in capsys.readouterr().err
    # 2 tokens, no unsupervised prompt at that length: exactly one anchor, at position 0
    args = bt._parser().parse_args(["--seq", "2", "--device", "cpu"])
    cfg, _ = bt._model_config(args)
    (sample,) = bt._synthetic_samples(cfg, args, torch.Generator().manual_seed(0))
    assert sample.loss_mask.tolist() == [True, True]


def _objective_children(monkeypatch, outcomes: dict[str, tuple[int, str]]):
    """Run bench objective with each path's child replaced by ``(returncode, stderr)``."""

    def run(cmd, **_):
        path = cmd[cmd.index("--path") + 1]
        code, stderr = outcomes[path]
        stdout = json.dumps({"peak_added_gib": 1.0, "cached_gib": 0.25, "baseline_gib": 0.5, "seconds": 2.0, "loss": 3.0})
        return subprocess.CompletedProcess(cmd, code, stdout if code == 0 else "", stderr)

    monkeypatch.setattr(bench_objective.subprocess, "run", run)


def test_a_path_killed_by_a_signal_says_so(monkeypatch, capsys):
    """The out-of-memory killer's SIGKILL leaves no output: it read 'failed (exit -9): '."""
    _objective_children(monkeypatch, {"chunked": (0, ""), "unchunked": (-9, "")})
    assert bench_objective.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "  unchunked: failed (killed by SIGKILL (out of memory?))" in out
    assert out[-1] == "objective_peak_gib=1.00 unchunked_peak_gib=nan objective_kept_gib=0.25 unchunked_kept_gib=nan"


def test_a_path_that_exits_with_an_error_shows_its_last_lines(monkeypatch, capsys):
    trace = "Traceback (most recent call last):\n  File x\n\nRuntimeError: boom\n"
    _objective_children(monkeypatch, {"chunked": (1, trace), "unchunked": (-15, "")})
    assert bench_objective.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "  chunked: failed (exit 1: File x | RuntimeError: boom)" in out  # its last 3 lines
    assert "  unchunked: failed (killed by SIGTERM)" in out


@pytest.mark.parametrize("argv, named", [
    (["--layers", "1,29"], "--model smollm2-135m-instruct --layers 1,29: target_layer_ids contains 29"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model --layers 1,14,27: target.model"),
])
def test_bench_target_load_errors_name_the_options(argv, named):
    """The target's refusal named the recipe keys (target_layer_ids, target.model) that a
    bench target user never wrote; it now says which options set them."""
    from draftforge.splitserve.bench_target import main

    before = torch.get_num_threads()
    try:
        with pytest.raises(InputError) as info:
            main([*argv, "--dtypes", "float32"])
    finally:
        torch.set_num_threads(before)
    assert str(info.value).startswith(named)
