"""Review round 58: a standard output that cannot be written (full, closed) named without a
traceback; the split's rules that hold on every machine said by ``config show`` too (nccl with
train.device cpu, a GPU in both device lists, a negative GPU id); a section's problem that an
override brought about names that override; quoting advice for an override in the shell's form;
an unknown builtin data set refused at the recipe's key."""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_helpers import TINY_RECIPE, problems

from draftforge import cli
from draftforge.config import load_recipe
from draftforge.data.loading import DataFormatError, load_conversations

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-debug.yaml"
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


def _draftforge(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    # a buffered standard output, as in a shell: under PYTHONUNBUFFERED (set in some containers)
    # a failed write leaves nothing for the exit's flush, which otherwise fails again (status 120)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-m", "draftforge", *argv], cwd=ROOT, stderr=subprocess.PIPE,
                          text=True, timeout=300, check=False, env=env, **kwargs)


def _show(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``draftforge config show ARGV``, run in this process."""
    code = cli.main(["config", "show", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------- A: standard output

WRITERS = [
    (["config", "show", TINY], "draftforge config show"),
    (["config", "keys"], "draftforge config keys"),
    (["--help"], "draftforge"),
    (["train", TINY, "--dry-run"], "draftforge train"),
]


@pytest.mark.parametrize(("argv", "prog"), WRITERS)
def test_a_full_standard_output_is_an_error_naming_it_not_a_traceback(argv, prog):
    """``> /dev/full`` gave an OSError traceback and status 1 (the help's write was outside
    the handler)."""
    with open("/dev/full", "w") as full:
        done = _draftforge(argv, stdout=full)
    assert (done.returncode, done.stderr) == (2, f"{prog}: error: standard output: {NO_SPACE}\n")


@pytest.mark.parametrize(("argv", "prog"), WRITERS)
def test_a_closed_standard_output_writes_nothing_and_is_no_traceback(argv, prog):
    """``>&-`` gave "AttributeError: 'NoneType' object has no attribute 'write'". Started
    without a standard output (a service manager), a command writes nothing there, as
    ``print`` does, and succeeds (tests/test_core_eval_r17.py: a run must not fail for it)."""
    done = _draftforge(argv, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))  # noqa: PLW1509
    assert (done.returncode, done.stderr) == (0, ""), prog


def test_a_full_output_after_argparse_help_and_a_reader_gone(tmp_path):
    """argparse's --help ignores a failed write; what it left buffered failed at exit (status
    120, "Exception ignored"). And a reader gone is quiet, status 141, not an error."""
    with open("/dev/full", "w") as full:
        done = _draftforge(["train", "--help"], stdout=full)
    assert (done.returncode, done.stderr) == (2, f"draftforge train: error: standard output: {NO_SPACE}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    shell = f"{sys.executable} -m draftforge train --help | head -c 1 >/dev/null"
    piped = subprocess.run(["bash", "-c", shell + "; echo ${PIPESTATUS[0]}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert piped.stdout.strip() in ("0", "141") and "Exception" not in piped.stderr, piped


# --------------------------------------------------------------------------- B: the split's rules


@pytest.mark.parametrize(("overrides", "expected"), [
    (["split.comm_backend=nccl", "train.device=cpu"],
     "command line 'split.comm_backend=nccl': split.comm_backend: nccl moves samples between GPUs "
     "but train.device is cpu; use comm_backend gloo (or auto) for CPU trainers"),
    (["split.target_devices=[0]", "split.trainer_devices=[0]"],
     "command line 'split.trainer_devices=[0]': split.trainer_devices: GPUs [0] are in both "
     "target_devices and trainer_devices (two ranks on one GPU, which NCCL refuses); give each "
     "group its own GPUs"),
    (["split.target_devices=[-1]"],
     "command line 'split.target_devices=[-1]': split.target_devices[0]: must be greater than or "
     "equal to 0, got int -1"),
    (["split.trainer_devices=[1, -2]"],
     "command line 'split.trainer_devices=[1, -2]': split.trainer_devices[1]: must be greater "
     "than or equal to 0, got int -2"),
])
def test_config_show_refuses_what_every_machine_refuses(capsys, overrides, expected):
    """These were accepted by ``config show`` (status 0) and refused only by ``train
    --dry-run``, a negative GPU id only where GPUs are visible ("(1 GPUs visible)" on a
    machine with none counted the GPUs the dry run planned)."""
    assert _show([TINY, *overrides], capsys) == (2, "", f"draftforge config show: invalid recipe:\n{expected}\n")


def test_the_split_rules_moved_to_the_recipe_checks_are_said_once_by_a_run():
    """The machine-independent rules are the recipe's (recipe_split_problems), and a run's
    check (split_problems, which adds this machine's) still says each once."""
    from draftforge.splitserve.roles import recipe_split_problems, split_problems

    both = ("split.trainer_devices: GPUs [1] are in both target_devices and trainer_devices (two "
            "ranks on one GPU, which NCCL refuses); give each group its own GPUs")
    nccl_cpu = ("split.comm_backend: nccl moves samples between GPUs but train.device is cpu; use "
                "comm_backend gloo (or auto) for CPU trainers")
    cfg = load_recipe(TINY, ["train.device=cuda", "split.comm_backend=nccl",
                             "split.target_devices=[1]", "split.trainer_devices=[1]"])
    assert recipe_split_problems(cfg) == [both]
    assert [p for p in split_problems(cfg, world_size=2, cuda_devices=2) if "GPU" in p] == [both]
    cfg = load_recipe(TINY, ["train.device=cpu", "split.comm_backend=nccl"])
    assert recipe_split_problems(cfg) == [nccl_cpu]
    assert split_problems(cfg, world_size=2, cuda_devices=1).count(nccl_cpu) == 1


# --------------------------------------------------------------------------- C: a section's problem


def test_a_section_problem_an_override_brought_about_names_the_override(tmp_path):
    """``target.model=random`` over a file whose target section declares no shape was blamed on
    the file's 'target:' line alone."""
    path = tmp_path / "r.yaml"
    path.write_text("target:\n  model: smollm2-135m-instruct\n")
    expected = (f"{path}:1 (with command line 'target.model=random'): target: model 'random' "
                "needs a declared 'shape' section")
    assert problems(path, ["target.model=random"]) == [expected]
    # an override outside the section is not named
    assert problems(path, ["target.model=random", "train.steps=5"]) == [expected]
    path.write_text("target:\n  model: random\n")  # the file alone: its line alone
    assert problems(path, ["train.steps=5"]) == [
        f"{path}:1: target: model 'random' needs a declared 'shape' section"]


# --------------------------------------------------------------------------- D: quoting advice


def test_quoting_advice_for_an_override_is_the_shells_and_works(tmp_path):
    """"quote it: 'yes'" on the command line: a shell strips the quotes, and yes is a boolean
    again; so was "quote 'None' for the string"."""
    path = tmp_path / "r.yaml"
    path.write_text(TINY_RECIPE)
    [yes] = problems(path, ["train.output_dir=yes"])
    assert yes == ("command line 'train.output_dir=yes': train.output_dir: expected str, got bool "
                   "True (unquoted yes is a boolean in YAML; quote it, in a shell: "
                   "train.output_dir='\"yes\"')")
    [none] = problems(path, ["export.out_dir=None"])
    assert none == ("command line 'export.out_dir=None': export.out_dir: unquoted None is the string "
                    "'None' in YAML, not null; write null (or ~) for none, or quote it for the string, "
                    "in a shell: export.out_dir='\"None\"'")
    # what a shell hands over for the advised text gives the strings
    advised = [shlex.split(text.rpartition("in a shell: ")[2].rstrip(")"))[0] for text in (yes, none)]
    cfg = load_recipe(path, advised)
    assert (cfg.train.output_dir, cfg.export.out_dir) == ("yes", "None")
    # in the file, YAML's quotes are the advice
    path.write_text(TINY_RECIPE + "  output_dir: yes\nexport:\n  out_dir: None\n")
    assert problems(path) == [
        f"{path}:19: train.output_dir: expected str, got bool True (unquoted yes is a boolean in "
        "YAML; quote it: 'yes')"]
    path.write_text(TINY_RECIPE + "export:\n  out_dir: None\n")
    assert problems(path) == [
        f"{path}:20: export.out_dir: unquoted None is the string 'None' in YAML, not null; write "
        "null (or ~) for none, or quote it for the string: 'None'"]


# --------------------------------------------------------------------------- E: builtin data sets


def test_an_unknown_builtin_data_set_is_refused_at_its_key(tmp_path, capsys):
    """It passed ``config show`` and the dry run said "unknown builtin data set" naming no
    file, line or key."""
    assert _show([TINY, "data.train_files=[builtin:nope]"], capsys) == (
        2, "", "draftforge config show: invalid recipe:\ncommand line 'data.train_files=[builtin:nope]': "
               "data.train_files: unknown builtin data set 'builtin:nope'; valid: builtin:train-prompts\n")
    path = tmp_path / "r.yaml"
    path.write_text(TINY_RECIPE + "data:\n  train_files: [builtin:train-prompts, builtin:x, builtin:y]\n")
    assert problems(path) == [
        f"{path}:20: data.train_files: unknown builtin data sets 'builtin:x', 'builtin:y'; valid: "
        "builtin:train-prompts"]


def test_the_loaders_path_errors_name_the_key(tmp_path):
    with pytest.raises(DataFormatError) as err:
        load_conversations(["builtin:nope"])
    assert str(err.value) == ("unknown builtin data set 'builtin:nope'; valid: builtin:train-prompts "
                              "(data.train_files)")
    with pytest.raises(DataFormatError) as err:
        load_conversations([str(tmp_path)])
    assert str(err.value) == f"data path is not a file: {tmp_path} (data.train_files)"
