"""``draftforge.allocator``: glibc malloc tuning is applied once, can be switched off, and a
bad setting is refused with the variable's name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from draftforge.errors import InputError

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
PROBE = (
    "from draftforge.allocator import tune_malloc\n"
    "print(tune_malloc(), tune_malloc())\n"
)


def _probe(env_value: str | None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env.pop("DRAFTFORGE_MALLOC", None)
    if env_value is not None:
        env["DRAFTFORGE_MALLOC"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_tuning_is_applied_once_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    result = _probe(None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_default_keeps_glibc_behaviour():
    result = _probe("default")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_unknown_setting_is_refused(monkeypatch):
    from draftforge import allocator

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("DRAFTFORGE_MALLOC", "fast")
    with pytest.raises(InputError, match="DRAFTFORGE_MALLOC='fast'"):
        allocator.tune_malloc()


def test_cli_reports_a_bad_setting_without_a_traceback():
    import os

    env = dict(os.environ, DRAFTFORGE_MALLOC="fast")
    result = subprocess.run([sys.executable, "-m", "draftforge", "config", "show", str(RECIPE)],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 2
    assert "DRAFTFORGE_MALLOC='fast'" in result.stderr and "Traceback" not in result.stderr
