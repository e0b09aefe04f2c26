"""Session 52: I/O failures found by injecting them (a full disk at one write)."""

from __future__ import annotations

import errno
import tempfile

import pytest
from test_eval_cli import recipe_path  # noqa: F401 - the fixture
from test_evalreport_r36 import _workload

from draftforge import files
from draftforge.eval.report import write_report


def _full_disk_at(monkeypatch, name: str) -> None:
    """The temporary file of any write of ``name`` cannot be made: the disk is full."""
    real = tempfile.mkstemp

    def mkstemp(*args, prefix="", **kwargs):
        if prefix.startswith(f".{name}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)


def test_a_report_json_that_cannot_be_written_leaves_the_earlier_report_whole(tmp_path, monkeypatch):
    """report.md and the plots were replaced before report.json failed: the folder held the new
    evaluation's table beside the old one's report.json, which export took for the new one's."""
    out = tmp_path / "eval"
    write_report([_workload()], out, {"command": "first"}, block_size=4)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert set(before) == {"report.md", "report.json", "acceptance_length.png", "position_acceptance.png"}
    _full_disk_at(monkeypatch, "report.json")
    with pytest.raises(OSError, match="No space left on device") as failed:
        write_report([_workload()], out, {"command": "second"}, block_size=4)
    assert failed.value.filename == str(out / "report.json")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # nothing new, no temporary


def test_write_atomic_all_replaces_nothing_when_one_file_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "a").write_text("old a")
    _full_disk_at(monkeypatch, "b")
    with pytest.raises(OSError) as failed:
        files.write_atomic_all([(tmp_path / "a", "new a"), (tmp_path / "b", "new b")])
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and (tmp_path / "a").read_text() == "old a"
    monkeypatch.undo()
    files.write_atomic_all([(tmp_path / "a", "new a"), (tmp_path / "b", "new b")])
    assert [(tmp_path / n).read_text() for n in "ab"] == ["new a", "new b"]


def test_export_takes_a_report_md_only_beside_the_report_json_written_with_it(tmp_path, capsys):
    """An evaluation stopped between replacing report.md and report.json left a new table beside
    the old report.json, whose draft and weights export compared, and the card showed it.
    report.json records its report.md's digest; a plain copy (new file times) still passes."""
    import json
    import shutil

    from eval_helpers import tiny_eval_draft, tiny_target
    from test_export import _write_checkpoint
    from test_export_r52 import checkpoint_fingerprint

    from draftforge.cli import main
    from draftforge.eval.report import text_digest

    run = tmp_path / "run"
    folder = run / "checkpoints" / "step_00000002"
    _write_checkpoint(folder, tiny_eval_draft(tiny_target()))
    (folder / "trainer_state.json").write_text("{}")
    (folder / "COMPLETE").touch()
    (run / "eval").mkdir()
    table = "| workload | AL |\n|---|---|\n| w | 1.50 |\n"
    (run / "eval" / "report.md").write_text(table)
    (run / "eval" / "report.json").write_text(json.dumps(
        {"draft_path": str(run), "draft_fingerprint": checkpoint_fingerprint(folder),
         "report_md_sha256": text_digest(table)}))
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)  # new file times, in any order
    (copy / "eval" / "report.json").write_text((run / "eval" / "report.json").read_text().replace(str(run), str(copy)))
    assert main(["export", str(copy), "--out", str(tmp_path / "out1")]) == 0
    assert "| w | 1.50 |" in (tmp_path / "out1" / "README.md").read_text()
    (run / "eval" / "report.md").write_text(table.replace("1.50", "9.99"))  # another evaluation's table
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "out2")]) == 0
    assert "is not the table report.json was written with" in capsys.readouterr().out
    assert "9.99" not in (tmp_path / "out2" / "README.md").read_text()


def test_a_report_json_records_its_report_mds_digest(tmp_path):
    import json

    from draftforge.eval.report import text_digest

    write_report([_workload()], tmp_path, {"command": "c"}, block_size=4)
    recorded = json.loads((tmp_path / "report.json").read_text())["report_md_sha256"]
    assert recorded == text_digest((tmp_path / "report.md").read_text())


