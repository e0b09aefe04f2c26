"""Review round 57 of the export and the demo's use of it.

* The demo stamped its export folder with a digest it took itself, under the export lock, once
  ``draftforge export`` had released it: an export into the same folder completing in between was
  recorded as the demo's. The export now prints ``export_files=<digest>`` of the folder it wrote,
  taken under its own lock; the demo records that, refuses a folder that no longer holds it, and
  holds the export lock while its evaluation reads the folder.
* ``--max-shard-size-mb`` counted MiB (2^20 bytes) where huggingface_hub and transformers count
  an "MB" as 10^6 bytes.
* ``--eval-report`` put any report's table into the model card: one whose report.json measured
  another draft (or an earlier checkpoint) is refused, naming the file and its draft_fingerprint.
* The fingerprint of ``fc.weight`` alone is the same for drafts that differ in their other
  tensors: ``draft_fingerprint`` covers every tensor, and export takes it in a report.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from dspark_helpers import tiny_draft
from safetensors.torch import load_file, save_file
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_stages, demo_state
from draftforge.train import export


def _files_digest(folder: Path) -> str:
    """What the demo records of an export folder, computed here: each file but README.md in name
    order, its name and the sha256 of its bytes, hashed together."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != "README.md"):
        digest.update(path.name.encode() + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _checkpoint(folder: Path, model) -> Path:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "draft_config.json").write_text(json.dumps(asdict(model.config)))
    return folder


# 1. the demo's export stamp -------------------------------------------------------------------


