"""``draftforge eval llamacpp EXPORT --recipe RECIPE``: does llama.cpp serve the export as draftforge does?

An independent implementation is the strongest check of an export's conventions
(slot offset, layer indices, mask token, Markov inputs, confidence head). This
command converts the export and the target with llama.cpp's own converter,
decodes each prompt greedily with llama.cpp's ``draft-dspark`` speculative
decoding (``llama-speculative-simple``), and decodes the same token ids (as
``llama-tokenize`` makes them) with draftforge's draft and target on the same
schedule (:func:`replay`). Where the two implementations agree, every round is
the same: as many tokens drafted and accepted, the same token last, and the
same text in the end.

llama.cpp schedules rounds a little differently from ``draftforge eval``: its
first round drafts from the prompt's last token (so the first answer token is
drafted too), a round drafts no more than the budget leaves (but a whole block
once nothing is left), it accepts no draft after an end-of-turn draft, and it
stops once more than ``max_new_tokens`` tokens are out. The replay follows that
schedule, so the two sides are compared round for round; their acceptance
lengths are close to, not equal to, ``draftforge eval``'s.

Both sides run the target in float32 (llama.cpp from an f32 GGUF), greedily,
but add up in different orders, so a choice between two logits closer than
``--tie-tolerance`` may go either way, and so may a confidence logit that close
to the ``--p-min`` cut (in logit space); from there the two decode
differently. Such a prompt is reported as a near-tie, with the round and margin.
A prompt on which llama.cpp fails (an abort while loading the export, a run past
``--timeout-s``) is reported as an error and counts as a difference.
Exit status 0 when no prompt differs otherwise, 1 when one does, 2 for bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftforge import argtypes
from draftforge.errors import InputError
from draftforge.eval.llamacpp import TOKENIZER, TOOL

STATUSES = ("agree", "near-tie", "differ", "error")


@dataclass
class Replay:
    """draftforge's side of one prompt, counted as llama.cpp counts it."""

    prompt_tokens: int
    predicted: int
    drafted: int
    accepted: int
    tokens: list[int]  # emitted, up to and including an end-of-turn token
    round_log: list[tuple[int, int, int]] = field(default_factory=list)  # (accepted, drafted, last token)
    round_drafts: list[list[int]] = field(default_factory=list)  # each round's verified drafts
    # per round: the smallest top-1 minus top-2 logit among the target positions and the draft
    # slots whose choice decided the round (what a small numerical difference could flip)
    target_margins: list[float] = field(default_factory=list)
    draft_margins: list[float] = field(default_factory=list)
    # with p_min: how far the confidence logits that decided the cut lay from logit(p_min), and the
    # smallest margin among the draft slots whose choice fed one of them (the Markov head's input)
    confidence_margins: list[float] = field(default_factory=list)
    cut_draft_margins: list[float] = field(default_factory=list)
    # the same per round, position by position, to read the one where the two sides part: the
    # target's margin at each position it verified (0 .. accepted), the draft's at each slot drafted,
    # and each confidence logit's distance from logit(p_min) (with p_min, up to the budget)
    target_position_margins: list[list[float]] = field(default_factory=list)
    draft_slot_margins: list[list[float]] = field(default_factory=list)
    confidence_slot_margins: list[list[float]] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return self.predicted - self.accepted


