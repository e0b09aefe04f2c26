"""Check 4 of ``make gpu-check``: SGLang serving the exported draft with DSPARK, against
draftforge's evaluator on the same prompts (see :mod:`draftforge.splitserve.gpu_check`).

Runs only where the installed SGLang has the DSPARK algorithm: a draft is fitted to
the greedy answers of the check's prompts (:mod:`draftforge.splitserve.gpu_check_memorise`:
a draft that accepts nothing could not show that SGLang loaded it), an SGLang server
bound to 127.0.0.1 serves the target with that draft's export, and its reported
tokens per verification step are compared with ``speculative_decode``'s (greedy,
fixed length).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftforge.signals import interrupts_held
from draftforge.splitserve.gpu_check import (
    FAIL,
    PASS,
    PROMPTS,
    SGLANG_DTYPE,
    SKIP,
    CheckResult,
    Setup,
    child_env,
    free_port,
    log_tail,
    prompt_batch,
    stop_group,
)
from draftforge.splitserve.gpu_check_memorise import Memorised, memorise_draft

# Check 4: tokens per target verification step, SGLang against draftforge. The two
# decode the same prompts greedily for the same number of tokens, but SGLang runs the
# target and the draft in bf16 with its own kernels while draftforge's evaluator runs
# float32: after a near-tie the greedy texts part, and marginal draft tokens flip.
# Pooled tokens per step must agree within ACCEPT_REL_TOL. That alone is weak: a
# definition slip of one step per request (prefill counted as a verification step, a
# missed bonus round) moves tokens per step by a factor n / (n + 1) for n steps, about
# 5 % at 3 tokens per step over 64 tokens and 1.6 % at 1 token per step. So requests
# whose output tokens are identical on both sides are also compared step for step:
# their mean difference in verification steps (SGLang's minus draftforge's) must be
# within STEP_DIFF_TOL, which one extra step on every such request exceeds.
# A draft that accepts (almost) nothing makes every count ~1 token per step whatever
# SGLang does with it, so the comparison is refused below MIN_TOK_PER_STEP
# (draftforge's tokens per step): it could not show that SGLang loaded the draft.
ACCEPT_REL_TOL = 0.10
STEP_DIFF_TOL = 0.5
MIN_TOK_PER_STEP = 1.3
SERVER_MEM_FRACTION = 0.5  # of the GPU, for SGLang's weights and KV pool (plenty at 135M)


@dataclass(frozen=True)
class SpecCounts:
    """One request's speculative-decoding counts as SGLang reports them."""

    completion_tokens: int
    verify_steps: int  # spec_verify_ct: target verification forwards
    reported_accept_length: float | None  # spec_accept_length = completion_tokens / verify_steps
    output_ids: tuple[int, ...] = ()


def parse_sglang_reply(reply: Any, *, index: int = 0) -> SpecCounts:
    """The counts of one ``/generate`` reply; ValueError naming what is missing.

    SGLang (0.5.23, ``TokenizerManager._calculate_spec_decoding_metrics``) puts
    ``completion_tokens`` in every reply's ``meta_info`` and, once a request was
    verified at least once, ``spec_verify_ct`` and ``spec_accept_length``
    (``completion_tokens / spec_verify_ct``: the first token comes from the
    prefill, every verification step adds its accepted drafts plus one).
    """
    if not isinstance(reply, Mapping) or not isinstance(reply.get("meta_info"), Mapping):
        raise ValueError(f"reply {index}: no meta_info object in {str(reply)[:200]}")
    meta = reply["meta_info"]
    if "completion_tokens" not in meta:
        raise ValueError(f"reply {index}: meta_info has no completion_tokens (keys {sorted(meta)})")
    if "spec_verify_ct" not in meta:
        raise ValueError(
            f"reply {index}: meta_info has no spec_verify_ct (keys {sorted(meta)}): the server ran "
            "no speculative verification; was it started with --speculative-algorithm DSPARK?")
    try:
        completion = int(meta["completion_tokens"])
        verify = int(meta["spec_verify_ct"])
        reported = meta.get("spec_accept_length")
        reported = None if reported is None else float(reported)
        output = tuple(int(t) for t in reply.get("output_ids") or ())
    except (TypeError, ValueError) as err:
        raise ValueError(f"reply {index}: malformed counts in meta_info ({err})") from None
    if completion < 0 or verify <= 0:
        raise ValueError(f"reply {index}: completion_tokens {completion}, spec_verify_ct {verify}")
    return SpecCounts(completion, verify, reported, output)