def test_export_prints_the_digest_of_the_folder_it_wrote_even_once_replaced(tmp_path, monkeypatch, capsys):
    """Another export completes into the same folder as soon as this one releases the lock: the
    export's export_files= line still gives the digest of what this export wrote."""
    from draftforge.train.export_cli import main

    checkpoint = _checkpoint(tmp_path / "ckpt", tiny_draft(seed=1))
    out = tmp_path / "out"
    ours: list[str] = []
    real_lock = export.export_lock

    @contextlib.contextmanager
    def lock_then_other_export(path, **kwargs):
        with real_lock(path, **kwargs) as locked:
            yield locked
        if not ours:  # this export's lock released: its folder, then another export into it
            ours.append(_files_digest(out))
            monkeypatch.setattr(export, "export_lock", real_lock)
            export.export_draft(tiny_draft(seed=2), out, progress=lambda _: None)

    monkeypatch.setattr(export, "export_lock", lock_then_other_export)
    assert main([str(checkpoint), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    reported = [line.split("=", 1)[1] for line in lines if line.startswith("export_files=")]
    assert reported == ours, lines
    assert _files_digest(out) != ours[0]  # the folder holds the other export now
    assert lines[-1] == f"export_dir={out}"  # still the last line


def test_run_stage_returns_the_stages_output_lines(tmp_path, monkeypatch, capsys):
    script = "print('export: a -> b'); print('export_files=abc'); print('export_dir=/x')"
    monkeypatch.setattr(demo_stages, "draftforge_command", lambda *args: [sys.executable, "-c", script])
    assert demo_stages.run_stage("export", ["export"], indent=True) == [
        "export: a -> b", "export_files=abc", "export_dir=/x"]
    assert "    export_files=abc" in capsys.readouterr().out


class _Stop(Exception):
    """Raised where the test has seen what it tests."""


def _demo(tmp_path, monkeypatch, export_stage):
    """A demo whose trainings are finished, its export stage ``export_stage(paths)`` (which returns
    the stage's output lines), its evaluations not yet run."""
    recipe = tiny_recipe(tmp_path, steps=4)
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    _finished_run(paths.run_dir, cfg.to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())

    def run_stage(name, args, **kw):
        assert name == "export", name
        return export_stage(paths)

    monkeypatch.setattr(demo, "run_stage", run_stage)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)
    return recipe, paths, paths.run_dir / demo_state.EXPORT_STAMP


def _demo_export(paths, seed: int = 1) -> list[str]:
    """``draftforge export``'s lines for an export of tiny_draft(seed) into the demo's folder."""
    written: list[str] = []
    export.export_draft(tiny_draft(seed=seed), paths.export_dir, progress=lambda _: None,
                        published=written.append)
    return ["export: ...", f"export_files={written[0]}", f"export_dir={paths.export_dir}"]


def _main(recipe) -> int | None:
    code = None
    with contextlib.suppress(_Stop):
        code = demo.main([str(recipe), "--skip-train"])
    return code


def test_an_export_completing_after_the_demos_is_not_stamped_as_the_demos(tmp_path, monkeypatch, capsys):
    """The demo's export finished and released its lock; another export into the folder then
    completed before the demo took the lock to stamp it: the stamp recorded the other export."""
    def export_stage(paths):
        lines = _demo_export(paths, seed=1)
        export.export_draft(tiny_draft(seed=2), paths.export_dir, progress=lambda _: None)  # the other one
        return lines

    recipe, paths, stamp = _demo(tmp_path, monkeypatch, export_stage)
    monkeypatch.setattr(demo, "run_side_by_side", lambda *a, **kw: pytest.fail("the other export was evaluated"))
    assert _main(recipe) == 2
    err = capsys.readouterr().err
    assert (f"{paths.export_dir} no longer holds the export the demo's export stage wrote: another "
            "'draftforge export' into it replaced it since") in err, err
    assert not stamp.exists()  # a rerun exports again


def test_the_stamp_records_the_digest_the_export_reported(tmp_path, monkeypatch):
    recipe, paths, stamp = _demo(tmp_path, monkeypatch, _demo_export)

    def stop(*a, **kw):
        raise _Stop

    monkeypatch.setattr(demo, "run_side_by_side", stop)
    assert _main(recipe) is None
    recorded = json.loads(stamp.read_text())
    assert recorded["files"] == _files_digest(paths.export_dir)
    assert recorded["command"][:2] == ["export", str(paths.run_dir)]


def test_an_export_stage_that_reports_no_digest_is_a_failure(tmp_path, monkeypatch, capsys):
    def export_stage(paths):
        _demo_export(paths)
        return ["export: ...", f"export_dir={paths.export_dir}"]

    recipe, paths, stamp = _demo(tmp_path, monkeypatch, export_stage)
    assert _main(recipe) == 1
    assert "the export stage printed no export_files= line" in capsys.readouterr().err
    assert not stamp.exists()


def test_the_evaluation_reads_the_export_under_its_lock(tmp_path, monkeypatch):
    """The evaluation read the export folder unlocked: an export could replace it meanwhile."""
    recipe, paths, _ = _demo(tmp_path, monkeypatch, _demo_export)
    refused = []

    def run_side_by_side(jobs, log_dir, *, parallel):
        assert "eval-dspark" in jobs
        try:  # another 'draftforge export' into the folder, now
            export.export_draft(tiny_draft(seed=2), paths.export_dir, progress=lambda _: None)
        except export.ExportError as err:
            refused.append(str(err))
        raise _Stop

    monkeypatch.setattr(demo, "run_side_by_side", run_side_by_side)
    assert _main(recipe) is None
    assert len(refused) == 1 and refused[0].startswith("another draftforge export or demo (process "), refused
    weights = load_file(str(paths.export_dir / "model.safetensors"))
    assert torch.equal(weights["fc.weight"], tiny_draft(seed=1).state_dict()["fc.weight"])


def test_an_export_replaced_after_the_stamp_is_not_evaluated(tmp_path, monkeypatch, capsys):
    """Another export replaced the stamped folder between the export stage and the evaluation."""
    recipe, paths, stamp = _demo(tmp_path, monkeypatch, _demo_export)
    real = demo.evaluation_commands

    def evaluation_commands(*args, **kwargs):  # after the stamp, before the evaluation reads it
        export.export_draft(tiny_draft(seed=2), paths.export_dir, progress=lambda _: None)
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "evaluation_commands", evaluation_commands)
    monkeypatch.setattr(demo, "run_side_by_side", lambda *a, **kw: pytest.fail("the other export was evaluated"))
    assert _main(recipe) == 2
    assert f"{paths.export_dir} no longer holds the export the demo's export stage wrote" in capsys.readouterr().err
    assert json.loads(stamp.read_text())["files"] != _files_digest(paths.export_dir)


# 2. megabytes ---------------------------------------------------------------------------------


def _shards(folder: Path) -> list[list[str]]:
    files = sorted(folder.glob("*.safetensors"))
    return [sorted(load_file(str(path))) for path in files]


@pytest.mark.parametrize("mb,sizes", [
    (1, [125_000, 125_000]),  # 1,000,000 bytes: exactly 1 MB, one shard
    (1, [125_000, 125_001]),  # 4 bytes over: two (under 1 MiB, which the limit was)
    (1, [100_000, 150_000, 12_000]),  # 1,048,000 bytes: two shards, one of MiB
    (0.5, [62_500, 62_500, 1]),  # 500,004 bytes: two shards of 500,000 and 4, one of 0.5 MiB
    (0.5, [62_500, 62_500, 62_500, 62_500]),  # 1,000,000 bytes: two shards of exactly 0.5 MB
    (2, [262_144, 262_144]),  # 2 MiB in all: one shard of 2 MiB, two of 2 MB
])  # fmt: skip
def test_shards_split_at_huggingface_hubs_megabytes(tmp_path, mb, sizes):
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int

    state = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}  # float32, names in order
    files = export.write_safetensors(state, tmp_path, max_shard_size_mb=mb)
    limit = parse_size_to_int(f"{mb}MB")
    split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    expected = sorted(sorted(names) for names in split.filename_to_tensors.values())
    assert sorted(_shards(tmp_path)) == expected
    assert (len(files) > 1) == split.is_sharded
    if len(files) > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == 4 * sum(sizes)