def replay(session, proposer, prompt: Sequence[int], *, max_new_tokens: int, eos: set[int],
           p_min: float = 0.0) -> Replay:
    """Greedy speculative decoding of ``prompt`` on llama-speculative-simple's schedule.

    ``session`` is a :class:`~draftforge.eval.speculative.TargetSession` capturing the
    draft's layers and ``proposer`` a :class:`~draftforge.eval.speculative.DraftProposer`
    (with ``record_margins``, so that a near-tie in the draft can be told apart).
    The anchor of the first round is the prompt's last token. A round drafts a block cut to
    ``max_new_tokens - emitted - 1`` tokens, or the whole block once that is 0 or less
    (``common_speculative_draft`` truncates only to a positive limit), and cut again before
    the first slot whose confidence (sigmoid of the head's logit) is below ``p_min`` when
    ``p_min > 0``. An accepted end-of-turn draft before the block's last slot is the round's
    target token (``common_sampler_sample_and_accept_n`` stops there: the drafts after it are
    not accepted). The loop stops after an end-of-turn token or once more than
    ``max_new_tokens`` tokens are out."""
    import torch

    from draftforge.eval.speculative import confidence_cut, greedy_accept, top2_margins

    proposer.start()
    _, features = session.prefill(list(prompt[:-1]))
    sequence, anchor = list(prompt[:-1]), prompt[-1]
    run = Replay(len(prompt), 0, 0, 0, [])
    while True:
        sequence.append(anchor)
        proposal = proposer.propose(sequence, features)
        budget = max_new_tokens - run.predicted - 1
        drafts = proposal.tokens[:budget] if budget > 0 else proposal.tokens
        confidence_margin = cut_draft_margin = float("inf")
        confidence_slots = []
        if p_min > 0:
            logits_c = proposal.confidence_logits[: len(drafts)]
            cut = confidence_cut(logits_c, p_min)
            threshold = math.log(p_min / (1 - p_min)) if p_min < 1 else math.inf
            confidence_slots = [abs(z - threshold) for z in logits_c]
            if logits_c:  # the slots kept and the one that cut the block; slot k's reads slot k-1's token
                confidence_margin = min(abs(z - threshold) for z in logits_c[: cut + 1])
                cut_draft_margin = min((proposal.margins or [])[: min(cut, len(logits_c) - 1)], default=float("inf"))
            drafts = drafts[:cut]
        run.confidence_margins.append(confidence_margin)
        run.cut_draft_margins.append(cut_draft_margin)
        anchor_pos = len(sequence) - 1
        logits, aux = session.extend([anchor] + drafts)
        hits, bonus = greedy_accept(drafts, logits)
        # an end-of-turn draft before the block's last slot ends the round once accepted: llama.cpp
        # accepts no draft after it and counts it as the round's target token
        end = next((k for k, token in enumerate(drafts[:hits]) if token in eos and k + 1 < len(drafts)), None)
        if end is not None:
            hits, bonus = end, drafts[end]
        session.crop(anchor_pos + 1 + hits)
        features = torch.cat([features, aux[: hits + 1]], dim=0)
        positions = top2_margins(logits[: hits + 1]).tolist()
        run.target_margins.append(min(positions))
        decided = (proposal.margins or [])[: min(hits + 1, len(drafts))]
        run.draft_margins.append(min(decided, default=float("inf")))
        run.target_position_margins.append(positions)
        run.draft_slot_margins.append(list((proposal.margins or [])[: len(drafts)]))
        run.confidence_slot_margins.append(confidence_slots)
        out = drafts[:hits] + [bonus]
        run.drafted, run.accepted, run.predicted = run.drafted + len(drafts), run.accepted + hits, run.predicted + len(out)
        sequence.extend(drafts[:hits])
        ended = False
        for token in out:
            run.tokens.append(token)
            if token in eos:
                ended = True
                break
        run.round_log.append((hits, len(drafts), run.tokens[-1]))
        run.round_drafts.append(list(drafts))
        anchor = out[-1]
        if ended or run.predicted > max_new_tokens:
            return run


@dataclass
class PromptCheck:
    """One prompt decoded by both: ``status`` is ``agree`` (every round the same: drafted,
    accepted, last token, and the drafted tokens where llama.cpp's log lists them; and the same
    text), ``near-tie`` (the first round that differs is one
    where draftforge's target or draft had two choices within ``tie_tolerance`` logits, or a
    confidence logit that close to the ``p_min`` cut, that could have made the difference: float32
    arithmetic in a different order may go either way), ``differ``, or ``error`` (llama.cpp
    failed on it: no counts, the reason in ``detail``)."""

    workload: str
    index: int
    llamacpp: dict
    draftforge: dict
    same_tokenization: bool | None  # transformers' token ids equal llama.cpp's (both decode
    # llama.cpp's); None where llama-tokenize failed on the prompt (status error)
    status: str
    detail: str = ""


