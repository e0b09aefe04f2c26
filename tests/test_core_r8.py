"""Round 8 of core: float options refuse inf and nan, a rewritten file keeps its mode, and the
usable cores follow a container's CPU quota."""

from __future__ import annotations

import argparse
import os

import pytest

from draftforge import argtypes, cores, files

FLOAT_PARSERS = [argtypes.non_negative_float, argtypes.positive_float, argtypes.probability,
                 argtypes.nucleus]  # fmt: skip


@pytest.mark.parametrize("parse", FLOAT_PARSERS)
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e999"])
def test_float_options_refuse_values_that_are_not_finite(parse, text):
    # "inf" passed every lower bound (--temperature inf sampled from a uniform distribution,
    # bench target failed with a pydantic traceback); "nan" was refused as out of range
    with pytest.raises(argparse.ArgumentTypeError, match=f"must be a finite number, got {text}"):
        parse(text)


def test_a_float_option_names_itself_when_it_is_not_finite(capsys):
    parser = argparse.ArgumentParser(prog="draftforge eval")
    parser.add_argument("--temperature", type=argtypes.non_negative_float)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--temperature", "inf"])
    assert exit_info.value.code == 2
    assert "argument --temperature: must be a finite number, got inf" in capsys.readouterr().err
    assert parser.parse_args(["--temperature", "0.7"]).temperature == 0.7


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("mode", [0o664, 0o600, 0o640])
def test_write_atomic_keeps_the_mode_of_the_file_it_rewrites(tmp_path, umask_022, mode):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    path.chmod(mode)
    files.write_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert path.stat().st_mode & 0o777 == mode  # as open(path, "w") would have left it
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    fresh = tmp_path / "summary.json"
    files.write_atomic(fresh, "{}")
    assert fresh.stat().st_mode & 0o777 == 0o644  # a new file: 0o666 less the umask


@pytest.fixture()
def sixty_four_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(cores, "CGROUP", tmp_path, raising=False)
    return tmp_path


@pytest.mark.parametrize(("cpu_max", "want"), [
    ("200000 100000\n", 2),  # docker run --cpus 2
    ("150000 100000\n", 2),  # 1.5 CPUs: rounded up
    ("50000 100000\n", 1),
    ("max 100000\n", 64),  # no quota
    ("9600000 100000\n", 64),  # a quota above the affinity: the affinity
])  # fmt: skip
def test_usable_cores_follow_a_cgroup_v2_quota(sixty_four_cores, cpu_max, want):
    (sixty_four_cores / "cpu.max").write_text(cpu_max)
    assert cores.usable_cores() == want


@pytest.mark.parametrize(("quota", "want"), [("300000\n", 3), ("-1\n", 64)])
def test_usable_cores_follow_a_cgroup_v1_quota(sixty_four_cores, quota, want):
    (sixty_four_cores / "cpu").mkdir()
    (sixty_four_cores / "cpu" / "cpu.cfs_quota_us").write_text(quota)
    (sixty_four_cores / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores.usable_cores() == want


def test_usable_cores_without_cgroup_files_are_the_affinity(sixty_four_cores):
    assert cores.usable_cores() == 64