def test_a_calibration_file_that_cannot_be_written_keeps_the_evaluation(recipe_path, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A full disk at --calibrate's file failed the command before the report was written:
    minutes of decoding lost, though --out may be on another disk."""
    import json

    from eval_helpers import random_prompts
    from test_cli_r15 import _run
    from test_eval_cli import _tiny_export_and_prompts

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n" for ids in random_prompts(4)))
    out, cal = tmp_path / "r", tmp_path / "cal.json"
    _full_disk_at(monkeypatch, "cal.json")
    code, _, err = _run(["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                         "--max-new-tokens", "12", "--baselines", "none", "--no-estimate", "--out", str(out),
                         "--calibrate", str(cal)], capsys)  # fmt: skip
    assert code == 2 and not cal.exists()
    assert f"--calibrate {cal}: could not be written (No space left on device)" in err
    calibration = json.loads((out / "report.json").read_text())["calibration"]
    assert calibration["write_error"] == "No space left on device" and len(calibration["temperatures"]) == 4
    assert f"Confidence calibration fitted, but `{cal}` could not be written" in (out / "report.md").read_text()


class _FullLog:
    """A log file on a full disk: its first write fails."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        pass


def test_a_log_that_cannot_be_written_does_not_hang_the_demos_evaluations(tmp_path, monkeypatch, capsys):
    """The thread copying an evaluation's output to its log died at the first failed write and
    stopped reading the pipe: the evaluation then blocked on it for good, and so did the demo."""
    import sys
    import threading

    from draftforge.eval import demo_stages

    script = "import sys\nfor i in range(20000): print('line %05d ' % i + 'x' * 60)\nprint('last line')"
    monkeypatch.setattr(demo_stages, "draftforge_command", lambda *args: [sys.executable, "-c", script])
    monkeypatch.setattr(demo_stages, "open", lambda path, mode, **kwargs: _FullLog(), raising=False)
    done = threading.Event()
    runner = threading.Thread(target=lambda: (demo_stages.run_side_by_side(
        {"a": ["eval"], "b": ["eval"]}, tmp_path / "logs", parallel=True), done.set()), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert done.is_set(), "the demo hung on an evaluation whose output nobody read"
    out = capsys.readouterr().out
    for label in "ab":
        assert f"[{label}] warning: cannot write its log {tmp_path / 'logs' / (label + '.log')} (No space left" in out
        assert f"[{label}] last line" in out and f"[{label}] line 19999" in out


def test_a_file_where_the_checkpoints_go_is_refused_before_the_run_starts(tmp_path, capsys):
    """A file at train.output_dir/checkpoints was found at the first checkpoint, a whole
    checkpoint_interval of training later, with advice to free disk space."""
    from splitserve_helpers import tiny_recipe
    from test_cli_r15 import _run

    recipe = tiny_recipe(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a folder")
    code, _, err = _run(["train", str(recipe), "--dry-run"], capsys)
    assert code == 2
    assert (f"train.output_dir: {tmp_path / 'run' / 'checkpoints'}, where the run saves its checkpoints, "
            "is a file; move it away") in err


def test_a_full_disk_at_the_metrics_or_accounting_log_names_the_file(tmp_path, monkeypatch):
    """Both logs are appended with a plain open: a full disk's OSError named no file, and the
    trainer's message said only "writing a file (train.output_dir is ...)"."""
    from trainer_helpers import train_config

    from draftforge.splitserve import accounting
    from draftforge.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, train=train_config(str(tmp_path)), recipe_yaml=None)
    log._file.close()
    log._file = _FullLog()
    with pytest.raises(OSError) as failed:
        log.log({"step": 1, "loss": 1.0})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "metrics.jsonl")

    books = accounting.ConsumerAccounting(world=2, num_target=1, tensor_parallel=1, credits=4, num_sources=1,
                                          path=tmp_path / "accounting.jsonl")
    books.begin(0)
    monkeypatch.setattr(accounting, "open", lambda *args, **kwargs: _FullLog(), raising=False)
    monkeypatch.setattr(_FullLog, "__enter__", lambda self: self, raising=False)
    monkeypatch.setattr(_FullLog, "__exit__", lambda self, *exc: None, raising=False)
    with pytest.raises(OSError) as failed:
        books.write("summary", 0)
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "accounting.jsonl")