def same_text(printed: str, tokenizer, tokens: Sequence[int]) -> bool:
    """Whether llama.cpp's printed text is ``tokens`` decoded as it prints them: its pieces as
    they are, without the clean-up of spaces before punctuation that a tokenizer with
    ``clean_up_tokenization_spaces`` applies by default (" ." would read as ".")."""
    return printed == tokenizer.decode(list(tokens), clean_up_tokenization_spaces=False)


def classify(theirs, ours: Replay, *, tie_tolerance: float, same_text: bool) -> tuple[str, str]:
    """(status, detail) of one prompt; see :class:`PromptCheck`.

    Rounds are compared in order. A differing round that is a near-tie but emits the same
    tokens (only the number drafted differs, from a confidence cut) is noted and the
    comparison goes on; one that accepts or emits differently ends it, since the rounds no
    longer line up from there. Prompts of different lengths are not compared at all. Where
    every round and the text agree, the drafted tokens are compared (:func:`_compare_drafts`)."""
    if theirs.prompt_tokens != ours.prompt_tokens:  # llama-tokenize and the tool tokenized differently
        return "differ", (
            f"llama.cpp decoded a prompt of {theirs.prompt_tokens} tokens, draftforge one of "
            f"{ours.prompt_tokens} (tokenization: {TOKENIZER} and {TOOL} disagree)"
        )
    notes = []
    for i, (a, b) in enumerate(zip(theirs.round_log, ours.round_log, strict=False)):
        if a == b:
            continue
        where = f"round {i + 1} of {len(ours.round_log)}"
        tie = _near_tie(ours, i, tie_tolerance, a, b)
        if tie is None:
            return "differ", (
                f"{where}: llama.cpp {a} against draftforge {b} (accepted, drafted, last token); "
                f"margins target {ours.target_margins[i]:.3g}, draft {ours.draft_margins[i]:.3g}"
                + (f", confidence {ours.confidence_margins[i]:.3g}" if ours.confidence_margins else "")
            )
        notes.append(f"{where}: {tie}")
        if (a[0], a[2]) != (b[0], b[2]):  # accepted or emitted differently: rounds part here
            return "near-tie", "; ".join(notes)
    if len(theirs.round_log) != len(ours.round_log):
        return "differ", f"llama.cpp decoded {len(theirs.round_log)} rounds, draftforge {len(ours.round_log)}"
    if not same_text:
        return "differ", "the same rounds but a different text"
    drafted = _compare_drafts(theirs, ours, tie_tolerance)
    if drafted is not None:
        status, detail = drafted
        if status == "differ":
            return status, detail
        notes.append(detail)
    return ("near-tie", "; ".join(notes)) if notes else ("agree", "")


def _compare_drafts(theirs, ours: Replay, tolerance: float) -> tuple[str, str] | None:
    """The drafted tokens themselves, round by round, where the rounds agree: the first round
    whose drafts differ, as ``differ``, or as ``near-tie`` where draftforge's draft had its top two
    logits within ``tolerance`` at the first differing slot (from there the Markov chain reads
    another token); None where every verified draft is the same. Not compared where llama.cpp's
    log had no candidate lines that line up with its rounds."""
    drafts = getattr(theirs, "round_drafts", None) or []
    if not drafts or len(drafts) != len(ours.round_drafts):
        return None
    for i, (log, mine) in enumerate(zip(drafts, ours.round_drafts, strict=True)):
        if theirs.round_log[i] != ours.round_log[i]:
            continue  # a near-tie round, said already
        verified = log[: len(mine)]
        if verified == mine:
            continue
        slot = next((k for k, (a, b) in enumerate(zip(verified, mine, strict=False)) if a != b), len(verified))
        margins = ours.draft_slot_margins[i] if i < len(ours.draft_slot_margins) else []
        margin = margins[slot] if slot < len(margins) else math.inf
        where = (f"round {i + 1} of {len(ours.round_log)}, slot {slot}: llama.cpp drafted "
                 f"{verified[slot] if slot < len(verified) else 'nothing'}, draftforge "
                 f"{mine[slot] if slot < len(mine) else 'nothing'} (same accepted run and target token)")
        if margin < tolerance:
            return "near-tie", f"{where}: the draft's top two logits are {margin:.2g} apart"
        return "differ", f"{where}; draft margin {margin:.3g}"
    return None


