"""Session 57: a plot retried keeps the summary's wall time, a stopped resume leaves a summary,
the split accounting says whose tokens it counts, and a line is one write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
WALL_TIME = ("steps_this_run", "tokens", "elapsed_s", "tokens_s", "wait_s", "compute_s")


def _trainer(run: Path, **settings) -> Trainer:
    return Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run,
                   train=train_config(str(run), resume="auto", **settings))


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- 1. the plot retried: summary.json removed as the advice says ------------------------------

def test_a_summary_removed_to_retry_its_plot_comes_back_with_its_wall_time(tmp_path, monkeypatch, capsys):
    """The plot could not be drawn (no_plot); the advice said to remove summary.json and rerun,
    and the rerun rebuilt it from metrics.jsonl: elapsed_s became the steps' waits and computing
    (the checkpoints between them left out), tokens/s with it, and 0 steps this run."""
    import draftforge.train.plots as plots

    real = plots.plot_slot_acceptance

    def broken(path, **kwargs):
        raise RuntimeError("no font cache")

    monkeypatch.setattr(plots, "plot_slot_acceptance", broken)
    run = tmp_path / "run"
    settings = dict(steps=4, log_interval=2, checkpoint_interval=1)
    batches = [[s] for s in chain_samples(4)]
    _trainer(run, **settings).fit(batches)
    original = _summary(run)
    assert original["no_plot"] == "RuntimeError: no font cache" and not (run / "slot_acceptance.png").exists()
    # the original's wall time holds the 3 checkpoints saved between steps: more than the steps' own
    logged = _logged(run)
    assert original["elapsed_s"] > sum(r["wait_s"] + r["compute_s"] for r in logged)
    warning = capsys.readouterr().out

    (run / "summary.json").unlink()
    monkeypatch.setattr(plots, "plot_slot_acceptance", real)
    again = _trainer(run, **settings)
    again.resume()
    assert again.fit(batches).steps_run == 0
    now = _summary(run)
    for key in WALL_TIME:
        assert now[key] == original[key], key
    assert "no_plot" not in now and "rebuilt_from" not in now
    assert {k: v for k, v in now.items()} == {k: v for k, v in original.items() if k != "no_plot"}
    assert (run / "slot_acceptance.png").read_bytes().startswith(b"\x89PNG")
    assert "summary.json written again from run.json" in capsys.readouterr().out
    assert "remove summary.json and rerun the same command (it comes back from run.json" in warning


def test_a_summary_kept_in_run_json_is_not_taken_for_another_state_of_the_run(tmp_path, monkeypatch):
    """run.json keeps every segment's summary; only one of the same step, train.steps and stop
    comes back: removed after an extension whose data ran out at once (4 of 8 steps,
    data_exhausted), the summary is the logged steps', not the finished 4-step run's."""
    import draftforge.train.plots as plots

    monkeypatch.setattr(plots, "plot_slot_acceptance", lambda path, **kwargs: (_ for _ in ()).throw(OSError("x")))
    run = tmp_path / "run"
    batches = [[s] for s in chain_samples(4)]
    _trainer(run, steps=4, checkpoint_interval=10).fit(batches)
    segments = json.loads((run / "run.json").read_text())["segments"]
    assert segments[0]["summary"]["steps_this_run"] == 4 and segments[0]["summary"]["no_plot"] == "OSError: x"
    (run / "summary.json").unlink()
    longer = _trainer(run, steps=8, checkpoint_interval=10)
    longer.resume()
    assert longer.fit([]).stopped_reason == "data_exhausted"
    now = _summary(run)
    assert (now["step"], now["total_steps"], now["steps_this_run"], now["rebuilt_from"]) == (4, 8, 0, "metrics.jsonl")
    assert now["tokens"] == sum(r["tokens"] for r in _logged(run))


# -- 2. a resumed segment stopped by a signal ---------------------------------------------------

class _Stop(KeyboardInterrupt):
    """As roles.Terminated (SIGTERM) is: a KeyboardInterrupt."""


def _stopping(batches, after: int, stop: type[BaseException]):
    """``batches``, then ``stop`` raised where the next one is taken (a signal while it waits)."""
    yield from batches[:after]
    raise stop


@pytest.mark.parametrize("stop", [KeyboardInterrupt, _Stop])
def test_a_resumed_segment_stopped_by_a_signal_leaves_a_summary_of_its_steps(tmp_path, stop, capsys):
    """Its first step removed the finished 2-step run's summary; Ctrl-C (or SIGTERM) at step 5
    left the folder with none until a later run ended."""
    run = tmp_path / "run"
    batches = [[s] for s in chain_samples(8)]
    _trainer(run, steps=2, checkpoint_interval=10).fit(batches[:2])
    assert _summary(run)["stopped_reason"] == "steps_done"
    longer = _trainer(run, steps=8, checkpoint_interval=10, log_interval=2)
    longer.resume()
    with pytest.raises(stop):
        longer.fit(_stopping(batches[2:], 3, stop))
    summary = _summary(run)
    logged = _logged(run)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    assert (summary["step"], summary["total_steps"], summary["steps_this_run"], summary["stopped_reason"]) == (
        5, 8, 3, "interrupted")
    # where a resume continues: the checkpoint the segment started from (none saved since)
    assert summary["checkpoint"] == str(ckpt.checkpoint_path(run, 2))
    assert summary["tokens"] == sum(r["tokens"] for r in logged[2:])
    assert summary["tau"] == pytest.approx((logged[3]["tau"] + logged[4]["tau"]) / 2)
    assert "stop: interrupted" in capsys.readouterr().out
    # the run folder's lock was let go: the next segment resumes and finishes the run
    last = _trainer(run, steps=8, checkpoint_interval=10, log_interval=2)
    last.resume()
    assert last.fit(batches[2:]).stopped_reason == "steps_done"
    assert (_summary(run)["step"], _summary(run)["stopped_reason"]) == (8, "steps_done")


# -- 3. the split accounting's trainer figures: one rank's, and all of theirs --------------------

def test_the_accounting_counts_all_trainers_tokens_beside_this_ranks(monkeypatch):
    """1 target, 2 trainers. This rank took and trained 2 samples (30 tokens); its steps trained
    70 tokens on both ranks (the step records' tokens, the training summary's). The accounting
    started at t=0 s, the training loop at t=1 s (the first step, 3 s of wait and compute, ended at
    4 s), the last step ended at 10 s: this rank 3 tok/s over its 10 s, all 70 tokens in the
    loop's 9 s as the summary counts them. One trainer's figures were printed unlabelled."""
    from draftforge.splitserve import accounting as A

    clock = [0.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    acc = A.ConsumerAccounting(world=3, num_target=1, credits=4)
    acc.on_take(1, 10, 0.0, sample_id="a")
    acc.on_take(1, 20, 0.0, sample_id="b")
    clock[0] = 4.0
    acc.on_step({"sample_ids": ["a", "x"], "tokens": 25, "compute_s": 2.5, "wait_s": 0.5})
    clock[0] = 10.0
    acc.on_step({"sample_ids": ["b", "y"], "tokens": 45, "compute_s": 5.0, "wait_s": 1.0})
    s = acc.snapshot()
    assert (s["consumer"]["tokens"], s["consumer"]["rate_tok_s"]) == (30, 3.0)
    # the interval line: both over this rank's 10 s (7.5 s computing, 1.5 s waiting, 1 s before the loop)
    assert ("trainer (this rank of 2) busy 75% idle 15% other 10% (checkpoints, logging) 3 tok/s "
            "(capacity 4), all 2 7 tok/s | ") in acc.line()
    text = acc.summary_text()
    assert "  trainer (this rank of 2): busy 75.0%  idle 15.0% other 10.0% (checkpoints, logging)  30 tokens  3 tok/s" in text
    assert ("  trainers (all 2, as the training summary counts them): 70 tokens  8 tok/s in the training "
            "loop's 9.0 s") in text
    assert acc.trainers() == {"ranks": 2, "tokens": 70, "rate_tok_s": 70 / 9, "wall_s": 9.0}


def test_two_trainers_accounting_and_summary_count_the_same_tokens(tmp_path):
    """A 3-process job (1 target, 2 trainers): the summary's tokens are both trainers', the split
    accounting's trainer line the first one's, both said; the all-trainers figure matches."""
    import re

    from splitserve_helpers import read_logs, spawn_ranks, tiny_recipe, wait_all

    recipe = tiny_recipe(tmp_path, trainers=2, steps=4, num_conversations=48)
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    assert wait_all(procs, 120) == [0, 0, 0], read_logs(tmp_path / "logs", 3)
    run, log = tmp_path / "run", read_logs(tmp_path / "logs", 3)[1]
    summary = _summary(run)
    logged = _logged(run)
    state = json.loads((ckpt.checkpoint_path(run, 4) / "trainer_state.json").read_text())
    mine, everyone = sum(state["consumed_tokens"][0]), sum(map(sum, state["consumed_tokens"]))
    assert summary["tokens"] == sum(r["tokens"] for r in logged) == everyone > mine > 0
    assert f"{everyone} tokens (all 2 trainer ranks) in " in log
    assert re.search(rf"trainer \(this rank of 2\): busy .* {mine} tokens ", log), log[-3000:]
    found = re.search(rf"trainers \(all 2, as the training summary counts them\): {everyone} tokens  (\d+) tok/s "
                      r"in the training loop's ([0-9.]+) s", log)
    assert found, log[-3000:]
    # the summary's tokens/s, over the same clock (give or take a step's bookkeeping)
    assert int(found.group(1)) == pytest.approx(summary["tokens_s"], rel=0.05, abs=2)
    assert float(found.group(2)) == pytest.approx(summary["elapsed_s"], rel=0.05, abs=0.05)
    record = [json.loads(line) for line in (run / "accounting.jsonl").open()][-1]
    assert (record["event"], record["consumer"]["tokens"]) == ("summary", mine)  # the first rank's, as said


# -- 4. a line and its newline in one write ------------------------------------------------------

class _Writes:
    """A text stream that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_every_line_a_rank_or_the_launcher_says_is_one_write(monkeypatch):
    """Under PYTHONUNBUFFERED print writes a line and its newline apart: a target rank's 'done'
    line and the trainer's 'finished' line, written at the same moment, came out on one line."""
    from draftforge.splitserve import supervisor
    from draftforge.train import metrics

    out, err = _Writes(), _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    metrics.say("[rank 0 target] done (serving, to the trainers' stop)")
    bar = metrics.Progress(total=2, initial=0)
    bar.update(loss=1.0, tau=1.5, tokens=10)
    bar.bar.refresh()  # drawn: in a log or a pipe, a line of its own
    metrics.say("[rank 1 trainer] split (last interval)")
    bar.write("step      1  loss 1.0")
    bar.close()
    with pytest.raises(KeyboardInterrupt), supervisor.unwinding_on_sigterm("draftforge train", "resume"):
        raise KeyboardInterrupt
    said = [w for w in err.writes if "[rank" in w or "stopped on" in w]
    assert said == ["[rank 0 target] done (serving, to the trainers' stop)\n",
                    "[rank 1 trainer] split (last interval)\n",
                    "draftforge train: stopped on SIGINT; resume\n"]
    assert "step      1  loss 1.0\n" in out.writes
    # every write a whole line (the bar's drawings too: another rank's line landed on their end)
    writes = [w for w in err.writes + out.writes if w]  # tqdm.write's empty end="" writes nothing
    assert all(w.endswith("\n") and "\r" not in w and w.strip() for w in writes), err.writes
    drawn = [w for w in err.writes if w.startswith("train:")]
    assert len(drawn) >= 2 and "1/2" in drawn[-2] and "loss=1.0000" in drawn[-1], drawn


_WRITER = """
import sys
from draftforge.train.metrics import say
for i in range(int(sys.argv[2])):
    say(f"[rank {sys.argv[1]} target] line {i} " + "x" * 60)
"""


def test_lines_of_ranks_sharing_a_pipe_are_never_joined(tmp_path):
    """Three processes say 1500 lines each into one pipe, unbuffered as a container sets them:
    every line arrives whole, on its own."""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), "1500"], stdout=write, stderr=write,
                              env=env, cwd=ROOT) for rank in range(3)]
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as pipe:
        lines = pipe.read().split("\n")
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    expected = {f"[rank {r} target] line {i} " + "x" * 60 for r in range(3) for i in range(1500)}
    assert lines[-1] == "" and sorted(lines[:-1]) == sorted(expected)
