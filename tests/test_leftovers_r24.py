"""Leftovers of earlier review rounds, fixed in session 38.

- ``draftforge eval llamacpp --work-dir``: two checks of other exports sharing one work folder
  converted into the same fixed names (``draft-f32.gguf``), so one replaced the other's draft and
  could check the wrong one.
"""

from __future__ import annotations

import types
from pathlib import Path

from draftforge.eval import llamacpp, llamacpp_check


def _stub_check(monkeypatch, tmp_path):
    """Everything around the conversions stubbed; returns the (draft, GGUF content) each check read."""
    import draftforge.config as config
    import draftforge.train.hf_load as hf_load

    class Target:
        def model_copy(self, update):
            return self

    monkeypatch.setattr(hf_load, "read_serving_config", lambda folder: {})
    monkeypatch.setattr(hf_load, "config_from_serving",
                        lambda raw, where: types.SimpleNamespace(enable_confidence_head=False))
    monkeypatch.setattr(llamacpp_check, "_check_llamacpp_can_run", lambda folder, raw: None)
    monkeypatch.setattr(config, "load_recipe", lambda path: types.SimpleNamespace(target=Target()))
    monkeypatch.setattr(llamacpp_check, "_target_folder", lambda cfg: tmp_path / "target")

    def convert(source, model_dir, out_file, *, target_dir=None):
        Path(out_file).write_text(f"converted {model_dir}")
        return Path(out_file)

    read = []

    def check_all(args, target_cfg, draft_cfg, draft_dir, bin_dir, target_gguf, draft_gguf):
        read.append((draft_dir, draft_gguf))
        return []

    monkeypatch.setattr(llamacpp, "convert", convert)
    monkeypatch.setattr(llamacpp_check, "_check_all", check_all)
    return read


def test_llamacpp_checks_of_two_exports_sharing_a_work_dir_keep_their_own_gguf(monkeypatch, tmp_path, capsys):
    read = _stub_check(monkeypatch, tmp_path)
    source = tmp_path / "llama.cpp"
    for path in (source / llamacpp.CONVERTER, source / "build" / "bin" / llamacpp.TOOL,
                 source / "build" / "bin" / llamacpp.TOKENIZER, tmp_path / "a" / "export" / "config.json",
                 tmp_path / "b" / "export" / "config.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    work = tmp_path / "work"
    work.mkdir()
    for name in ("a", "b"):
        argv = [str(tmp_path / name / "export"), "--recipe", "unread.yaml", "--llama-cpp", str(source),
                "--work-dir", str(work)]
        assert llamacpp_check.main(argv) == 0
    (a_dir, a_gguf), (b_dir, b_gguf) = read
    assert a_gguf != b_gguf  # both folders are called "export"
    # the first check's draft is still there, as converted from its own export
    assert a_gguf.read_text() == f"converted {a_dir}" and b_gguf.read_text() == f"converted {b_dir}"
    targets = sorted(p.name for p in work.glob("target-*"))
    assert len(targets) == 1 and targets[0].startswith("target-target-")  # one target, shared
    assert f"kept {work}" in capsys.readouterr().out
