"""A regeneration stopped while it moved a cut file's whole rows to its .partial (a review of
data/, 2026-12-06): the next run refused both files and asked the user to pick one."""

from __future__ import annotations

from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.regenerate import check_answers, regenerate


def test_a_cut_file_beside_a_partial_of_its_whole_rows_is_continued(tmp_path):
    """``write_atomic(partial, rows)`` then ``out.unlink()``: a stop between the two left the cut
    file and a .partial holding exactly its whole rows. The rerun drops the cut file and
    continues the .partial, answering only the cut row's batch, and writes the uninterrupted
    run's file."""
    reference = tmp_path / "reference.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, reference, progress=False)
    whole = reference.read_bytes()
    out = tmp_path / "copied.jsonl"
    out.write_bytes(whole[:-30])  # the last row (p10, batch p09-p10) cut
    partial = out.with_name(out.name + ".partial")
    partial.write_bytes(b"".join(whole.splitlines(keepends=True)[:-1]))
    report = regenerate(make_prompts(11), FakeEngine(), SETTINGS, out, progress=False)
    assert out.read_bytes() == whole and not partial.exists()
    assert (report.num_generated, report.num_reused) == (2, 9)
    check_answers(out, make_prompts(11), SETTINGS, "fake-target")
