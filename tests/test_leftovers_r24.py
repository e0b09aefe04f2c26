"""Leftovers of earlier review rounds, fixed in session 38.

- ``draftforge eval llamacpp --work-dir``: two checks of other exports sharing one work folder
  converted into the same fixed names (``draft-f32.gguf``), so one replaced the other's draft and
  could check the wrong one.
- ``draftforge data regenerate``: a second run on a file another run was writing generated
  everything too and failed only at its end ("does not hold exactly one row per prompt"); it is
  now refused at once, naming the other process, and a lock left by a killed run blocks nothing.
- a stop signal landing in a finalizer (a ``__del__`` the garbage collector runs) was printed as
  "Exception ignored" and lost by every handler that raises, not only the regenerate workers'
  (fixed last session): the commands' SIGTERM unwinding (eval, export, demo, llamacpp), a rank's
  Ctrl-C (which then ignored every later one) and the GPU check's children.
- the evaluation report's interval tables left out bootstrap draws without a verification round
  silently (``eval compare`` says how many since review round 24); the report says it too.
- ``draftforge eval --calibrate`` of a draft whose confidence head gives NaN (refused since review
  round 24) lost the whole evaluation: the refusal came before the report was written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts

from draftforge.data.regenerate import RegenerationError, regenerate
from draftforge.eval import llamacpp, llamacpp_check


def _stub_check(monkeypatch, tmp_path):
    """Everything around the conversions stubbed; returns the (draft, GGUF content) each check read."""
    import draftforge.config as config
    import draftforge.train.hf_load as hf_load

    class Target:
        trust_remote_code = False  # the recipe's default: folders of data only are converted

        def model_copy(self, update):
            return self

    monkeypatch.setattr(hf_load, "read_serving_config", lambda folder: {})
    monkeypatch.setattr(hf_load, "config_from_serving",
                        lambda raw, where: types.SimpleNamespace(enable_confidence_head=False))
    monkeypatch.setattr(llamacpp_check, "_check_llamacpp_can_run", lambda folder, cfg: None)
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


_HOLD = """
import sys, time
from pathlib import Path
from draftforge.files import exclusive_lock
with exclusive_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def _holder(lock: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n"
    return child


def test_regenerate_refuses_a_file_another_run_is_writing_before_generating(tmp_path):
    out = tmp_path / "answers.jsonl"
    engine = FakeEngine()
    child = _holder(tmp_path / "answers.jsonl.lock")
    try:
        with pytest.raises(RegenerationError, match=rf"answers.jsonl: another draftforge data regenerate "
                           rf"\(process {child.pid}\) is writing it"):
            regenerate(make_prompts(), engine, SETTINGS, out, progress=False)
    finally:
        child.kill()
        child.wait()
    assert engine.calls == [] and not out.exists() and not (tmp_path / "answers.jsonl.partial").exists()
    # the holder was killed: its lock file stays, but no longer blocks
    assert (tmp_path / "answers.jsonl.lock").exists()
    report = regenerate(make_prompts(), engine, SETTINGS, out, progress=False)
    assert report.num_generated == len(make_prompts()) and out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]  # the lock went with the run


def test_the_lock_is_released_when_its_holder_is_stopped(tmp_path):
    lock = tmp_path / "x.lock"
    child = _holder(lock)
    child.send_signal(signal.SIGKILL)
    child.wait()
    from draftforge.files import exclusive_lock

    with exclusive_lock(lock):
        assert lock.read_text() == str(os.getpid())
    assert not lock.exists()


_FINALISED = """
import os, signal, sys, time
class Finalised:
    def __del__(self):
        os.kill(os.getpid(), SIGNUM)  # handled at the next bytecode: in here
        total = 0
        for i in range(10000):
            total += i
"""