def test_a_summary_rebuilt_from_the_log_keeps_the_runs_throughput(tmp_path, capsys):
    """A run stopped (a full disk at summary.json) after its last checkpoint: the rerun rebuilt the
    summary from the logged steps with 0 tokens in 0.002 s and 0 tokens/s."""
    import json

    from test_train_r51 import three_step_trainer

    run = tmp_path / "run"
    trainer, batches = three_step_trainer(run)
    trainer.fit(batches)
    first = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    again, _ = three_step_trainer(run)
    again.resume()
    again.fit(batches)
    rebuilt = json.loads((run / "summary.json").read_text())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rebuilt["tokens"] == sum(r["tokens"] for r in logged) == first["tokens"] > 0
    assert rebuilt["compute_s"] == pytest.approx(sum(r["compute_s"] for r in logged))
    assert rebuilt["tokens_s"] == pytest.approx(rebuilt["tokens"] / (rebuilt["compute_s"] + rebuilt["wait_s"]))
    assert rebuilt["rebuilt_from"] == "metrics.jsonl" and rebuilt["steps_this_run"] == 0
    assert (rebuilt["loss"], rebuilt["tau"]) == (first["loss"], first["tau"])
    assert "(rebuilt from metrics.jsonl: every logged step's" in capsys.readouterr().out


def test_samples_of_a_last_step_that_cannot_be_filled_are_counted(tmp_path, capsys):
    """With the data exhausted inside a step (here grad_accum 2, three micro-batches), the samples
    taken for it were dropped without a word: the run said 0 samples dropped."""
    import json

    from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

    from draftforge.train.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(model_config=tiny_model_config(), embeddings=target_embeddings(), run_dir=run,
                      train=train_config(str(run), steps=10, grad_accum=2, log_interval=1))
    samples = chain_samples(3)
    result = trainer.fit([[samples[0]], [samples[1]], [samples[2]]])
    assert (result.stopped_reason, result.steps_run, result.untrained) == ("data_exhausted", 1, 1)
    assert json.loads((run / "summary.json").read_text())["untrained_at_end"] == 1
    assert ("stop: data_exhausted (1 samples taken for a last step that no trainer rank could fill "
            "were not trained") in capsys.readouterr().out
    trained = [i for line in (run / "metrics.jsonl").read_text().splitlines() for i in json.loads(line)["sample_ids"]]
    assert trained == [samples[0].sample_id, samples[1].sample_id]


def test_a_cpu_target_ranks_estimate_covers_what_its_process_holds(tmp_path):
    """The dry run counted a CPU rank's tensors only: recipes/tiny-debug.yaml's target was
    estimated at 0.036 GiB and held 0.45 GiB (Python, torch, transformers, the tokenizer)."""
    import subprocess
    import sys
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import target_estimate

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    script = (
        "import sys, torch.distributed\n"
        "import draftforge.splitserve.roles, draftforge.train.trainer\n"
        "from draftforge.config import load_recipe\n"
        "from draftforge.splitserve.target import build_target, load_tokenizer\n"
        "cfg = load_recipe(sys.argv[1])\n"
        "load_tokenizer(cfg.target)\n"
        "build_target(cfg.target, cfg.draft.target_layer_ids)\n"
        "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
    )
    held = int(subprocess.run([sys.executable, "-c", script, str(recipe)], capture_output=True, text=True,
                              check=True).stdout.split()[-1]) * 1024
    estimate = target_estimate(load_recipe(recipe)).total
    assert estimate >= held, (estimate / 2**30, held / 2**30)