def tokens_per_step(pairs: Sequence[tuple[int, int]]) -> float:
    """Pooled tokens per verification step: sum of tokens / sum of steps."""
    steps = sum(s for _, s in pairs)
    return sum(t for t, _ in pairs) / steps if steps else math.nan


def compare_acceptance(
    sglang: Sequence[SpecCounts], ours: Sequence[tuple[int, int]],
    outputs: Sequence[Sequence[int]], *, tol: float = ACCEPT_REL_TOL,
    step_tol: float = STEP_DIFF_TOL, min_tok_per_step: float = MIN_TOK_PER_STEP,
) -> tuple[bool, dict[str, Any], str]:
    """SGLang's tokens per verification step against draftforge's evaluator on the same prompts.

    ``ours``: (output tokens, verification rounds) per prompt from
    ``speculative_decode`` (its first token also comes from the prefill, so
    tokens / rounds is SGLang's ``completion_tokens / spec_verify_ct``);
    ``outputs``: draftforge's output tokens per prompt. Fails when draftforge's
    pooled tokens per step is below ``min_tok_per_step`` (uninformative), when the
    pooled figures differ by more than ``tol``, or when the requests that decoded
    identical tokens differ by more than ``step_tol`` verification steps on average.
    """
    if len(sglang) != len(ours) or len(outputs) != len(ours) or not ours:
        return False, {}, f"{len(sglang)} SGLang replies for {len(ours)} prompts"
    theirs = tokens_per_step([(c.completion_tokens, c.verify_steps) for c in sglang])
    mine = tokens_per_step(list(ours))
    rel = abs(theirs - mine) / mine if mine else math.inf
    same = [i for i, (c, o) in enumerate(zip(sglang, outputs, strict=True))
            if c.output_ids and tuple(c.output_ids) == tuple(int(t) for t in o)]
    step_diff = (sum(sglang[i].verify_steps - ours[i][1] for i in same) / len(same)
                 if same else math.nan)
    figures = {"sglang_tok_per_step": theirs, "draftforge_tok_per_step": mine, "rel_diff": rel,
               "tol": tol, "sglang_tokens": sum(c.completion_tokens for c in sglang),
               "draftforge_tokens": sum(t for t, _ in ours), "same_output_requests": len(same),
               "mean_step_diff": step_diff}
    if not mine >= min_tok_per_step:
        return False, figures, (
            f"uninformative: draftforge's draft makes only {mine:.3g} tokens per verification "
            f"step on these prompts (< {min_tok_per_step}); a draft that accepts this little "
            "gives the same counts whether or not SGLang loaded it correctly")
    problems = []
    if figures["sglang_tokens"] != figures["draftforge_tokens"]:
        problems.append(f"SGLang decoded {figures['sglang_tokens']} tokens, draftforge "
                        f"{figures['draftforge_tokens']} (both should stop at max_new_tokens)")
    if not rel <= tol:
        problems.append(f"tokens per verification step differ by {rel:.1%} > {tol:.0%}")
    if not same:
        problems.append("no request decoded identical tokens on both sides, so verification "
                        "steps could not be compared request by request")
    elif not abs(step_diff) <= step_tol:
        problems.append(f"on the {len(same)} requests with identical outputs SGLang took "
                        f"{step_diff:+.2f} verification steps per request against draftforge "
                        f"(allowed +/-{step_tol}): a step counted differently?")
    reason = "; ".join(problems) or (
        f"tokens per verification step agree within {tol:.0%}; on {len(same)} requests with "
        f"identical outputs the steps differ by {step_diff:+.2f} per request (allowed "
        f"+/-{step_tol})")
    return not problems, figures, reason