@pytest.mark.parametrize(
    "setup, signum, caught",
    [
        ("from draftforge.splitserve.supervisor import unwinding_on_sigterm\n"
         "stack = unwinding_on_sigterm('lead', 'hint'); stack.__enter__()", signal.SIGTERM, "SystemExit"),
        ("from draftforge.splitserve.roles import interrupt_once\ninterrupt_once()", signal.SIGINT,
         "KeyboardInterrupt"),
    ],
    ids=["commands-sigterm", "rank-ctrl-c"],
)
def test_a_stop_landing_in_a_finalizer_still_stops(tmp_path, setup, signum, caught):
    script = tmp_path / "stopped.py"
    script.write_text(
        _FINALISED.replace("SIGNUM", str(int(signum))) + setup + "\n"
        "try:\n"
        "    Finalised()\n"
        "    time.sleep(5)\n"
        "    print('not stopped', flush=True)\n"
        f"except {caught}:\n"
        "    print('stopped', flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout == "stopped\n", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


def test_the_report_says_how_many_bootstrap_draws_it_left_out():
    import numpy as np

    from draftforge.eval.report import uncertainty_lines
    from draftforge.eval.uncertainty import PromptTotals, report_uncertainty

    some = PromptTotals(np.array([2.0, 0, 0, 0, 0]), np.array([5.0, 0, 0, 0, 0]))  # rounds on one prompt
    every = PromptTotals(np.full(5, 2.0), np.full(5, 3.0))
    u = report_uncertainty({"w": {"dspark": some, "ngram": every}}, draws=400, seed=1)
    # counted here: a draw is left out when it resampled none of prompt 0's copies
    index = np.random.default_rng(1).integers(0, 5, size=(400, 5))
    expected = int((index != 0).all(axis=1).sum())
    assert u["acceptance_length"]["dspark"]["w"]["dropped"] == expected > 0
    text = "\n".join(uncertainty_lines(u))
    assert f"dspark AL, w: {expected} of 400 draws" in text
    assert f"dspark-ngram, w: {expected} of 400 draws" in text
    assert "ngram AL, w:" not in text  # every draw of n-gram has a round


def test_a_refused_calibration_still_writes_the_report(tmp_path, capsys):
    import json
    import re

    import torch
    from eval_helpers import random_prompts, tiny_eval_draft

    from draftforge.cli import main
    from draftforge.config import load_recipe
    from draftforge.splitserve.target import build_target
    from draftforge.train.export import export_draft

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    recipe_path = tmp_path / "tiny-debug-512.yaml"
    recipe_path.write_text(re.sub(r"vocab_size: 49152.*", "vocab_size: 512", tiny.read_text()))
    recipe = load_recipe(recipe_path)
    draft = tiny_eval_draft(build_target(recipe.target, recipe.draft.target_layer_ids))
    with torch.no_grad():
        draft.confidence_head.proj.bias.fill_(float("nan"))  # a diverged head: drafting unaffected
    export_dir = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"workload": "alpha", "input_ids": ids}) for ids in random_prompts(2)))
    out, cal = tmp_path / "report", tmp_path / "cal.json"
    status = main(["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts),
                   "--max-new-tokens", "10", "--calibrate", str(cal), "--out", str(out)])  # fmt: skip
    assert status == 2
    err = capsys.readouterr().err
    assert f"--calibrate {cal}: nothing was written there: calibration: the draft's confidence head gave" in err
    assert not cal.exists()
    report = json.loads((out / "report.json").read_text())  # the decoding is kept
    assert report["workloads"]["alpha"]["num_prompts"] == 2 and "calibration" not in report


@pytest.mark.parametrize("text, line", [("train:\n  loss: &x {ce_weight: *x}\n", 2), ("name: x\na: &x [1, *x]\n", 2)])
def test_a_recipe_alias_inside_its_own_anchor_is_refused_at_its_line(tmp_path, text, line):
    """``a: &x [*x]`` made the recipe loader recurse until RecursionError (a traceback)."""
    from draftforge.config import RecipeError, load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=rf"r.yaml:{line}: YAML syntax error: an alias \(\*name\) refers to a "
                       "value that contains it"):
        load_recipe(path)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    with pytest.raises(RecipeError, match=r"command line 'train.loss=&x \{ce_weight: \*x\}': YAML syntax error: "
                       "an alias"):
        load_recipe(recipe, ["train.loss=&x {ce_weight: *x}"])
    # an anchor merged elsewhere is no cycle
    assert load_recipe(recipe, ["train.loss={ce_weight: &w 1.0, tv_weight: *w}"]).train.loss.tv_weight == 1.0


