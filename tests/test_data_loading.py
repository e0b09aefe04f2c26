"""Loading local data files: every supported file type, file-level errors, skip_invalid."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftforge.data.config import DataConfig
from draftforge.data.formats import DataFormatError
from draftforge.data.loading import (
    load_conversations,
    load_prompts,
    load_training_conversations,
    regenerated_path,
)

CHATS = [
    {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
        ],
    },
    {
        "conversations": [
            {"from": "human", "value": "Name a colour."},
            {"from": "gpt", "value": "Teal."},
        ]
    },
]


def jsonl_text(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet"])
def test_every_file_type_gives_the_same_conversations(tmp_path, suffix):
    path = tmp_path / f"chats{suffix}"
    if suffix == ".jsonl":
        path.write_text(jsonl_text(CHATS))
    elif suffix == ".jsonl.gz":
        with gzip.open(path, "wt") as handle:
            handle.write(jsonl_text(CHATS))
    elif suffix == ".json":
        path.write_text(json.dumps(CHATS))
    elif suffix == ".json.gz":
        with gzip.open(path, "wt") as handle:
            handle.write(json.dumps(CHATS))
    else:
        # One parquet table needs one schema: store both rows in OpenAI form.
        rows = [
            {"id": "c1", "messages": CHATS[0]["messages"]},
            {
                "id": None,
                "messages": [
                    {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Teal."},
                ],
            },
        ]
        pq.write_table(pa.Table.from_pylist(rows), path)
    result = load_conversations([str(path)], expect="conversation")
    assert [c.id for c in result.conversations] == ["c1", "chats-2"]
    assert result.conversations[1].messages == [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Teal."},
    ]
    unit = "line" if suffix.startswith(".jsonl") else "row"
    assert result.conversations[1].source == f"{path}, {unit} 2"
    assert result.skipped == []


def test_parquet_row_errors_name_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    rows = [{"prompt": "fine"}, {"prompt": ""}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value) == f"{path}, row 2: turn 1 (user) is empty"


def test_error_unsupported_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhello\n")
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value) == (
        f"{path}: unsupported file type .csv; supported: .jsonl, .jsonl.gz, .json, .json.gz, .parquet"
    )


def test_error_missing_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataFormatError) as err:
        load_conversations([missing])
    assert str(err.value) == f"data file not found: {missing}; check data.train_files"  # absolute: no cwd note


def test_error_unknown_builtin():
    with pytest.raises(
        DataFormatError,
        match=r"unknown builtin data set 'builtin:nope'; valid: builtin:train-prompts",
    ):
        load_conversations(["builtin:nope"])


def test_error_json_not_a_list_of_rows(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": CHATS}))
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value).startswith(
        f"{path}: a .json data file must hold a list of row objects, got dict"
    )


def test_error_json_syntax_names_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n {"prompt": "a"},\n {"prompt": }\n]')
    with pytest.raises(DataFormatError, match=r"d.json, line 3: invalid JSON"):
        load_conversations([str(path)])


def test_error_parquet_not_a_table(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value).startswith(f"{path}: not a readable parquet table of rows")


def test_malformed_parquet_prints_only_draftforges_error(tmp_path):
    # datasets logged "Failed to read schema from '...' with error ArrowInvalid: ..." to
    # stderr before draftforge's own message; the CLI's stderr must hold that one line only.
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "d.parquet"
    bad.write_bytes(b"PAR1 truncated, not a parquet table")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    run = subprocess.run(
        [sys.executable, "-m", "draftforge", "data", "regenerate", str(recipe),
         f"data.train_files=[{bad}]", f"train.output_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"draftforge data regenerate: {bad}: not a readable parquet table of rows "
        "(ArrowInvalid: Parquet magic bytes not found in footer. Either the file is corrupted "
        "or this is not a parquet file.)"
    ]


def test_parquet_bad_page_names_pyarrows_reason(tmp_path):
    # A readable footer over a corrupt page: datasets wraps pyarrow's reason in a generic
    # DatasetGenerationError ("An error occurred while generating the dataset").
    import logging

    import datasets

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"question {i}" for i in range(500)]}), path)
    data = bytearray(path.read_bytes())
    data[8:200] = b"\xff" * 192  # the first data page's header, after the 4-byte magic
    path.write_bytes(bytes(data))
    level, bars = logging.getLogger("datasets").level, datasets.are_progress_bars_disabled()
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    message = str(err.value)
    assert message.startswith(f"{path}: not a readable parquet table of rows (")
    assert "DatasetGenerationError" not in message and "\n" not in message
    # datasets' logging and progress bars are as they were
    assert logging.getLogger("datasets").level == level
    assert datasets.are_progress_bars_disabled() == bars


def test_error_duplicate_ids_across_files(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text(jsonl_text([{"id": "x", "prompt": "one"}]))
    b.write_text(jsonl_text([{"prompt": "two"}, {"id": "x", "prompt": "three"}]))
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(a), str(b)])
    assert str(err.value) == (
        f"{b}, line 2: id 'x' is already used at {a}, line 1; ids must be unique across data files"
    )


def test_error_same_file_name_in_two_folders_says_why(tmp_path):
    """Default ids are <file name>-<line>: two files named alike collide on them, and the
    error says so and what to do, instead of only naming the clash."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    a = tmp_path / "one" / "chat.jsonl"
    b = tmp_path / "two" / "chat.jsonl"
    a.write_text(jsonl_text([{"prompt": "first"}]))
    b.write_text(jsonl_text([{"prompt": "second"}]))
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(a), str(b)])
    assert str(err.value) == (
        f"{b}, line 1: id 'chat-1' is already used at {a}, line 1; ids must be unique across "
        "data files (a default id, <file name>-<line number>: two data files named 'chat' "
        "give the same ones; rename one or give its rows an 'id' field)"
    )


