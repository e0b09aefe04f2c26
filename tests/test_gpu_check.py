"""``splitserve.gpu_check`` on a CPU: every piece that runs without a GPU.

The GPU-only parts (SGLang on CUDA, NCCL between two GPUs) are exercised by
``make gpu-check`` itself; here: the report lines and exit statuses, the
no-CUDA SKIP path as a real subprocess, the SGLang reply parsing and the
acceptance comparison on hand-built replies, the feature comparison against a
real (random) transformers target, the time bound and dependencies, and
checks 2 and 3 end to end on the CPU layout (gloo, tiny random target).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from draftforge.splitserve import gpu_check as G
from draftforge.splitserve import gpu_check_serving as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- results


def test_result_line_shows_status_name_figures_and_reason():
    result = G.CheckResult("export", G.PASS, {"tensors": 12, "max_abs_diff": 0.0, "rel": 0.123456,
                                              "ok": True, "where": "a b"}, "loads\n back")
    assert result.line() == (
        "PASS  export                  tensors=12 max_abs_diff=0 rel=0.1235 ok=true where=a_b"
        "  (loads back)"
    )
    bare = G.CheckResult("sglang-dspark", G.SKIP, reason="sglang is not installed")
    assert bare.line() == "SKIP  sglang-dspark           (sglang is not installed)"
    assert G.CheckResult("x", G.FAIL, {"v": math.nan}).line() == "FAIL  x                       v=nan"


def test_result_refuses_an_unknown_status_and_survives_json():
    with pytest.raises(ValueError, match="PASS, FAIL, SKIP"):
        G.CheckResult("x", "OK")
    result = G.CheckResult("splitserve-step/gloo", G.FAIL, {"loss": 1.5, "step": 1}, "why")
    assert G.CheckResult.from_json(result.to_json()) == result


def test_exit_status():
    ok = G.CheckResult("a", G.PASS)
    skipped = G.CheckResult("b", G.SKIP)
    failed = G.CheckResult("c", G.FAIL)
    assert G.exit_status([ok, skipped], cuda=True) == 0
    assert G.exit_status([ok, failed, skipped], cuda=True) == 1
    assert G.exit_status([skipped, skipped], cuda=False) == G.EXIT_NO_CUDA == 77


def test_without_cuda_every_check_skips_with_status_77(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "draftforge.splitserve.gpu_check", "--work-dir", str(tmp_path / "w")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )
    assert proc.returncode == 77, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[:2] for line in lines[:4]] == [["SKIP", name] for name in G.CHECK_ORDER]
    assert all("no CUDA device visible" in line for line in lines[:4])
    assert lines[4].startswith("gpu-check: 0 passed, 0 failed, 4 skipped in ")
    assert len(lines) == 5
    assert not (tmp_path / "w").exists(), "nothing is written without a GPU"


# --------------------------------------------------------------------------- check 4 pieces


def _reply(completion, verify, *, output=None, accept=None):
    meta = {"id": "r", "prompt_tokens": 30, "completion_tokens": completion, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": completion}}
    if verify is not None:
        meta.update(spec_verify_ct=verify, spec_accept_length=accept if accept is not None
                    else completion / verify, spec_num_correct_drafts=completion - 1 - verify,
                    spec_accept_rate=0.1)
    return {"text": "...", "output_ids": output if output is not None else list(range(completion)),
            "meta_info": meta}


def test_parse_sglang_reply_reads_the_counts():
    counts = S.parse_sglang_reply(_reply(64, 40, output=[5, 6, 7]))
    assert counts == S.SpecCounts(64, 40, 1.6, (5, 6, 7))


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({"text": "x"}, "no meta_info"),
        ("not json object", "no meta_info"),
        ({"meta_info": {"spec_verify_ct": 3}}, "no completion_tokens"),
        (_reply(64, None), "--speculative-algorithm DSPARK"),
        (_reply(64, 0, accept=0.0), "spec_verify_ct 0"),
        ({"meta_info": {"completion_tokens": "many", "spec_verify_ct": 3}}, "malformed"),
    ],
)
def test_parse_sglang_reply_names_what_is_wrong(reply, message):
    with pytest.raises(ValueError, match="reply 2") as err:
        S.parse_sglang_reply(reply, index=2)
    assert message in str(err.value)


def test_compare_acceptance_pools_tokens_per_step():
    sglang = [S.SpecCounts(64, 40, None), S.SpecCounts(64, 32, None)]
    ours = [(64, 41), (64, 33)]  # one more round each: 128/74 against 128/72
    passed, figures, reason = S.compare_acceptance(sglang, ours, [[1], [2]])
    assert not passed and "no request decoded identical tokens" in reason
    assert figures["sglang_tok_per_step"] == pytest.approx(128 / 72)
    assert figures["draftforge_tok_per_step"] == pytest.approx(128 / 74)
    assert figures["rel_diff"] == pytest.approx(74 / 72 - 1)


def test_compare_acceptance_fails_on_a_different_count_or_definition():
    sglang = [S.SpecCounts(64, 40, None), S.SpecCounts(64, 32, None)]
    # a definition slip (SGLang counting every round twice) is far outside the tolerance
    outputs = [[0], [0]]
    passed, figures, reason = S.compare_acceptance(sglang, [(64, 20), (64, 16)], outputs)
    assert not passed and "differ by" in reason and figures["rel_diff"] > S.ACCEPT_REL_TOL
    # SGLang stopped early on one prompt: the token counts differ
    passed, _, reason = S.compare_acceptance([S.SpecCounts(50, 31, None), sglang[1]],
                                             [(64, 40), (64, 32)], outputs)
    assert not passed and "decoded 114 tokens, draftforge 128" in reason
    passed, _, reason = S.compare_acceptance(sglang, [(64, 40)], outputs[:1])
    assert not passed and "2 SGLang replies for 1 prompts" in reason


def test_server_command_binds_loopback_and_serves_the_draft():
    command = S.sglang_server_command("/models/t", "/runs/export", 31234, block_size=8)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "31234"
    assert flags["--speculative-algorithm"] == "DSPARK"
    assert flags["--speculative-draft-model-path"] == "/runs/export"
    assert flags["--speculative-num-draft-tokens"] == "9"  # the verify width: block + 1
    assert flags["--model-path"] == "/models/t"
    assert "0.0.0.0" not in command
    request = S.generate_request([1, 2, 3], 64)
    assert request == {"input_ids": [1, 2, 3],
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}}


def _fake_sglang(root, members):
    """A stand-in ``sglang`` distribution whose SpeculativeAlgorithm has ``members``."""
    package = root / "sglang" / "srt" / "speculative"
    package.mkdir(parents=True)
    for folder in (root / "sglang", root / "sglang" / "srt", package):
        (folder / "__init__.py").write_text("")
    body = "".join(f"    {m} = {i}\n" for i, m in enumerate(members, start=1))
    (package / "spec_info.py").write_text(f"import enum\nclass SpeculativeAlgorithm(enum.Enum):\n{body}")
    info = root / "sglang-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n")


@pytest.mark.parametrize(("members", "expected"), [
    (["DFLASH", "DSPARK"], (True, "9.9.9")),
    (["EAGLE", "DFLASH"], (False, "sglang 9.9.9 has no DSPARK speculative algorithm")),
])
def test_sglang_has_dspark_reads_the_installed_release(tmp_path, monkeypatch, members, expected):
    import importlib

    _fake_sglang(tmp_path, members)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    try:
        assert S.sglang_has_dspark() == expected
    finally:
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]


def test_sglang_checks_skip_without_sglang(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    setup = G.gpu_setup(tmp_path, 1)
    features = G.check_sglang_features(setup)
    dspark = S.check_sglang_dspark(setup, time.monotonic() + 60)
    assert (features.status, dspark.status) == (G.SKIP, G.SKIP)
    assert "not installed" in features.reason and dspark.reason == "sglang is not installed"
    assert not tmp_path.joinpath("logs").exists()


def test_common_prefix():
    assert S.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert S.common_prefix([], [1]) == 0


# --------------------------------------------------------------------------- check 1 pieces


@pytest.fixture(scope="module")
def random_features():
    """transformers' layer outputs of a random 6-layer target, for layers 0..4, on a padded batch."""
    from draftforge.splitserve.config import TargetConfig, TargetShape
    from draftforge.splitserve.target import build_target

    shape = TargetShape(num_hidden_layers=6, hidden_size=64, vocab_size=512, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    target = build_target(TargetConfig(model="random", shape=shape, dtype="float32"), [0, 1, 2, 3, 4])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    feats = target.features(ids, mask)
    layers = {i: feats.aux[..., i * 64:(i + 1) * 64] for i in range(5)}
    return layers, feats.final, mask


def _as_sglang(layers, ids):
    return torch.cat([layers[i] for i in ids], dim=-1)


def test_compare_features_passes_bf16_rounding_of_the_same_states(random_features):
    layers, final, mask = random_features
    ids = [1, 3]
    sgl = _as_sglang(layers, ids).to(torch.bfloat16).float()
    passed, figures, reason = G.compare_features(layers, final, sgl, final.to(torch.bfloat16).float(),
                                                 ids, mask)
    assert passed, reason
    assert 0 < figures["err_l1"] < 0.01 and figures["next_l1"] > 0.1


def test_compare_features_catches_a_layer_shift_and_padding(random_features):
    layers, final, mask = random_features
    shifted = _as_sglang(layers, [2, 4])  # SGLang capturing "one layer later" than asked
    passed, _, reason = G.compare_features(layers, final, shifted, final, [1, 3], mask)
    assert not passed and "layer 1" in reason and "neighbouring layer" in reason
    leaky = _as_sglang(layers, [1, 3]).clone()
    leaky[1, 10] = 1.0  # a padded position
    passed, _, reason = G.compare_features(layers, final, leaky, final, [1, 3], mask)
    assert not passed and "outside the attention mask" in reason
    passed, _, reason = G.compare_features(layers, final, leaky[..., :64], final, [1, 3], mask)
    assert not passed and "width 64" in reason


def test_check_ones_pipeline_on_two_cpu_engines_agrees_exactly():
    """features_once + compare_features as check 1 runs them, with transformers on both sides."""
    from draftforge.splitserve.config import TargetConfig, TargetShape

    shape = TargetShape(num_hidden_layers=6, hidden_size=64, vocab_size=512, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    cfg = TargetConfig(model="random", shape=shape, dtype="float32")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    probe = [0, 1, 2, 3, 4]
    aux, final, hidden = G.features_once(cfg, probe, ids, mask, "cpu")
    layers = {layer: aux[..., k * hidden:(k + 1) * hidden] for k, layer in enumerate(probe)}
    other_aux, other_final, _ = G.features_once(cfg, [1, 3], ids, mask, "cpu")
    passed, figures, reason = G.compare_features(layers, final, other_aux, other_final, [1, 3], mask)
    assert passed, reason
    assert figures["err_l1"] == figures["err_l3"] == figures["err_final"] == 0.0


def test_features_once_closes_the_engine(monkeypatch):
    from draftforge.splitserve import target as target_module
    from draftforge.splitserve.target import TargetFeatures

    closed = []

    class Engine:
        hidden_size = 2

        def features(self, input_ids, attention_mask):
            return TargetFeatures(aux=torch.ones(1, 3, 4, dtype=torch.bfloat16),
                                  final=torch.zeros(1, 3, 2, dtype=torch.bfloat16))

        def close(self):
            closed.append(True)

    monkeypatch.setattr(target_module, "build_target", lambda cfg, ids, device: Engine())
    aux, final, hidden = G.features_once(None, [0, 1], torch.zeros(1, 3, dtype=torch.long),
                                         torch.ones(1, 3, dtype=torch.long), "cpu")
    assert closed == [True] and hidden == 2
    assert aux.dtype == torch.float32 and aux.shape == (1, 3, 4) and final.shape == (1, 3, 2)


def test_prompt_batch_right_pads():
    class Tok:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[0]["content"]

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [len(w) for w in text.split()]}

    ids, mask = G.prompt_batch(Tok(), ["aa bbb", "c"])
    assert ids.tolist() == [[2, 3], [1, 0]]
    assert mask.tolist() == [[1, 1], [1, 0]]


# --------------------------------------------------------------------------- check 3 pieces


def test_compare_states_is_exact():
    trained = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
    assert G.compare_states(trained, {"a": torch.ones(2, 3), "b": torch.zeros(4), "c": torch.ones(1)}) == (2, 0.0, [])
    off = {"a": torch.ones(2, 3) + 1e-3, "b": torch.zeros(4)}
    compared, worst, missing = G.compare_states(trained, off)
    assert compared == 2 and worst == pytest.approx(1e-3, rel=1e-3) and missing == []
    assert G.compare_states(trained, {"a": torch.ones(3, 2)}) == (1, math.inf, ["b"])


# --------------------------------------------------------------------------- the plan, the bound


def test_step_layouts_pass_the_launchers_split_checks(tmp_path):
    import yaml

    from draftforge.config import load_recipe
    from draftforge.splitserve.roles import split_problems

    for gpus, transport in ((2, "nccl"), (1, "gloo")):
        setup = G.gpu_setup(tmp_path, gpus)
        assert setup.layout.transport == transport
        path = tmp_path / f"r{gpus}.yaml"
        path.write_text(yaml.safe_dump(G.step_recipe(setup)))
        cfg = load_recipe(path)
        assert split_problems(cfg, world_size=2, cuda_devices=gpus) == []
        assert cfg.train.device == "cuda" and cfg.train.steps == 1
    two = G.step_layout(2)
    assert two.split == {"target_devices": [0], "trainer_devices": [1], "comm_backend": "nccl"}
    assert "NCCL is not exercised" in G.step_layout(1).note


def _fake_runner(statuses, calls):
    def run(name, work_dir, timeout_s):
        calls.append((name, timeout_s))
        return G.CheckResult(name, statuses[name])

    return run


def test_run_all_skips_after_a_failed_prerequisite(tmp_path):
    calls, lines = [], []
    statuses = {"sglang-features": G.SKIP, "splitserve-step": G.FAIL, "export": G.PASS,
                "sglang-dspark": G.PASS}
    results = G.run_all(tmp_path, 400, emit=lines.append, runner=_fake_runner(statuses, calls))
    # check 4 serves a draft of its own (gpu_check_memorise), not check 3's export
    assert [c[0] for c in calls] == ["sglang-features", "splitserve-step", "sglang-dspark"]
    assert [r.status for r in results] == [G.SKIP, G.FAIL, G.SKIP, G.PASS]
    assert "needs splitserve-step" in results[2].reason
    assert lines == [r.line() for r in results]
    assert calls[0][1] == G.CHECK_CAPS_S["sglang-features"]


def test_run_all_respects_the_time_limit(tmp_path):
    calls = []
    statuses = dict.fromkeys(G.CHECK_ORDER, G.PASS)
    results = G.run_all(tmp_path, 60, emit=lambda _: None, runner=_fake_runner(statuses, calls))
    assert calls and all(timeout <= 60 for _, timeout in calls)

    def slow(name, work_dir, timeout_s):
        time.sleep(0.3)
        return G.CheckResult(name, G.PASS)

    results = G.run_all(tmp_path, G.MIN_START_S + 0.2, emit=lambda _: None, runner=slow)
    assert results[0].status == G.PASS
    assert [r.status for r in results[1:]] == [G.FAIL, G.SKIP, G.FAIL]
    assert "not run" in results[1].reason and "--time-limit-s" in results[1].reason
    assert "not run" in results[3].reason  # check 4 needs no earlier check, only time


def test_run_logged_kills_the_process_group_at_the_timeout(tmp_path):
    # a shell, not a Python: it says "started" well within the 2 s even on a loaded machine
    script = "sleep 60 & echo started; sleep 60"
    start = time.monotonic()
    done = G.run_logged(["sh", "-c", script], log=tmp_path / "logs" / "slow.log", timeout_s=2)
    assert done.timed_out and time.monotonic() - start < 30
    result = G.failed_command("slow", "the check", done)
    assert result.status == G.FAIL and "did not finish within" in result.reason
    assert "started" in result.reason  # the log's tail
    assert G.read_child_result(done.log) is None


def test_read_child_result_takes_the_last_tagged_line(tmp_path):
    log = tmp_path / "c.log"
    good = G.CheckResult("export", G.PASS, {"tensors": 3})
    log.write_text("noise\n" + G.RESULT_TAG + G.CheckResult("export", G.FAIL).to_json() + "\n"
                   + G.RESULT_TAG + good.to_json() + "\ntrailing\n")
    assert G.read_child_result(log) == good
    done = G.run_logged([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                        log=tmp_path / "d.log", timeout_s=30)
    assert done.returncode == 3
    assert "exited with status 3" in G.failed_command("x", "the check", done).reason


def test_a_child_check_gets_a_shorter_limit_and_cleans_up_when_stopped(tmp_path, monkeypatch):
    """The child used to run with the 450 s default whatever its share of the limit; and a
    SIGTERM at its cap ended it without its finally blocks, orphaning the servers it had
    started in their own sessions."""
    seen = {}

    def fake_run_logged(command, *, log, timeout_s, **kwargs):
        seen["command"], seen["timeout_s"] = list(command), timeout_s
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        return G.Finished(0, 0.1, log)

    monkeypatch.setattr(G, "run_logged", fake_run_logged)
    G.run_child("export", tmp_path, 120.0)
    assert seen["timeout_s"] == 120.0
    assert seen["command"][-2:] == ["--time-limit-s", f"{120.0 - G.CHILD_MARGIN_S:g}"]

    marker = tmp_path / "cleaned"
    script = (
        "import time, pathlib\n"
        "from draftforge.splitserve import gpu_check as G\n"
        "def check(name, setup, timeout_s):\n"
        "    try:\n"
        "        print('started', flush=True); time.sleep(60)\n"
        "    finally:\n"
        f"        pathlib.Path({str(marker)!r}).write_text('stopped its servers')\n"
        "G.run_check_here = check\n"
        "G.gpu_setup = lambda work_dir, gpus: None\n"
        f"raise SystemExit(G._child_main('export', pathlib.Path({str(tmp_path)!r}), 30.0))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert marker.read_text() == "stopped its servers"


# --------------------------------------------------------------------------- checks 2 and 3 on CPU


@pytest.mark.distributed
def test_step_and_export_checks_run_end_to_end_on_cpu(tmp_path):
    import yaml
    from splitserve_helpers import tiny_recipe, write_conversations

    (tmp_path / "t").mkdir()
    template = yaml.safe_load(tiny_recipe(tmp_path / "t", steps=1).read_text())
    data = write_conversations(tmp_path / "convs.jsonl", 8)
    setup = G.Setup(
        work_dir=tmp_path / "work", num_gpus=0, target=template["target"], draft=template["draft"],
        layout=G.step_layout(0),
        data={"train_files": [str(data)], "regenerate": False, "max_length": 96},
    )
    step = G.check_splitserve_step(setup, timeout_s=240)
    assert step.status == G.PASS, step.line()
    assert step.name == "splitserve-step/gloo"
    assert step.figures["step"] == 1 and math.isfinite(step.figures["loss"]) and step.figures["samples"] > 0
    exported = G.check_export(setup, timeout_s=240)
    assert exported.status == G.PASS, exported.line()
    assert exported.figures["tensors"] > 10 and exported.figures["max_abs_diff"] == 0.0
    assert (setup.export_dir / "config.json").is_file()