def test_git_revision_of_a_tree_whose_state_git_cannot_read_says_so(tmp_path):
    """A corrupt index made ``git status`` fail; its empty output read as a clean tree."""
    from draftforge.train.metrics import git_revision

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    (tmp_path / "pyproject.toml").write_text('[project]\nname = "draftforge"\n')
    git("init", "-q")
    git("add", "pyproject.toml")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = git("rev-parse", "HEAD").strip()
    assert git_revision(tmp_path) == head
    (tmp_path / ".git" / "index").write_bytes(b"DIRC garbage")
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True).returncode != 0
    assert git_revision(tmp_path) == head + "-unknown-state"


def test_draftforge_train_refuses_an_output_dir_another_run_trains_in_before_starting(tmp_path):
    """The trainer refuses it (review round 25), but only once the target had loaded and the
    ranks started; the launcher's preflight now says so first."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import preflight
    from draftforge.train import checkpoint as ckpt

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_recipe(recipe, [f"train.output_dir={run}"])
    child = _holder(run / ckpt.RUN_LOCK)
    try:
        with pytest.raises(ckpt.CheckpointError, match=rf"train.output_dir {run} is in use by another training run "
                           rf"\(process {child.pid} holds"):
            preflight(cfg)
    finally:
        child.kill()
        child.wait()
    preflight(cfg)  # free again, and left free
    assert not (run / ckpt.RUN_LOCK).exists()


def test_a_resumed_run_removes_the_earlier_plot_with_the_earlier_summary(tmp_path):
    """A resumed run removed summary.json at its first step but left slot_acceptance.png: a crash
    before the run's end left a plot describing no summary there is."""
    from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

    from draftforge.train.sample import pack
    from draftforge.train.trainer import Trainer

    def trainer(steps):
        return Trainer(model_config=tiny_model_config(), train=train_config(str(tmp_path), steps=steps,
                       checkpoint_interval=2, resume="auto"), embeddings=target_embeddings(), run_dir=tmp_path)  # fmt: skip

    trainer(2).fit(pack(chain_samples(12), 90))
    assert (tmp_path / "slot_acceptance.png").is_file() and (tmp_path / "summary.json").is_file()

    class Crash(Exception):
        pass

    def batches():  # the resumed run's first step trains, then the run dies
        yield from pack(chain_samples(12), 90)[:1]
        raise Crash

    resumed = trainer(4)
    resumed.resume()
    with pytest.raises(Crash):
        resumed.fit(batches())
    assert not (tmp_path / "summary.json").exists()
    assert not (tmp_path / "slot_acceptance.png").exists()


_READ_AS_ANOTHER_USER = """
import os, sys
from draftforge.train.export import ExportError, read_safetensors_file
import safetensors.torch  # imported while the interpreter's files are readable
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)  # root reads everything: nobody reads what the file's mode allows
try:
    read_safetensors_file(sys.argv[1])
except ExportError as err:
    print(err)
"""