def test_an_interval_whose_target_reports_span_a_sliver_of_it_gives_no_target_figures(monkeypatch):
    """Samples of one chunk, computed before an interval and sent in it, carried headers spanning
    0.3 s of a 12.8 s interval: the line gave that sliver's shares as the interval's
    ("target busy 41% idle 55% 0 tok/s (capacity 0)")."""
    from test_accounting_r50 import first_interval

    acc, clock = first_interval(monkeypatch)
    acc.line()
    acc.on_producer_stats(0, {"busy_s": 8.12, "idle_s": 2.17, "tokens": 500, "wall_s": 10.3})  # sends only
    clock[0] = 22.8
    acc.on_step({"sample_ids": [], "compute_s": 10.0, "wait_s": 2.8})
    line = acc.line()
    assert "target: its reports span 0.3 s of this interval's 12.8 s (samples computed before it), no figures" in line
    assert "target busy" not in line
    acc.on_producer_stats(0, {"busy_s": 16.0, "idle_s": 4.0, "tokens": 1500, "wall_s": 20.3})
    clock[0] = 32.8
    acc.on_step({"sample_ids": [], "compute_s": 5.0, "wait_s": 5.0})
    assert "target busy 79% idle 18% 100 tok/s" in acc.line()  # a report spanning the interval


def test_a_log_on_a_full_disk_fails_at_the_line_concerned_which_is_then_shown(tmp_path, monkeypatch, capsys):
    """The log was block-buffered: a full disk surfaced at a later flush or at close, and the
    lines in the lost buffer (the report's, kept off the terminal) were shown nowhere."""
    import os
    import sys

    from draftforge.eval import demo_stages

    script = "print('Command: `draftforge eval`')\nprint('| w | dspark | 1.23 |')\nprint('eval: report in r')"
    monkeypatch.setattr(demo_stages, "draftforge_command", lambda *args: [sys.executable, "-c", script])
    (tmp_path / "logs").mkdir()
    os.symlink("/dev/full", tmp_path / "logs" / "a.log")  # every write fails: ENOSPC
    demo_stages.run_side_by_side({"a": ["eval"]}, tmp_path / "logs", parallel=False)
    out = capsys.readouterr().out
    warning = out.index("[a] warning: cannot write its log")
    assert warning < out.index("[a] | w | dspark | 1.23 |")


def test_a_gloo_target_is_planned_on_the_cpu_whatever_train_device_says():
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import target_estimate

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    cfg = load_recipe(recipe, ["split.comm_backend=gloo", "train.device=cuda", "target.dtype=bfloat16"])
    names = [name for name, _ in target_estimate(cfg).items]
    assert any(name.startswith("the process:") for name in names)
    assert "packed copy of the linear weights (bf16 on a CPU, at most)" in names


def test_an_os_error_without_errno_is_raised_as_it_is_not_as_its_own_cause(tmp_path, monkeypatch):
    def replace(src, dst):
        raise OSError("no errno")

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(OSError, match="no errno") as failed:
        files.write_atomic(tmp_path / "a", "x")
    assert failed.value.__cause__ is not failed.value and failed.value.errno is None
    assert list(tmp_path.iterdir()) == []


_SIGNAL_DURING = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background suite hands SIGINT ignored
import {module} as patched
real = patched.{function}
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.{signal})
    return real(*args, **kwargs)
patched.{function} = interrupted
from draftforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _signal_during(module: str, function: str, argv: list[str], signal_name: str = "SIGTERM"):
    import subprocess
    import sys

    script = _SIGNAL_DURING.format(module=module, function=function, signal=signal_name)
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)


