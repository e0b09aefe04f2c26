"""Round 56 of regeneration:

- a larger run's interrupted ``<out>.partial`` serves a smaller ``data.num_samples`` as the
  larger run's finished file does: its rows of this run's prompts are used (the missing ones
  answered), ``<out>`` is written with this run's rows, and the ``.partial`` stays for the larger
  run, which continues it to the file an uninterrupted run writes;
- in native bf16 the default ``--threads`` of a run continuing a file is the count recorded in
  it, since the count otherwise follows the number of batches: growing ``data.num_samples``
  with default options is not refused; an explicit other ``--threads`` still is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, Interrupted, make_prompts

from draftforge.data.regenerate import RegenerationError, check_answers, regenerate


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_a_larger_runs_partial_answering_this_runs_prompts_is_used_and_left_for_it(tmp_path, capsys):
    reference = tmp_path / "reference.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, reference, progress=False)
    out = tmp_path / "answers.jsonl"
    partial = out.with_name(out.name + ".partial")
    with pytest.raises(Interrupted):  # batches of 3: p00-p05 written, then stopped
        regenerate(make_prompts(11), FakeEngine(fail_on_call=5), SETTINGS, out, progress=False)
    leftover = partial.read_bytes()
    assert len(lines_of(partial)) == 6 and not out.exists()
    engine = FakeEngine()
    report = regenerate(make_prompts(4), engine, SETTINGS, out, progress=False)
    assert (report.num_reused, report.num_generated) == (4, 0) and engine.calls == []
    # the larger run's rows of this run's prompts, as its finished file would hold them
    assert lines_of(out) == lines_of(reference)[:4]
    check_answers(out, make_prompts(4), SETTINGS, "fake-target")
    assert partial.read_bytes() == leftover  # left for the larger run
    assert f"{partial.name}, which also answers 2 other prompts, is left" in capsys.readouterr().err
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, out, progress=False)
    assert out.read_bytes() == reference.read_bytes() and not partial.exists()


def test_a_larger_runs_partial_lacking_some_of_this_runs_prompts_is_continued(tmp_path):
    reference = tmp_path / "reference.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, reference, progress=False)
    smaller = tmp_path / "smaller.jsonl"
    regenerate(make_prompts(5), FakeEngine(), SETTINGS, smaller, progress=False)
    rows = lines_of(reference)
    out = tmp_path / "answers.jsonl"
    partial = out.with_name(out.name + ".partial")
    # a larger run's workers finished batches 2 and 0, not batch 1 (p03-p05)
    partial.write_bytes(b"".join(rows[6:9] + rows[0:3]))
    engine = FakeEngine()
    report = regenerate(make_prompts(5), engine, SETTINGS, out, progress=False)
    assert (report.num_reused, report.num_generated) == (3, 2)
    assert out.read_bytes() == smaller.read_bytes()  # as an uninterrupted run of 5 writes it
    held = {json.loads(line)["id"] for line in lines_of(partial)}  # the larger run's rows, and ours
    assert held == {f"p{i:02d}" for i in range(9)} - {"p05"}
    # the larger run continues: this run's short batch (p03, p04) is answered again in its own
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, out, progress=False)
    assert out.read_bytes() == reference.read_bytes() and not partial.exists()


def test_a_partials_other_rows_with_other_settings_are_refused(tmp_path):
    reference = tmp_path / "reference.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, reference, progress=False)
    rows = [json.loads(line) for line in lines_of(reference)]
    rows[7]["generation"]["temperature"] = 0.0
    partial = tmp_path / "answers.jsonl.partial"
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows[:9]))
    with pytest.raises(RegenerationError, match=r"answers.jsonl.partial, line 8 \(id 'p07'\) was "
                       r"written with other target.generation settings \(temperature: file 0.0"):
        regenerate(make_prompts(5), FakeEngine(), SETTINGS, tmp_path / "answers.jsonl", progress=False)


class NamedEngine(FakeEngine):
    name = "random"  # the tiny recipe's target, as every row records it


class FakePool(NamedEngine):
    """The worker pool, answering in this process (no spawned targets)."""

    def __init__(self, build, workers, name, *, quiet=False):
        super().__init__()
        self.threads = build.args[0].num_threads


def test_growing_a_bf16_file_with_default_options_keeps_its_thread_count(tmp_path, monkeypatch, capsys):
    import draftforge.splitserve.target as target_module
    from draftforge.data import answer_workers
    from draftforge.data import regenerate as regen_module

    built = []
    monkeypatch.setattr(target_module, "build_target",
                        lambda cfg, layers, *, device, tensor_parallel: built.append(cfg.num_threads)
                        or NamedEngine())
    monkeypatch.setattr(answer_workers, "WorkerPool", FakePool)
    monkeypatch.setattr(regen_module, "usable_cores", lambda: 4)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    base = [str(recipe), f"train.output_dir={tmp_path}", "target.dtype=bfloat16",
            "target.generation.batch_size=4", "--no-progress"]
    out = tmp_path / "regenerated.jsonl"

    def threads_recorded() -> set[int]:
        return {json.loads(line)["arithmetic"]["threads"] for line in lines_of(out)}

    assert regen_module.main([*base, "data.num_samples=4"]) == 0  # one batch: 1 target of 4 threads
    assert threads_recorded() == {4} and built == [4]
    capsys.readouterr()
    # four batches would take 4 workers of 1 thread; the file's 4 threads are kept instead
    assert regen_module.main([*base, "data.num_samples=16"]) == 0
    assert threads_recorded() == {4} and built == [4, 4]
    err = capsys.readouterr().err
    assert f"4 thread(s) per target, as {out} was answered with (in bfloat16" in err
    assert "target on cpu, 4 thread(s)" in err
    # a --threads of the user's own that differs is refused, naming the file's count
    assert regen_module.main([*base, "data.num_samples=24", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "was answered with other arithmetic (threads: file 4, this run 1)" in err
    assert "rerun with --threads 4, or without --threads, to continue it" in err
    assert len(lines_of(out)) == 16


def test_worker_plan_shares_the_cores_at_the_recorded_thread_count():
    from draftforge.data.regenerate import worker_plan

    cpu = dict(device="cpu", backend="hf", cores=16, num_batches=40)
    assert worker_plan(None, None, **cpu) == (16, 1)  # a fresh run
    assert worker_plan(None, None, recorded=5, **cpu) == (3, 5)  # continuing a file of 5 threads
    assert worker_plan(2, None, recorded=5, **cpu) == (2, 5)
    assert worker_plan(None, 2, recorded=5, **cpu) == (16, 2)  # --threads 2: refused when continuing
    assert worker_plan(None, None, device="cpu", backend="sglang", cores=16, num_batches=9,
                       recorded=3) == (1, 3)