def test_the_export_option_says_megabytes_of_ten_to_the_six_bytes():
    from draftforge.train.export_cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "megabytes of 10^6 bytes" in text


# 3. --eval-report measured another draft ----------------------------------------------------


def _fc_fingerprint(path: Path) -> str:
    """What draftforge eval recorded as draft_fingerprint before it hashed every tensor: the
    sha256 of ``fc.weight`` alone, computed here."""
    fc = load_file(str(path))["fc.weight"]
    return f"{fc.dtype}:{hashlib.sha256(fc.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}"


def _recorded(path: Path) -> str:
    """What draftforge eval records of a checkpoint or export as draft_fingerprint."""
    return export.draft_fingerprint(load_file(str(path)))


def _eval_report(folder: Path, **written) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.md").write_text("| workload | dspark AL |\n| gsm8k | 4.99 |\n")
    if written:
        (folder / "report.json").write_text(json.dumps(written))
    return folder / "report.md"


def _export(tmp_path, report: Path):
    from draftforge.cli import main

    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        _checkpoint(checkpoint, tiny_draft(seed=1))
    return main(["export", str(checkpoint), "--out", str(tmp_path / "out"), "--eval-report", str(report)])


def test_an_eval_report_of_another_draft_is_refused_naming_file_and_key(tmp_path, capsys):
    other = _checkpoint(tmp_path / "other", tiny_draft(seed=2))
    report = _eval_report(tmp_path / "eval", draft="/runs/other", draft_path="/runs/other",
                          draft_fingerprint=_recorded(other / "model.safetensors"))
    assert _export(tmp_path, report) == 2
    err = capsys.readouterr().err
    assert (f"--eval-report {report}: {tmp_path / 'eval' / 'report.json'} has draft_fingerprint "
            f"{_recorded(other / 'model.safetensors')}, the weights of another draft than") in err, err
    assert "/runs/other" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_eval_report_of_this_draft_goes_into_the_card(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path / "ckpt", tiny_draft(seed=1))
    report = _eval_report(tmp_path / "eval", draft=str(checkpoint),
                          draft_fingerprint=_recorded(checkpoint / "model.safetensors"))
    assert _export(tmp_path, report) == 0
    assert "| gsm8k | 4.99 |" in (tmp_path / "out" / "README.md").read_text()


def test_a_report_recording_fc_weight_alone_no_longer_identifies_the_draft(tmp_path, capsys):
    """Evaluations before draft_fingerprint recorded a hash of fc.weight alone, which drafts
    sharing it share: such a report is refused, even of this very draft."""
    checkpoint = _checkpoint(tmp_path / "ckpt", tiny_draft(seed=1))
    old = _fc_fingerprint(checkpoint / "model.safetensors")
    report = _eval_report(tmp_path / "eval", draft=str(checkpoint), draft_fingerprint=old)
    assert _export(tmp_path, report) == 2
    assert f"has draft_fingerprint {old}, the weights of another draft than" in capsys.readouterr().err


@pytest.mark.parametrize("written,why", [
    ("{not json", "is not readable JSON"),
    (json.dumps({"draft": "/runs/x"}), "records no draft_fingerprint"),
    (json.dumps(["a list"]), "records no draft_fingerprint"),
])  # fmt: skip
def test_an_eval_report_json_without_a_fingerprint_is_refused(tmp_path, capsys, written, why):
    report = _eval_report(tmp_path / "eval")
    (tmp_path / "eval" / "report.json").write_text(written)
    assert _export(tmp_path, report) == 2
    err = capsys.readouterr().err
    assert f"--eval-report {report}: {tmp_path / 'eval' / 'report.json'} {why}" in err, err
    assert not (tmp_path / "out").exists()


# 4. a fingerprint of every tensor -----------------------------------------------------------


def _same_fc_other_layer():
    ours = {k: v.clone() for k, v in tiny_draft(seed=1).state_dict().items()}
    other = {k: v.clone() for k, v in ours.items()}
    other["layers.0.mlp.up_proj.weight"][0, 0] += 1.0
    return ours, other