_STATUS = {"SIGTERM": 143, "SIGINT": 130}


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_eval_saying_what_was_kept(recipe_path, tmp_path, signal_name):  # noqa: F811
    """eval installed no SIGTERM handler: a scheduler's stop killed it with no word, leaving the
    --out lock and, while the report was written, a temporary file no later run removes. Ctrl-C
    printed only 'draftforge: interrupted', where SIGTERM says what was kept."""
    from test_eval_cli import _tiny_export_and_prompts

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    out = tmp_path / "r"
    done = _signal_during("draftforge.eval.harness", "run_workload", [
        "eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
        "--max-new-tokens", "6", "--baselines", "none", "--no-estimate", "--out", str(out)], signal_name)
    assert done.returncode == _STATUS[signal_name], (done.returncode, done.stderr[-2000:])
    assert (f"draftforge eval: stopped on {signal_name}; the report is written only when the evaluation "
            "finishes") in done.stderr
    assert not (tmp_path / ".r.eval.lock").exists() and not (out / "report.json").exists()


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_export_while_it_reads_the_checkpoint(tmp_path, signal_name):
    """export handled SIGTERM only while writing: one during the checkpoint's read killed it
    without a word, where the README promises it stops as Ctrl-C does (exit 143); Ctrl-C
    printed only 'draftforge: interrupted'."""
    from eval_helpers import tiny_eval_draft, tiny_target
    from test_export import _write_checkpoint

    _write_checkpoint(tmp_path / "ckpt", tiny_eval_draft(tiny_target()))
    done = _signal_during("draftforge.train.export", "load_training_checkpoint",
                          ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")], signal_name)
    assert done.returncode == _STATUS[signal_name], (done.returncode, done.stderr[-2000:])
    assert f"draftforge export: stopped on {signal_name}; no partial folder was left" in done.stderr
    assert not (tmp_path / "out").exists()


def test_an_evaluation_interrupted_while_writing_keeps_the_earlier_report_and_calibration(recipe_path, tmp_path, monkeypatch):  # noqa: F811
    """The calibration JSON was written before the report: Ctrl-C while the report was written
    left the new calibration beside the old report, which describes another one."""
    import json

    from eval_helpers import random_prompts
    from test_eval_cli import _tiny_export_and_prompts

    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n" for ids in random_prompts(4)))
    out, cal = tmp_path / "r", tmp_path / "cal.json"

    def evaluate(tokens: int):
        return main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                     "--max-new-tokens", str(tokens), "--baselines", "none", "--no-estimate", "--out", str(out),
                     "--calibrate", str(cal)])  # fmt: skip

    assert evaluate(6) == 0
    before = {"cal": cal.read_bytes(), "report": (out / "report.json").read_bytes()}
    real = tempfile.mkstemp

    def interrupted(*args, prefix="", **kwargs):
        if prefix.startswith(".report.json."):
            raise KeyboardInterrupt
        return real(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(files.tempfile, "mkstemp", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate(12)
    assert {"cal": cal.read_bytes(), "report": (out / "report.json").read_bytes()} == before
    assert not [p for p in [*tmp_path.iterdir(), *out.iterdir()] if p.name.endswith(".tmp")]


def test_a_killed_writers_temporaries_are_removed_by_the_next_run_holding_the_lock(recipe_path, tmp_path, monkeypatch):  # noqa: F811
    """A SIGKILL between writing a temporary file and renaming it left ``.NAME.*.tmp`` for good
    beside the answers file (2.4 MB) or in an eval's --out; the next run (holding the lock that
    keeps other writers away) removes them."""
    import json

    from test_eval_cli import _tiny_export_and_prompts

    from draftforge.eval.cli import main

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    out = tmp_path / "r"
    out.mkdir()
    stale = [out / ".report.json.k2j3k2j3.tmp", out / ".acceptance_length.png.x9x9x9x9.tmp"]
    kept = out / ".notes.tmp"  # not a temporary of the report's files
    for path in [*stale, kept]:
        path.write_text("left by a killed run")
    assert main([str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "6", "--baselines", "none", "--no-estimate", "--out", str(out)]) == 0
    assert not any(p.exists() for p in stale) and kept.exists()
    assert json.loads((out / "report.json").read_text())["settings"]["max_new_tokens"] == 6

    answers = tmp_path / "ans.jsonl"
    leftovers = [tmp_path / ".ans.jsonl.a1a1a1a1.tmp", tmp_path / ".ans.jsonl.partial.b2b2b2b2.tmp"]
    for path in leftovers:
        path.write_text("x" * 100)
    from draftforge.data import regenerate

    seen = []

    def answering(prompts, engine, settings, out, **kwargs):  # what runs under the lock
        seen.append([p.exists() for p in leftovers])
        return "answered"

    monkeypatch.setattr(regenerate, "_regenerate", answering)
    assert regenerate.regenerate([], None, None, answers) == "answered"
    assert seen == [[False, False]]  # removed before the answering started
