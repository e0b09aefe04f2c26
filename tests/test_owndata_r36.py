"""Review round 36, a user's own data files: a file saved as UTF-16 (PowerShell), files joined
with ``cat`` whose second one starts with a byte-order mark, an empty file listed beside
others, an overlap hit in a long conversation that does not say which turn, and Ctrl-C during
``draftforge data regenerate`` that does not say the answers so far are kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from regenerate_helpers import FakeEngine  # noqa: E402

from draftforge.data.config import DataConfig  # noqa: E402
from draftforge.data.formats import DataFormatError  # noqa: E402
from draftforge.data.loading import (  # noqa: E402
    load_conversations,
    load_prompts,
    load_training_conversations,
)
from draftforge.data.overlap import OverlapError  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _row(ident: str) -> dict:
    return {"id": ident, "messages": [{"role": "user", "content": f"Say something about {ident}."},
                                      {"role": "assistant", "content": f"Here is something about {ident}."}]}


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_a_file_saved_as_utf16_is_refused_as_such_not_row_by_row(tmp_path, encoding, name):
    """PowerShell 5's ``>`` writes UTF-16 with a byte-order mark: every line failed as a row of
    its own ("invalid UTF-8 at column 1", then "invalid JSON"), and with data.skip_invalid every
    row was skipped as malformed; the file is refused once, naming its encoding."""
    path = tmp_path / name
    bom = {"utf-16": "", "utf-16-be": "\ufeff", "utf-32": ""}[encoding]  # -be writes no BOM itself
    text = _jsonl([_row("a"), _row("b")]) if name.endswith("l") else json.dumps([_row("a")])
    path.write_bytes((bom + text.replace("\n", "\r\n")).encode(encoding))
    wanted = "UTF-32" if encoding == "utf-32" else "UTF-16"
    for skip in (False, True):
        with pytest.raises(DataFormatError, match=rf"^{path}: the file is encoded in {wanted} .*save it as UTF-8"):
            load_conversations([str(path)], skip_invalid=skip)
    # UTF-8, with or without its byte-order mark, is read as before
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert load_conversations([str(path)]).conversations[0].id == "a"


def test_files_joined_with_cat_keep_the_second_files_byte_order_mark_line(tmp_path):
    """``cat a.jsonl b.jsonl`` of two files saved by a Windows editor puts b's byte-order mark at
    the start of a middle line: line 1's was accepted, that one failed as "invalid JSON:
    Expecting value (column 1)" for a character no editor shows."""
    path = tmp_path / "joined.jsonl"
    bom = b"\xef\xbb\xbf"
    path.write_bytes(bom + _jsonl([_row("a")]).encode() + bom + _jsonl([_row("b"), _row("c")]).encode())
    result = load_conversations([str(path)])
    assert [c.id for c in result.conversations] == ["a", "b", "c"] and not result.skipped


def test_an_empty_file_beside_others_is_refused_naming_it(tmp_path):
    """An empty file listed beside others (emptied by a failed export, or the wrong file named)
    added no rows without a word; it is refused, naming it. Alone, it is still "no prompts"."""
    good = tmp_path / "good.jsonl"
    good.write_text(_jsonl([_row("a")]))
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \r\n\n"), ("empty.json", "[]")):
        empty = tmp_path / name
        empty.write_text(text)
        for files in ([good, empty], [empty, good]):
            with pytest.raises(DataFormatError, match=rf"^{empty}: holds no rows .*remove it from data.train_files"):
                load_conversations([str(f) for f in files], skip_invalid=True)
        assert load_conversations([str(empty)]).conversations == []  # alone: the callers' message
    # a limit met by the first file takes no row further, but an empty file after it is still
    # refused (session 56): a larger limit would read it
    empty = tmp_path / "empty.jsonl"
    with pytest.raises(DataFormatError, match=rf"^{empty}: holds no rows"):
        load_conversations([str(good), str(empty)], limit=1)
    other = tmp_path / "other.jsonl"
    other.write_text(_jsonl([_row("b")]))
    assert [c.id for c in load_conversations([str(good), str(other)], limit=1).conversations] == ["a"]


def test_an_overlap_hit_names_the_turn_of_a_long_conversation(tmp_path):
    """A 20-turn conversation with one copied MT-Bench question was named by its line only;
    the hit now says which user turn, system prompt or assistant turn it is."""
    from draftforge.data.workloads import load_workload

    mt, gsm = load_workload("mtbench")[3], load_workload("gsm8k")[9]
    long = []
    for i in range(10):
        long += [{"role": "user", "content": mt.text if i == 6 else f"Question {i} on topic {i * 7}?"},
                 {"role": "assistant", "content": gsm.text if i == 2 else f"Answer {i} here."}]
    rows = [
        {"id": "long", "messages": long},
        {"id": "sys", "system": mt.text, "messages": [{"role": "user", "content": "Hello there."},
                                                     {"role": "assistant", "content": "Hi."}]},
        {"id": "two", "messages": [{"role": "user", "content": "Tell me a story."},
                                   {"role": "assistant", "content": "Once upon a time."},
                                   {"role": "user", "content": "More."},
                                   {"role": "assistant", "content": gsm.text}]},
        {"id": "one", "prompt": "  " + mt.text},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text(_jsonl(rows))
    with pytest.raises(OverlapError) as err:
        load_prompts(DataConfig(train_files=[str(path)]), progress=False)
    where = {h.train_id: h.where for h in err.value.hits}
    assert where == {"long": f"{path}, line 1, user turn 7", "sys": f"{path}, line 2, system prompt",
                     "one": f"{path}, line 4"}, where
    assert f"training 'long' ({path}, line 1, user turn 7) ~ eval '{mt.id}'" in str(err.value)
    path.write_text(_jsonl(rows[:3]))  # the replies, trained as they are, are checked too
    with pytest.raises(OverlapError) as err:
        load_training_conversations(DataConfig(train_files=[str(path)], regenerate=False), tmp_path)
    where = {h.train_id: h.where for h in err.value.hits}
    assert where["two"] == f"{path}, line 3, assistant turn 2"


def test_ctrl_c_during_regeneration_says_the_answers_are_kept(tmp_path, monkeypatch, capsys):
    """SIGTERM printed "stopped on SIGTERM; rerun the same command to continue", Ctrl-C only
    "draftforge: interrupted", though the answers so far are kept in the same way."""
    import draftforge.splitserve.target as target_module
    from draftforge.data import regenerate as regen_module

    class StoppedEngine(FakeEngine):
        def generate(self, conversations, settings):
            if self.calls:
                raise KeyboardInterrupt
            return super().generate(conversations, settings)

    monkeypatch.setattr(target_module, "build_target", lambda *a, **k: StoppedEngine())
    args = [str(RECIPE), f"train.output_dir={tmp_path}", "data.num_samples=6",
            "target.generation.batch_size=2", "--no-progress", "--workers", "1"]
    with pytest.raises(KeyboardInterrupt):
        regen_module.main(args)
    err = capsys.readouterr().err
    assert err.count("draftforge data regenerate: stopped on SIGINT; rerun the same command to continue") == 1
    partial = tmp_path / "regenerated.jsonl.partial"
    assert len(partial.read_text().splitlines()) == 2  # the first batch, whole
    monkeypatch.setattr(target_module, "build_target", lambda *a, **k: FakeEngine())
    assert regen_module.main(args) == 0
    assert len((tmp_path / "regenerated.jsonl").read_text().splitlines()) == 6