def test_drafts_sharing_fc_weight_have_other_draft_fingerprints():
    ours, other = _same_fc_other_layer()
    assert torch.equal(ours["fc.weight"], other["fc.weight"])
    assert export.draft_fingerprint(ours) != export.draft_fingerprint(other)
    head = {k: v.clone() for k, v in ours.items()}
    head["markov_head.markov_w1.weight"][3, 0] *= -1
    assert export.draft_fingerprint(head) != export.draft_fingerprint(ours)
    # the target's embedding copies are not the draft's: with or without them, the same
    trained = {k: v for k, v in ours.items() if k not in export.EMBEDDING_KEYS}
    assert export.draft_fingerprint(trained) == export.draft_fingerprint(ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mb", [4096, 0.01])
def test_the_draft_fingerprint_survives_an_export_and_its_reading(tmp_path, dtype, mb):
    model = tiny_draft(seed=1, dtype=dtype)
    out = export.export_draft(model, tmp_path / "out", max_shard_size_mb=mb, progress=lambda _: None)
    read: dict[str, torch.Tensor] = {}
    for path in out.glob("*.safetensors"):
        read.update(load_file(str(path)))
    assert (len(list(out.glob("*.safetensors"))) > 1) == (mb < 1)
    assert export.draft_fingerprint(read) == export.draft_fingerprint(model.state_dict())
    assert export.draft_fingerprint(read).startswith("tensors:")


def test_an_eval_report_of_a_draft_sharing_only_fc_weight_is_refused(tmp_path, capsys):
    ours, other = _same_fc_other_layer()
    model = tiny_draft(seed=1)
    _checkpoint(tmp_path / "ckpt", model)
    report = _eval_report(tmp_path / "eval", draft="/runs/other", draft_fingerprint=export.draft_fingerprint(other))
    assert _export(tmp_path, report) == 2
    assert "draft_fingerprint tensors:" in capsys.readouterr().err
    (tmp_path / "eval" / "report.json").write_text(json.dumps({"draft": "x", "draft_fingerprint":
                                                               export.draft_fingerprint(ours)}))
    assert _export(tmp_path, report) == 0
    assert "| gsm8k | 4.99 |" in (tmp_path / "out" / "README.md").read_text()


def test_export_digest_is_the_digest_computed_here(tmp_path):
    out = export.export_draft(tiny_draft(seed=1), tmp_path / "out", max_shard_size_mb=0.01, progress=lambda _: None)
    assert export.export_digest(out) == _files_digest(out) == demo_state.export_files(out)
    (out / "README.md").write_text("another card")  # the card is not digested
    assert export.export_digest(out) == _files_digest(out)


def test_draftforge_evals_report_of_an_export_goes_into_its_checkpoints_card(tmp_path, capsys):
    """The demo's last stage: the checkpoint exported again with --eval-report of the evaluation
    of its export; the report.json that 'draftforge eval' writes is accepted, for this draft only."""
    from eval_helpers import random_prompts, tiny_eval_draft

    from draftforge.cli import main
    from draftforge.splitserve.target import build_target

    tiny_debug = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    recipe_path = tmp_path / "tiny-debug-512.yaml"
    recipe_path.write_text(tiny_debug.read_text().replace("vocab_size: 49152", "vocab_size: 512"))
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    ours = _checkpoint(tmp_path / "ckpt", tiny_eval_draft(target, seed=0))
    other = _checkpoint(tmp_path / "other", tiny_eval_draft(target, seed=1))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}) + "\n")
    assert main(["export", str(ours), "--out", str(tmp_path / "export")]) == 0
    assert main(["eval", str(tmp_path / "export"), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "4", "--baselines", "none", "--no-estimate",
                 "--out", str(tmp_path / "eval")]) == 0  # fmt: skip
    capsys.readouterr()
    report = tmp_path / "eval" / "report.md"
    assert main(["export", str(other), "--out", str(tmp_path / "out2"), "--eval-report", str(report)]) == 2
    assert f"{tmp_path / 'eval' / 'report.json'} has draft_fingerprint" in capsys.readouterr().err
    assert main(["export", str(ours), "--out", str(tmp_path / "export"), "--eval-report", str(report)]) == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert report.read_text().strip() in card and "Not measured" not in card


def test_an_eval_report_of_the_export_of_unsorted_layers_is_this_drafts(tmp_path, capsys):
    """Layer ids [4, 0, 2] are exported ascending with fc.weight's column blocks permuted: an
    evaluation of the export records the fingerprint of its tensors, the permuted fc.weight's among them,
    which is still this checkpoint's draft."""
    model = tiny_draft(seed=1, target_layer_ids=[4, 0, 2])
    checkpoint = _checkpoint(tmp_path / "ckpt", model)
    out = export.export_draft(model, tmp_path / "export", progress=lambda _: None)
    exported = load_file(str(out / "model.safetensors"))
    assert not torch.equal(exported["fc.weight"], model.state_dict()["fc.weight"])
    report = _eval_report(tmp_path / "eval", draft=str(out), draft_fingerprint=export.draft_fingerprint(exported))
    assert _export(tmp_path, report) == 0, capsys.readouterr().err
    assert "| gsm8k | 4.99 |" in (tmp_path / "out" / "README.md").read_text()
    assert checkpoint.is_dir()