def _near_tie(ours: Replay, i: int, tolerance: float, theirs: tuple, mine: tuple) -> str | None:
    """What made round ``i`` a near-tie on draftforge's side, or None, given the round as llama.cpp
    (``theirs``) and draftforge (``mine``) logged it: (accepted, drafted, last token). Only a close
    choice that could have made the difference counts: where the two drafted different numbers of
    tokens, the confidence cut or a draft choice feeding it (the target chooses after the block is
    drafted); else the target's or the draft's (the same number drafted is the same cut).

    Where the positions are known, only the one where the two sides part is read: with ``c`` the
    fewer drafted, the confidence of slot ``c`` (both kept the slots before it) and the draft's
    choices at slots 0 .. c-1 (the Markov chain feeding it); with ``p`` the fewer accepted, the
    target's choice at position ``p`` (both accepted the drafts before it: a different choice there
    would have rejected one) and, when the two accepted differently, the draft's at slot ``p``."""
    if theirs[1] != mine[1]:
        c = min(theirs[1], mine[1])
        if i < len(ours.confidence_slot_margins) and i < len(ours.draft_slot_margins):
            slots = ours.confidence_slot_margins[i]
            margins = {"confidence": slots[c] if c < len(slots) else math.inf,
                       "draft": min(ours.draft_slot_margins[i][:c], default=math.inf)}  # fmt: skip
        else:
            margins = {
                "confidence": ours.confidence_margins[i] if ours.confidence_margins else math.inf,
                "draft": ours.cut_draft_margins[i] if ours.cut_draft_margins else math.inf,
            }
    elif i < len(ours.target_position_margins) and i < len(ours.draft_slot_margins):
        p = min(theirs[0], mine[0])
        positions, slots = ours.target_position_margins[i], ours.draft_slot_margins[i]
        margins = {"target": positions[p] if p < len(positions) else math.inf,
                   "draft": slots[p] if theirs[0] != mine[0] and p < len(slots) else math.inf}  # fmt: skip
    else:
        margins = {"target": ours.target_margins[i], "draft": ours.draft_margins[i]}
    side = min(margins, key=margins.get)
    if margins[side] >= tolerance:
        return None
    if side == "confidence":
        return f"a confidence logit lies {margins[side]:.2g} from the --p-min cut"
    return f"the {side}'s top two logits are {margins[side]:.2g} apart"


def _counts(run) -> dict:
    return {k: getattr(run, k) for k in ("prompt_tokens", "predicted", "drafted", "accepted")}


def _al(checks: Sequence[PromptCheck], side: str) -> float:
    """Acceptance length the way servers count it: tokens emitted over rounds, pooled (errors,
    without counts, left out)."""
    predicted = sum(getattr(c, side).get("predicted", 0) for c in checks)
    rounds = sum(getattr(c, side).get("predicted", 0) - getattr(c, side).get("accepted", 0) for c in checks)
    return predicted / rounds if rounds else float("nan")


