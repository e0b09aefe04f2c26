"""`draftforge eval llamacpp` refuses a folder with Python code of its own unless the recipe
trusts it.

A security review found llama.cpp's converter loads some architectures' tokenizers with
``trust_remote_code=True`` (Qwen-v1, ChatGLM, InternLM2, some StableLM): a target folder whose
tokenizer_config.json named a local tokenization_*.py had that file run, with the recipe's
``target.trust_remote_code`` off, before draftforge's own loader saw the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftforge.errors import InputError
from draftforge.eval import llamacpp, llamacpp_check

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"


class _Reached(Exception):
    """Raised where the check would fetch llama.cpp: the folders were accepted."""


@pytest.fixture
def setup(tmp_path, monkeypatch):
    from eval_helpers import draft_config

    from draftforge.train.export import export_draft
    from draftforge.train.model import DSparkDraft

    export = export_draft(DSparkDraft(draft_config()), tmp_path / "export", progress=lambda _: None)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["QWenLMHeadModel"]}))
    monkeypatch.setattr(llamacpp_check, "_target_folder", lambda cfg: target)

    def reached(cache_dir):
        raise _Reached

    monkeypatch.setattr(llamacpp, "fetch_source", reached)
    return export, target


def test_a_target_folder_with_its_own_code_is_refused_before_anything_runs(setup):
    export, target = setup
    with pytest.raises(_Reached):  # a folder of data only is taken
        llamacpp_check.main([str(export), "--recipe", str(RECIPE)])
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.QWenTokenizer", None]}}))
    (target / "tokenization_evil.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(InputError, match=(
            rf"the target folder {target} ships Python code of its own \(tokenization_evil\.py, "
            r"auto_map in tokenizer_config\.json\), which llama\.cpp's converter may run .*"
            r"only when the recipe sets target\.trust_remote_code: true")):
        llamacpp_check.main([str(export), "--recipe", str(RECIPE)])
    (target / "tokenization_evil.py").unlink()
    with pytest.raises(InputError, match=r"\(auto_map in tokenizer_config\.json\)"):
        llamacpp_check.main([str(export), "--recipe", str(RECIPE)])


def test_a_draft_folder_with_code_is_refused_and_a_trusting_recipe_takes_both(setup, tmp_path):
    export, target = setup
    (export / "modeling_dspark.py").write_text("")
    with pytest.raises(InputError, match=rf"the draft folder {export} ships Python code of its own "
                                         r"\(modeling_dspark\.py\)"):
        llamacpp_check.main([str(export), "--recipe", str(RECIPE)])
    (target / "tokenization_evil.py").write_text("")
    trusting = tmp_path / "trusting.yaml"
    trusting.write_text(RECIPE.read_text().replace("target:\n", "target:\n  trust_remote_code: true\n", 1))
    with pytest.raises(_Reached):
        llamacpp_check.main([str(export), "--recipe", str(trusting)])


def test_a_target_folder_of_pickled_weights_is_refused_before_the_converter_reads_them(tmp_path):
    """llama.cpp's converter reads a folder's .bin weights (unpickling them) where it has no
    safetensors; draftforge loads safetensors only, and now says so before converting."""
    from types import SimpleNamespace

    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(InputError, match=r"has no \*\.safetensors file: it holds only pickled weights "
                                         r"\(pytorch_model\.bin\); draftforge loads safetensors only"):
        llamacpp_check._target_folder(SimpleNamespace(model=str(folder), cache_dir=None))
    (folder / "model.safetensors").write_bytes(b"")
    assert llamacpp_check._target_folder(SimpleNamespace(model=str(folder), cache_dir=None)) == folder
