"""Session 51: a draftforge cache that is a file is refused naming where it was set."""

from __future__ import annotations

import pytest

from draftforge.errors import InputError
from draftforge.splitserve.smollm2 import cache_root


def test_a_cache_that_is_a_file_names_its_setting(tmp_path, monkeypatch):
    """'DRAFTFORGE_CACHE=afile draftforge eval ...' and 'bench target --cache-dir afile' printed only
    '.../afile: File exists', from the first folder made there."""
    a_file = tmp_path / "afile"
    a_file.write_text("")
    monkeypatch.setenv("DRAFTFORGE_CACHE", str(a_file))
    with pytest.raises(InputError, match=rf"^DRAFTFORGE_CACHE={a_file}: {a_file} is a file; name a folder"):
        cache_root()
    with pytest.raises(InputError, match=rf"\(--cache-dir or target.cache_dir\): {a_file / 'x'} is under {a_file}, a file"):
        cache_root(a_file / "x")
    assert cache_root(tmp_path / "new") == tmp_path / "new"  # a folder made later is fine