def build_parser() -> argparse.ArgumentParser:
    from draftforge.data.workloads import WORKLOAD_NAMES

    parser = argparse.ArgumentParser(
        prog="draftforge eval llamacpp",
        description="Convert an export and its target with llama.cpp's converter, decode the workload "
        "prompts greedily with llama.cpp's draft-dspark speculative decoding and with draftforge on the "
        "same schedule, and check that every round (drafted, accepted, last token) agrees. Exit status "
        "0 when no prompt differs beyond a float32 near-tie, 1 when one does or llama.cpp fails on one, "
        "2 for refused input.",
    )
    parser.add_argument("draft", metavar="EXPORT", help="an export folder (draftforge export --out)")
    parser.add_argument("--recipe", required=True, help="the recipe whose target section names the target")
    parser.add_argument("--target", help="override the recipe's target: registered name or local HF folder")
    parser.add_argument("--workloads", type=argtypes.names(WORKLOAD_NAMES),
                        help="comma-separated subset of humaneval,mtbench,gsm8k (default: all three)")
    parser.add_argument("--num-prompts", type=argtypes.positive_int, default=8,
                        help="prompts per workload, the first ones (default 8)")
    parser.add_argument("--max-new-tokens", type=argtypes.positive_int, default=128,
                        help="llama.cpp's -n (default 128)")
    parser.add_argument("--p-min", type=argtypes.probability, default=0.0,
                        help="confidence threshold: llama.cpp's --spec-draft-p-min, a block is cut "
                        "before its first slot below it (default 0: full blocks)")
    parser.add_argument("--llama-cpp", metavar="DIR",
                        help="a llama.cpp checkout with build/bin/llama-speculative-simple and "
                        "build/bin/llama-tokenize (default: the source of llama-cpp-python 0.3.36, "
                        "fetched into the cache and built once)")
    parser.add_argument("--work-dir", help="where the f32 GGUF files go and stay, the target's at 4 bytes a "
                        "parameter, each named after its folder (target-NAME-DIGEST-f32.gguf, "
                        "draft-NAME-DIGEST-f32.gguf), so checks of other exports can share it "
                        "(default: a temporary folder, removed)")
    parser.add_argument("--threads", type=argtypes.positive_int, default=1, help="llama.cpp threads (default 1)")
    parser.add_argument("--tie-tolerance", type=argtypes.non_negative_float, default=0.01,
                        help="a first difference where draftforge's target or draft had its top two "
                        "logits closer than this, or a confidence logit this close to logit(p-min), is "
                        "a near-tie, not a failure (default 0.01)")
    parser.add_argument("--timeout-s", type=argtypes.positive_float, default=None, metavar="S",
                        help="longest llama.cpp run on one prompt before it counts as an error "
                        "(default 600 s plus 5 s a new token: 1240 s at --max-new-tokens 128)")
    parser.add_argument("--json", metavar="OUT.json",
                        help="also write every prompt's counts and status here, after each prompt")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``draftforge eval llamacpp``."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from draftforge.splitserve.supervisor import unwinding_on_sigterm

    # SIGTERM (timeout(1), a scheduler) unwinds like Ctrl-C: the converter or llama.cpp run is
    # stopped and the f32 GGUF files (4 bytes a parameter) and their temporary folder removed
    with unwinding_on_sigterm("draftforge eval llamacpp", "rerun the same command"):
        return _check_export(args)