def test_error_id_with_the_epoch_mark(tmp_path):
    """SplitServe names a later epoch's samples conv#e1, conv#e2: an id 'a#e1' in the data
    would be taken for conversation 'a' in epoch 1."""
    path = tmp_path / "a.jsonl"
    path.write_text(jsonl_text([{"id": "a", "prompt": "one"}, {"id": "a#e1", "prompt": "two"}]))
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(path)])
    assert str(err.value) == (
        f"{path}, line 2: id 'a#e1' contains '#e', which marks a later epoch's sample ids "
        "(conv#e1, ...); rename it"
    )


def test_skip_invalid_counts_and_reports_every_skipped_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "good one"}),
                "{not json",
                json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
                json.dumps(["list"]),
                json.dumps({"prompt": "good two"}),
            ]
        )
        + "\n"
    )
    result = load_conversations([str(path)], skip_invalid=True)
    assert [c.id for c in result.conversations] == ["mixed-1", "mixed-5"]
    assert [s.where for s in result.skipped] == [f"{path}, line {n}" for n in (2, 3, 4)]
    assert result.skipped[0].reason.startswith("invalid JSON")
    assert result.skipped[1].reason.startswith("message 1 has role 'robot'")
    assert result.skipped[2].reason == "a row must be a JSON object, got a list"
    summary = result.summary()
    assert summary.splitlines()[0] == "2 rows loaded, 3 malformed rows skipped"
    assert f"skipped {path}, line 3: message 1 has role 'robot'" in summary


def test_skip_invalid_does_not_hide_file_level_errors(tmp_path):
    with pytest.raises(DataFormatError, match="data file not found"):
        load_conversations([str(tmp_path / "missing.jsonl")], skip_invalid=True)


def test_load_prompts_limit_and_builtin_with_overlap_check():
    result = load_prompts(DataConfig(num_samples=50))
    assert len(result.conversations) == 50
    assert result.conversations[0].id == "train-00001"


def test_load_training_conversations_requires_regenerated_file(tmp_path):
    cfg = DataConfig()
    with pytest.raises(
        DataFormatError, match=r"regenerated data not found: .*draftforge data regenerate"
    ):
        load_training_conversations(cfg, tmp_path)
    assert regenerated_path(cfg, tmp_path) == tmp_path / "regenerated.jsonl"


def test_load_training_conversations_as_is(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(jsonl_text(CHATS))
    cfg = DataConfig(train_files=[str(path)], regenerate=False)
    result = load_training_conversations(cfg, tmp_path)
    assert [c.id for c in result.conversations] == ["c1", "chats-2"]


def test_invalid_utf8_is_the_error_of_its_line(tmp_path):
    """A Latin-1 byte failed the whole file with a buffer offset; it is its row's error now,
    with the line, and skip_invalid skips that row alone."""
    import gzip

    rows = [json.dumps({"prompt": "good one"}).encode(), b'{"prompt": "caf\xe9"}',
            json.dumps({"prompt": "good two"}).encode()]  # fmt: skip
    for name, write in (("bad.jsonl", lambda p, b: p.write_bytes(b)),
                        ("bad.jsonl.gz", lambda p, b: p.write_bytes(gzip.compress(b)))):  # fmt: skip
        path = tmp_path / name
        write(path, b"\n".join(rows) + b"\n")
        with pytest.raises(DataFormatError, match=rf"{name}, line 2: invalid UTF-8 at column 16"):
            load_conversations([str(path)])
        result = load_conversations([str(path)], skip_invalid=True)
        assert len(result.conversations) == 2 and result.skipped[0].where == f"{path}, line 2"