def sglang_has_dspark() -> tuple[bool, str]:
    """(True, version) when the installed SGLang knows the DSPARK algorithm, else (False, why)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return False, "sglang is not installed"
    version = importlib.metadata.version("sglang")
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    except Exception as err:  # an SGLang that does not import here cannot serve either
        return False, f"sglang {version}: its speculative module does not import ({err})"
    if not hasattr(SpeculativeAlgorithm, "DSPARK"):
        return False, f"sglang {version} has no DSPARK speculative algorithm"
    return True, version


def sglang_server_command(model: str, draft: str, port: int, *, block_size: int,
                          dtype: str = SGLANG_DTYPE,
                          mem_fraction: float = SERVER_MEM_FRACTION) -> list[str]:
    """SGLang's server with the DSPARK draft, on 127.0.0.1 only (flags of SGLang 0.5.23).

    The verify width is given, block + 1 (the contract's speculative_num_draft_tokens):
    SGLang would read it from the draft's config, but falls back to 7 drafts when that read
    fails, which a block of 8 would not survive unnoticed."""
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", draft,
        "--speculative-num-draft-tokens", str(block_size + 1),
        "--mem-fraction-static", str(mem_fraction), "--skip-server-warmup",
        # start-up time matters more than speed here: no CUDA graph capture
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    ]


def generate_request(input_ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    """A greedy, fixed-length ``/generate`` request (EOS ignored: both sides decode the same count)."""
    return {"input_ids": [int(t) for t in input_ids],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens),
                                "ignore_eos": True}}


# the server this check starts listens on loopback: its requests never go through a proxy
# (urllib's default opener sends them to $http_proxy unless $no_proxy lists the host)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(url: str, payload: dict | None = None, timeout_s: float = 60.0) -> tuple[int, Any]:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            body = response.read()
            return response.status, json.loads(body) if body.strip() else None
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")[:500]


def wait_until_ready(base: str, proc: subprocess.Popen, deadline: float) -> str | None:
    """None once ``/health`` answers 200; otherwise why not (the server exited, or the deadline:
    the reason says how long the server had, which fitting the draft may have left short)."""
    start = time.monotonic()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode} while starting"
        try:
            status, _ = _http(f"{base}/health", timeout_s=5)
            if status == 200:
                return None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    return (f"the server was not ready within the {time.monotonic() - start:.0f} s the time "
            "limit left it (--time-limit-s)")


def serve_and_count(setup: Setup, model: str, prompts: Sequence[Sequence[int]],
                    deadline: float, *, draft_dir: Path) -> list[SpecCounts] | str:
    """Start SGLang with the draft exported to ``draft_dir``, send ``prompts``; the counts,
    or why it failed."""
    port = free_port()
    log = setup.log_dir / "sglang-server.log"
    block_size = json.loads((draft_dir / "config.json").read_text())["block_size"]
    command = sglang_server_command(model, str(draft_dir), port, block_size=block_size)
    base = f"http://127.0.0.1:{port}"
    proc: subprocess.Popen | None = None
    try:
        # interrupts held: one landing inside Popen would leave the server running, unstopped
        with log.open("w") as out, interrupts_held():
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=child_env())
        problem = wait_until_ready(base, proc, deadline)
        if problem is not None:
            return f"{problem}; log {log}: {log_tail(log)}"
        counts = []
        for index, prompt in enumerate(prompts):
            try:
                status, reply = _http(f"{base}/generate",
                                      generate_request(prompt, setup.max_new_tokens),
                                      timeout_s=max(5.0, deadline - time.monotonic()))
            except OSError as err:  # the server died or hung mid-request: its log says why
                return (f"/generate of prompt {index} failed ({type(err).__name__}: {err}); "
                        f"log {log}: {log_tail(log)}")
            if status != 200:
                return (f"/generate of prompt {index} answered {status}: {str(reply)[:300]}; "
                        f"log {log}: {log_tail(log)}")
            counts.append(parse_sglang_reply(reply, index=index))
        return counts
    finally:
        if proc is not None:
            stop_group(proc)


def memorise_for_check(setup: Setup, model: str, prompts: Sequence[Sequence[int]]) -> Memorised:
    """A draft of the check's shape fitted to the greedy answers of ``prompts`` and exported to
    ``setup.memorised_dir``, on the target that :func:`draftforge_counts` decodes with
    (float32 on cuda:0); the target is released before SGLang starts."""
    import gc

    import torch

    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.splitserve.target import build_target

    cfg = TargetConfig(model=model, dtype="float32")
    layers = [int(i) for i in setup.draft["target_layer_ids"]]
    target = build_target(cfg, layers, device=torch.device("cuda", 0))
    try:
        return memorise_draft(target, setup.draft, resolve_target_shape(cfg), prompts,
                              max_new_tokens=setup.max_new_tokens, out_dir=setup.memorised_dir,
                              progress=lambda line: print(line, flush=True))
    finally:
        del target
        gc.collect()
        torch.cuda.empty_cache()


def draftforge_counts(setup: Setup, model: str, prompts: Sequence[Sequence[int]], *,
                      draft_dir: Path):
    """draftforge's evaluator with the draft exported to ``draft_dir`` on the same prompts:
    (tokens, rounds) per prompt, outputs, summary."""
    import torch

    from draftforge.eval.harness import summarize
    from draftforge.eval.speculative import (
        DecodeSettings,
        DraftProposer,
        TargetSession,
        speculative_decode,
    )
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import build_target
    from draftforge.train.hf_load import load_exported_draft

    device = torch.device("cuda", 0)
    layers = [int(i) for i in setup.draft["target_layer_ids"]]
    # float32, as `draftforge eval` runs by default: its greedy output is plain decoding's
    target = build_target(TargetConfig(model=model, dtype="float32"), layers, device=device)
    draft = load_exported_draft(draft_dir, target=target, dtype=torch.float32, device=device)
    session = TargetSession(target.model, layers)
    settings = DecodeSettings(max_new_tokens=setup.max_new_tokens, temperature=0.0, verify="full",
                              eos_token_ids=())
    results = []
    for index, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(index)
        proposer = DraftProposer(draft, temperature=0.0, generator=generator)
        results.append(speculative_decode(session, list(prompt), proposer, settings,
                                          generator=generator))
    summary = summarize(results, draft.config.block_size)
    return [(len(r.tokens), len(r.rounds)) for r in results], [r.tokens for r in results], summary


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_sglang_dspark(setup: Setup, deadline: float) -> CheckResult:
    """Check 4: SGLang serving a draft that memorised the prompts' answers, against
    draftforge's evaluator."""
    name = "sglang-dspark"
    ok, detail = sglang_has_dspark()
    if not ok:
        return CheckResult(name, SKIP, reason=detail)
    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import load_tokenizer

    model = str(smollm2.ensure_smollm2())
    input_ids, mask = prompt_batch(load_tokenizer(TargetConfig(model=model)), PROMPTS)
    prompts = [row[: int(n)].tolist() for row, n in zip(input_ids, mask.sum(dim=1), strict=True)]
    memorised = memorise_for_check(setup, model, prompts)
    fit = {"memorise_loss": memorised.loss, "memorise_s": round(memorised.wall_s, 1)}
    # leave a third of the time for draftforge's side
    served = serve_and_count(setup, model, prompts,
                             deadline=time.monotonic() + (deadline - time.monotonic()) * 2 / 3,
                             draft_dir=memorised.folder)
    if isinstance(served, str):
        return CheckResult(name, FAIL, {"sglang": detail, **fit}, served)
    ours, outputs, summary = draftforge_counts(setup, model, prompts, draft_dir=memorised.folder)
    passed, figures, reason = compare_acceptance(served, ours, outputs)
    same = [common_prefix(c.output_ids, o) for c, o in zip(served, outputs, strict=True)]
    figures.update(draftforge_al=summary["acceptance_length"],
                   same_prefix_tokens=min(same) if same else 0, sglang=detail, **fit)
    return CheckResult(name, PASS if passed else FAIL, figures, reason)
