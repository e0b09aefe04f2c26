"""What an export and write_atomic's stale-file clean-up take for their own leftovers (review
round 62): ``.NAME.tmp-*`` and ``.NAME.old-*`` also matched a sibling export's folders
(``NAME.old-v1``'s staging ``.NAME.old-v1.tmp-*``, its moved-aside copy ``.NAME.old-v1.old-*``), so
an export into NAME deleted a sibling export's staging folder while it wrote it, or the only copy
of its earlier export; ``.NAME.*.tmp`` matched the temporaries of a file ``NAME.bak``."""

from __future__ import annotations

import os
import tempfile

from dspark_helpers import tiny_draft

from draftforge.files import remove_stale_temporaries, temporaries_of
from draftforge.train.export import export_draft


def test_an_export_leaves_a_sibling_exports_staging_and_moved_aside_copy(tmp_path):
    out = tmp_path / "draft"
    sibling = tmp_path / "draft.old-v1"  # a versioned export beside it
    # the sibling's export writing now, and its earlier export left moved aside by a kill
    staging = tempfile.mkdtemp(prefix=f".{sibling.name}.tmp-", dir=tmp_path)
    written = os.path.join(staging, "model.safetensors")  # what that export has written so far
    with open(written, "wb") as handle:
        handle.write(b"w")
    aside = tempfile.mkdtemp(prefix=f".{sibling.name}.old-", dir=tmp_path)
    os.mkdir(os.path.join(aside, sibling.name))
    # this export's own leftovers, as a killed export into it leaves them
    own_staging = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=tmp_path)
    lines: list[str] = []
    export_draft(tiny_draft(seed=1), out, progress=lines.append)
    assert os.path.isfile(written) and os.path.isdir(os.path.join(aside, sibling.name))
    assert not os.path.exists(own_staging)
    assert any("removed 1 partial folder(s)" in line for line in lines), lines
    assert temporaries_of(out, "tmp") == [] and temporaries_of(out, "old") == []


def test_an_export_says_it_removed_older_moved_aside_copies(tmp_path):
    out = tmp_path / "draft"
    export_draft(tiny_draft(seed=1), out, progress=lambda line: None)
    older = tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=tmp_path)  # a copy an earlier kill left
    os.mkdir(os.path.join(older, out.name))
    lines: list[str] = []
    export_draft(tiny_draft(seed=2), out, progress=lines.append)
    assert not os.path.exists(older)
    assert any("removed 1 older export(s)" in line for line in lines), lines


def test_write_atomic_leftovers_of_a_sibling_file_are_kept(tmp_path):
    path = tmp_path / "report.json"
    fd, own = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_path)
    os.close(fd)
    fd, sibling = tempfile.mkstemp(prefix=".report.json.bak.", suffix=".tmp", dir=tmp_path)
    os.close(fd)
    assert remove_stale_temporaries(path) == [tmp_path / os.path.basename(own)]
    assert os.path.exists(sibling) and not os.path.exists(own)