def _check_json_spares_inputs(json_path: Path, args: argparse.Namespace) -> None:
    """Refuse a ``--json`` that would be written over what this run reads (the recipe, the
    export's files, a --target folder's), or over a file that is no earlier --json (a list of
    prompt checks): it is rewritten after every prompt."""
    where = json_path.resolve()
    if where == Path(args.recipe).expanduser().resolve():
        raise InputError(f"--json {args.json}: is the --recipe file, which this run reads; give a new "
                         "path, e.g. llamacpp.json")
    for option, folder in (("the export", args.draft), ("--target", args.target)):
        if folder and where.is_relative_to(Path(folder).expanduser().resolve()):
            raise InputError(f"--json {args.json}: is inside {option} {folder}, whose files this run "
                             f"reads; give a path outside it, e.g. {Path(folder).expanduser().resolve().parent / 'llamacpp.json'}")
    if json_path.is_file():
        try:
            earlier = json.loads(json_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            earlier = None
        if not (isinstance(earlier, list) and all(isinstance(c, dict) and {"workload", "llamacpp", "draftforge"} <= c.keys() for c in earlier)):
            raise InputError(f"--json {args.json}: an existing file that is not an earlier --json of "
                             "draftforge eval llamacpp, which this run would replace; give a new path or "
                             "move the file away")


def _check_export(args: argparse.Namespace) -> int:
    from draftforge.config import load_recipe
    from draftforge.eval import llamacpp
    from draftforge.files import check_folder_writable
    from draftforge.train.hf_load import config_from_serving, read_serving_config

    if args.json:  # refused now, not after the build, the conversions and the first prompt
        json_path = Path(args.json).expanduser()
        if json_path.is_dir():
            raise InputError(f"--json {args.json}: is a folder; give the path of the JSON file to "
                             f"write, e.g. {json_path / 'llamacpp.json'}")
        check_folder_writable(json_path.parent, "--json", args.json)
        _check_json_spares_inputs(json_path, args)
    if args.work_dir:  # likewise: the GGUF files are written there after the build
        check_folder_writable(Path(args.work_dir).expanduser(), "--work-dir", args.work_dir)
    draft_dir = Path(args.draft).expanduser()
    if not (draft_dir / "config.json").is_file():
        raise InputError(f"{draft_dir}: not an export folder (no config.json); run draftforge export first")
    raw_cfg = read_serving_config(draft_dir)
    draft_cfg = config_from_serving(raw_cfg, where=str(draft_dir / "config.json"))
    _check_llamacpp_can_run(draft_dir, draft_cfg)
    if args.p_min > 0 and not draft_cfg.enable_confidence_head:
        raise InputError(
            f"--p-min {args.p_min}: {draft_dir / 'config.json'} has no confidence head "
            "(enable_confidence_head false), so llama.cpp cannot cut its blocks; leave --p-min at 0"
        )
    target_cfg = load_recipe(args.recipe).target
    updates = {"dtype": "float32", "backend": "hf"} | ({"model": args.target} if args.target else {})
    target_cfg = target_cfg.model_copy(update=updates)
    target_dir = _target_folder(target_cfg)
    if not target_cfg.trust_remote_code:
        for folder, whose in ((target_dir, "target"), (draft_dir, "draft")):
            _refuse_own_code(folder, whose)

    if args.llama_cpp:
        source = Path(args.llama_cpp).expanduser()
        bin_dir = source / "build" / "bin"
        for need in (source / llamacpp.CONVERTER, bin_dir / llamacpp.TOOL, bin_dir / llamacpp.TOKENIZER):
            if not need.is_file():
                raise InputError(f"--llama-cpp {source}: no {need.relative_to(source)}")
    else:
        source = llamacpp.fetch_source(target_cfg.cache_dir)
        bin_dir = llamacpp.build_tools(source)

    with tempfile.TemporaryDirectory(prefix="draftforge-llamacpp-") as scratch:
        work = Path(args.work_dir).expanduser() if args.work_dir else Path(scratch)
        print(f"eval llamacpp: converting the target {target_dir} and the draft {draft_dir} (f32 GGUF, in {work})",
              flush=True)
        target_gguf = llamacpp.convert(source, target_dir, _gguf_path(work, "target", target_dir))
        draft_gguf = llamacpp.convert(source, draft_dir, _gguf_path(work, "draft", draft_dir), target_dir=target_dir)
        checks = _check_all(args, target_cfg, draft_cfg, draft_dir, bin_dir, target_gguf, draft_gguf)
    if args.work_dir:
        print(f"eval llamacpp: kept {target_gguf} and {draft_gguf}", flush=True)

    print(_table(checks))
    if args.p_min == 0 and draft_cfg.enable_confidence_head:
        print("  the draft's confidence head was not exercised (--p-min 0: every block verified "
              "whole, as serving's default); pass --p-min P to check llama.cpp's reading of it too")
    for c in checks:
        if c.status != "agree":
            print(f"  {c.status}: {c.workload} prompt {c.index}: {c.detail}")
    retokenized = [c for c in checks if c.same_tokenization is False]
    if retokenized:
        print(
            f"  {len(retokenized)} prompt(s) tokenized differently by transformers and llama.cpp: "
            + ", ".join(f"{c.workload} {c.index}" for c in retokenized)
            + " (both sides decoded llama.cpp's token ids)"
        )
    count = {status: sum(c.status == status for c in checks) for status in STATUSES}
    print(
        f"llamacpp_prompts={len(checks)} agree={count['agree']} near_tie={count['near-tie']} "
        f"differ={count['differ']} error={count['error']} same_tokenization={sum(c.same_tokenization is True for c in checks)} "
        f"al_llamacpp={_al(checks, 'llamacpp'):.3f} al_draftforge={_al(checks, 'draftforge'):.3f}"
    )
    return 1 if count["differ"] or count["error"] else 0


def _gguf_path(work: Path, role: str, folder: Path) -> Path:
    """Where the f32 GGUF of ``folder`` goes: named after the folder and a digest of its absolute
    path, so that checks of other drafts or targets sharing one --work-dir never replace (or read)
    each other's files, while a rerun of the same check replaces its own."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:10]
    return work / f"{role}-{folder.resolve().name}-{digest}-f32.gguf"


def _check_llamacpp_can_run(draft_dir: Path, draft_cfg) -> None:
    """Refuse, before llama.cpp is fetched and built and the target converted (minutes), an
    export llama.cpp cannot run: its converter refuses a Markov head other than ``vanilla``
    (after the target's conversion), and its runtime aborts at every prompt on a confidence
    head without the Markov input. The exporter knows both (its model card says SGLang only).
    ``draft_cfg`` is the export's config as ``config_from_serving`` read it (SGLang's defaults
    for what config.json leaves out)."""
    from draftforge.train.export import llamacpp_blockers

    blockers = llamacpp_blockers({key: getattr(draft_cfg, key) for key in (
        "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")})
    if blockers:
        raise InputError(
            f"{draft_dir / 'config.json'}: llama.cpp cannot run this draft ({'; '.join(blockers)}); "
            "there is nothing to compare: serve and evaluate it with SGLang (draftforge eval)"
        )


def _target_folder(target_cfg) -> Path:
    """The target's Hugging Face folder, which llama.cpp's converter reads."""
    from draftforge.splitserve import smollm2

    if target_cfg.model == smollm2.NAME:
        return smollm2.ensure_smollm2(target_cfg.cache_dir)
    folder = Path(target_cfg.model).expanduser()
    if not (folder / "config.json").is_file():
        raise InputError(
            f"target {target_cfg.model!r}: llama.cpp's converter needs a local Hugging Face folder "
            "(config.json, tokenizer, safetensors weights); pass one with --target"
        )
    # the converter reads pickled weights (.bin) where a folder has no safetensors: the
    # checks draftforge's own loader makes, first
    from draftforge.splitserve.hf_backend import _checked_model_folder

    return _checked_model_folder(folder)


def _own_code(folder: Path) -> list[str]:
    """What in ``folder`` is Python code of its own that a Hugging Face loader may run: its
    ``.py`` files and the ``auto_map`` of its config or tokenizer config."""
    found = sorted(path.name for path in folder.glob("*.py"))
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(f"auto_map in {name}")
    return found


def _refuse_own_code(folder: Path, whose: str) -> None:
    """llama.cpp's converter loads some architectures' tokenizers with trust_remote_code on
    (Qwen-v1, ChatGLM, InternLM2, some StableLM), running a folder's own Python code; refuse a
    folder holding any unless the recipe trusts it, as draftforge's own loaders do."""
    code = _own_code(folder)
    if code:
        raise InputError(
            f"the {whose} folder {folder} ships Python code of its own ({', '.join(code)}), which "
            "llama.cpp's converter may run (it loads some tokenizers with trust_remote_code on); "
            "draftforge runs a folder's code only when the recipe sets target.trust_remote_code: "
            "true, so set it there if you trust this folder, or remove the code")


def _check_all(args, target_cfg, draft_cfg, draft_dir: Path, bin_dir: Path, target_gguf: Path, draft_gguf: Path):
    import torch

    from draftforge.data.workloads import WORKLOAD_NAMES
    from draftforge.eval.cli import workload_texts
    from draftforge.eval.llamacpp import run_speculative, tokenize
    from draftforge.eval.speculative import DraftProposer, TargetSession
    from draftforge.splitserve.target import build_target
    from draftforge.train.hf_load import load_exported_draft

    target = build_target(target_cfg, draft_cfg.target_layer_ids)
    draft = load_exported_draft(draft_dir, target=target, dtype=torch.float32)
    tokenizer, eos = target.tokenizer, set(target.eos_token_ids())
    session = TargetSession(target.model, draft_cfg.target_layer_ids)
    proposer = DraftProposer(draft, temperature=0.0, generator=torch.Generator().manual_seed(0),
                             record_margins=True)
    timeout_s = args.timeout_s or 600 + 5 * args.max_new_tokens
    checks = []
    for name in args.workloads or WORKLOAD_NAMES:
        texts = workload_texts(name, tokenizer, target_cfg.generation, args.num_prompts)
        for index, text in enumerate(texts):
            same_tokenization = None
            try:
                prompt = tokenize(bin_dir, target_gguf, text)  # what llama.cpp decodes, on both sides
                same_tokenization = tokenizer(text, add_special_tokens=False)["input_ids"] == prompt
                theirs = run_speculative(
                    bin_dir, target_gguf, draft_gguf, text, max_new_tokens=args.max_new_tokens,
                    block_size=draft_cfg.block_size, p_min=args.p_min, threads=args.threads,
                    context=len(prompt) + args.max_new_tokens + 2 * draft_cfg.block_size + 16,
                    timeout_s=timeout_s, bos=tokenizer.bos_token,
                )  # fmt: skip
            except InputError as failure:  # what this check exists to find: llama.cpp cannot serve it
                checks.append(PromptCheck(name, index, {}, {}, same_tokenization, "error", str(failure)))
                _write_json(args.json, checks)
                print(f"  {name} {index + 1}/{len(texts)}: error ({failure})", flush=True)
                continue
            # stop where llama.cpp stops: its vocabulary also ends on tokens (<|endoftext|>) the target's
            # generation config may not list
            stop = eos | theirs.end_tokens
            ours = replay(session, proposer, prompt, max_new_tokens=args.max_new_tokens, eos=stop, p_min=args.p_min)
            shown = ours.tokens[:-1] if ours.tokens and ours.tokens[-1] in stop else ours.tokens
            status, detail = classify(theirs, ours, tie_tolerance=args.tie_tolerance,
                                      same_text=same_text(theirs.text, tokenizer, shown))
            check = PromptCheck(
                workload=name, index=index, llamacpp=_counts(theirs), draftforge=_counts(ours),
                same_tokenization=same_tokenization, status=status, detail=detail,
            )  # fmt: skip
            checks.append(check)
            _write_json(args.json, checks)  # so that a run cut short keeps the prompts it did
            print(
                f"  {name} {index + 1}/{len(texts)}: llama.cpp {theirs.predicted} tokens, "
                f"{theirs.accepted}/{theirs.drafted} drafts accepted; draftforge {ours.predicted}, "
                f"{ours.accepted}/{ours.drafted}: {status}{' (' + detail + ')' if detail else ''}",
                flush=True,
            )
    return checks


def _write_json(path: str | None, checks: Sequence[PromptCheck]) -> None:
    """``--json``: every prompt checked so far."""
    if path:
        from draftforge.files import write_atomic

        write_atomic(Path(path).expanduser(), (json.dumps([asdict(c) for c in checks], indent=2) + "\n").encode())


def _table(checks: Sequence[PromptCheck]) -> str:
    rows = [
        "| workload | prompts | agree | near-tie | differ | error | llama.cpp AL | draftforge AL |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = list(dict.fromkeys(c.workload for c in checks))
    for name in [*names, "all"]:
        group = [c for c in checks if name in ("all", c.workload)]
        counts = [sum(c.status == s for c in group) for s in STATUSES]
        rows.append(
            f"| {name} | {len(group)} | {' | '.join(map(str, counts))} "
            f"| {_al(group, 'llamacpp'):.3f} | {_al(group, 'draftforge'):.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