def test_a_weights_file_this_user_may_not_read_is_not_called_missing_or_corrupt():
    """export read a checkpoint's model.safetensors another user wrote privately (0600, as
    safetensors writes it) as missing, or died on a PermissionError traceback."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    shared = Path(tempfile.mkdtemp(prefix="r24-", dir="/tmp"))  # a folder everyone may enter
    try:
        shared.chmod(0o755)
        weights = shared / "model.safetensors"
        save_file({"w": torch.zeros(2)}, str(weights))
        weights.chmod(0o000)
        done = subprocess.run([sys.executable, "-c", _READ_AS_ANOTHER_USER, str(weights)], capture_output=True,
                              text=True, timeout=60)
    finally:
        shutil.rmtree(shared)
    assert done.stdout.startswith(f"{weights}: this user cannot read it (Permission denied); do not delete it"), (
        done.stdout + done.stderr)


@pytest.mark.parametrize("name", ["ling3-flash-dspark.yaml", "ling3-flash-2node.yaml"])
def test_the_ling_recipes_mask_is_no_token_ling_ends_a_turn_with(name):
    """Ling's chat models end every turn with <|role_end|> = 156895 and text with <|endoftext|> =
    156892 (eos [156892, 156895] in inclusionAI's Ling 2.6 generation_config.json); the recipes
    used 156895 as the mask, taken from the diffusion models whose tokenizer adds a <|mask|>.
    The target rank would refuse it, but only after loading the 124B-parameter target."""
    from draftforge.config import load_recipe

    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / name)
    assert cfg.draft.mask_token_id not in (156892, 156895)
    assert 0 <= cfg.draft.mask_token_id < cfg.target.shape.vocab_size == 157_184


def test_a_mask_token_the_target_ends_turns_with_is_refused_before_its_weights_load(monkeypatch):
    """The target rank checked draft.mask_token_id only once the target had loaded: minutes for
    a large one (Ling-3.0-flash) before the refusal. A local folder's tokenizer, config.json and
    generation_config.json say it first."""
    import torch

    from draftforge.config import load_recipe
    from draftforge.errors import InputError
    from draftforge.splitserve import smollm2
    from draftforge.splitserve import target as target_mod
    from draftforge.splitserve.roles import build_engine

    folder = smollm2.ensure_smollm2()  # a local folder like any user's (eos 2: <|im_end|>)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"

    def not_loaded(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before the mask token was checked")

    monkeypatch.setattr(target_mod, "build_target", not_loaded)
    logged = []
    for mask, refusal in ((2, "is an end-of-turn token of the target"), (1, "which the chat template writes")):
        cfg = load_recipe(recipe, [f"target.model={folder}", f"draft.mask_token_id={mask}"])
        ctx = types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"), log=logged.append)
        with pytest.raises(InputError, match=rf"draft.mask_token_id {mask} .*{refusal}"):
            build_engine(ctx)
    cfg = load_recipe(recipe, [f"target.model={folder}"])  # 16, <empty_output>: accepted, then loaded
    with pytest.raises(AssertionError, match="were loaded"):
        build_engine(types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"), log=logged.append))
    assert logged[0] == "draft.mask_token_id 16: '<empty_output>', a special token the chat template does not use"


@pytest.mark.parametrize(
    "recipe, overrides, gpus",
    [
        ("ling3-flash-2node.yaml", [], [0, 1, 2, 3]),  # no device lists: the first TP group's LOCAL_RANKs
        ("ling3-flash-dspark.yaml", [], [0, 1, 2, 3]),  # its split.target_devices
        ("qwen3-8b-dspark.yaml", ["split.target_devices=null", "split.trainer_devices=null"], [0]),
        ("tiny-debug.yaml", [], [0]),
    ],
)
def test_eval_device_auto_takes_the_gpus_training_gives_the_target(recipe, overrides, gpus):
    """eval --device auto used split.target_devices, else GPU 0: the two-node Ling recipe (which
    cannot list devices) would have put the whole 124B target on GPU 0."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.placement import recipe_target_gpus, resolve_devices

    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / recipe, overrides)
    assert recipe_target_gpus(cfg.split) == gpus
    assert resolve_devices("auto", recipe_target_gpus(cfg.split), cuda_available=True) == [f"cuda:{g}" for g in gpus]


def test_the_target_estimate_counts_generation_only_where_the_target_generates():
    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import target_estimate

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    answering = dict(target_estimate(load_recipe(recipe)).items)
    reading = dict(target_estimate(load_recipe(recipe, ["data.regenerate=false"])).items)
    assert answering["generation: KV cache + logits"] > 0
    assert "generation: KV cache + logits" not in reading  # the data's own answers: none generated
    assert {k: v for k, v in answering.items() if k != "generation: KV cache + logits"} == reading


@pytest.mark.parametrize("value, says", [("nan", "must be a finite number"), ("0", "must be greater than 0"),
                                         ("-5", "must be greater than 0")])
def test_gpu_check_refuses_a_time_limit_it_cannot_keep(value, says, capsys):
    """--time-limit-s nan ran every check to its cap ("limit nan s"); 0 or less gave four
    'not run' FAILs instead of a usage error."""
    from draftforge.splitserve import gpu_check

    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--time-limit-s", value])
    assert stop.value.code == 2 and says in capsys.readouterr().err
