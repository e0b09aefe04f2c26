"""Review round 56: the demo's export stamp is read under the lock ``draftforge export`` holds
while it writes the folder (it was read unlocked, so a concurrent export could change the folder
as it was read: the stamp then described a folder the demo never wrote), and ``draftforge eval``
refuses an --out with a dangling symbolic link anywhere on its path, as ``draftforge export``
does (it checked only --out itself, in its own words)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from eval_helpers import random_prompts, tiny_eval_draft
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_state
from draftforge.files import exclusive_lock, replace_dir
from draftforge.train import export

TINY_DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _write_export(folder: Path, weights: bytes) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)


def _digest(folder: Path) -> str:
    """What draftforge export prints of the folder it wrote (export.export_digest), computed here."""
    import hashlib

    return hashlib.sha256(b"".join(
        path.name.encode() + hashlib.sha256(path.read_bytes()).digest()
        for path in sorted(folder.iterdir()) if path.is_file() and path.name != "README.md")).hexdigest()


class _Stop(Exception):
    """Raised where the demo would go on to evaluate: the export stage is what is tested."""


def _demo_at_its_export_stage(tmp_path, monkeypatch, export_stage):
    """The demo's paths and stamp, its trainings finished, its export stage run by
    ``export_stage(paths)`` instead of ``draftforge export``; it stops before evaluating."""
    recipe = tiny_recipe(tmp_path, steps=4)
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    _finished_run(paths.run_dir, cfg.to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: False)

    def run_stage(name, args, **kw):
        assert name == "export", name
        return export_stage(paths)

    def stop(*a, **kw):
        raise _Stop

    monkeypatch.setattr(demo, "run_stage", run_stage)
    monkeypatch.setattr(demo, "evaluation_commands", stop)
    return recipe, paths, paths.run_dir / demo_state.EXPORT_STAMP


def test_the_stamp_is_not_taken_of_a_folder_another_export_is_replacing(tmp_path, monkeypatch, capsys):
    """The demo's export finished; another 'draftforge export' into the same folder then held
    the export lock and had moved the demo's export aside (between replace_dir's two renames).
    The stamp read the folder anyway: the digest of no files, recorded as the demo's export."""
    held = contextlib.ExitStack()

    def export_stage(paths):
        _write_export(paths.export_dir, b"the demo's weights")
        digest = _digest(paths.export_dir)  # as draftforge export prints it
        out = paths.export_dir.resolve()
        held.enter_context(exclusive_lock(out.parent / f".{out.name}.lock"))  # the other export's
        aside = out.parent / f".{out.name}.old-x"
        aside.mkdir()
        out.rename(aside / out.name)
        return [f"export_files={digest}"]

    recipe, paths, stamp = _demo_at_its_export_stage(tmp_path, monkeypatch, export_stage)
    with held:
        assert demo.main([str(recipe), "--skip-train"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"another draftforge export or demo \(process \d+\) holds {re.escape(str(paths.export_dir))} "
                     r"now \(writing it, or reading it for its evaluation\); wait for it to finish, then rerun "
                     r"the demo", err), err
    assert not stamp.exists()  # a rerun exports again


def test_a_concurrent_export_cannot_replace_the_folder_while_the_stamp_reads_it(tmp_path, monkeypatch):
    """Another 'draftforge export' (its lock and replace_dir, as export_draft writes) started as
    the stamp read the demo's export: the folder was replaced midway, and the stamp held a digest
    of neither export, or of the other one, under the demo's command."""
    attempts = []
    real_open = Path.open

    def other_export(out: Path) -> None:
        try:
            with export.export_lock(out):
                staging = out.parent / f".{out.name}.tmp-x"
                _write_export(staging, b"another export's weights")
                replace_dir(staging, out)
            attempts.append("replaced")
        except export.ExportError as err:
            attempts.append(str(err))

    def export_stage(paths):
        _write_export(paths.export_dir, b"the demo's weights")
        digest = _digest(paths.export_dir)  # as draftforge export prints it

        def opening(path, *args, **kwargs):  # the stamp's first file read: the other export starts
            if path.parent == paths.export_dir and not attempts:
                other_export(paths.export_dir.resolve())
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(Path, "open", opening)
        return [f"export_files={digest}"]

    recipe, paths, stamp = _demo_at_its_export_stage(tmp_path, monkeypatch, export_stage)
    with contextlib.suppress(_Stop):
        demo.main([str(recipe), "--skip-train"])
    monkeypatch.undo()
    assert len(attempts) == 1 and attempts[0].startswith("another draftforge export or demo (process "), attempts
    assert (paths.export_dir / "model.safetensors").read_bytes() == b"the demo's weights"
    recorded = json.loads(stamp.read_text())
    assert recorded["files"] == demo_state.export_files(paths.export_dir)
    # the digest is the demo's export's: the same files elsewhere give it
    copy = tmp_path / "copy" / "export"
    shutil.copytree(paths.export_dir, copy)
    assert recorded["files"] == demo_state.export_files(copy)


def _tiny_export_and_prompts(tmp_path: Path):
    from draftforge.splitserve.target import build_target

    recipe_path = tmp_path / "tiny-debug-512.yaml"
    recipe_path.write_text(re.sub(r"vocab_size: 49152.*", "vocab_size: 512", TINY_DEBUG.read_text()))
    recipe = load_recipe(recipe_path)
    target = build_target(recipe.target, recipe.draft.target_layer_ids)
    export_dir = export.export_draft(tiny_eval_draft(target), tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}))
    return recipe_path, export_dir, prompts


def test_eval_refuses_an_out_under_a_dangling_link_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """--out under a symbolic link to nothing passed eval's check (only --out itself was looked
    at) and failed as the report's lock was made beside it: "LINK: File exists", naming neither
    --out nor the dangling link."""
    import draftforge.splitserve.target as target_module
    from draftforge.cli import main

    recipe_path, export_dir, prompts = _tiny_export_and_prompts(tmp_path)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --out was checked")

    monkeypatch.setattr(target_module, "build_target", no_target)
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone" / "zz")
    base = ["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
            "--max-new-tokens", "4"]
    for out, where in ((link / "report", f"is under {link},"), (link, "is")):
        assert main([*base, "--out", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert (f"draftforge eval: error: --out {out}: {where} a symbolic link to nothing "
                f"({tmp_path / 'gone' / 'zz'}); give a folder") in err, err
    assert not (tmp_path / "gone").exists()


def test_eval_refuses_a_calibrate_path_under_a_dangling_link_before_the_target_loads(tmp_path, monkeypatch, capsys):
    import draftforge.splitserve.target as target_module
    from draftforge.cli import main

    recipe_path, export_dir, prompts = _tiny_export_and_prompts(tmp_path)
    prompts.write_text("".join(json.dumps({"workload": "w", "input_ids": ids}) + "\n"
                               for ids in random_prompts(2)))  # calibration holds one out

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --calibrate was checked")

    monkeypatch.setattr(target_module, "build_target", no_target)
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone" / "zz")
    calibrate = link / "cal.json"
    code = main(["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                 "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--calibrate", str(calibrate)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"draftforge eval: error: --calibrate {calibrate}: is under {link}, a symbolic link to nothing "
            f"({tmp_path / 'gone' / 'zz'}); give the path of the JSON file to write") in err, err
    assert not (tmp_path / "gone").exists()
