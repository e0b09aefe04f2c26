"""``draftforge eval DRAFT [--target NAME_OR_DIR]``: real speculative decoding against the baselines.

The target is ``--target``'s, else ``--recipe``'s, else the one the draft's saved training
recipe names.

DRAFT is an export folder (``config.json`` + safetensors) or a training
checkpoint (run directory, checkpoint folder, or ``model.safetensors`` beside
``draft_config.json``): the DFlash ablation (markov_rank 0) cannot be exported
in the DSpark format and is evaluated from its checkpoint.

The workloads' prompts are rendered with the recipe's ``target.generation`` (thinking mode,
chat template); without ``--recipe``, with those the draft's saved training recipe records (a
checkpoint's ``recipe.yaml``, a run's ``config.yaml``, an export's model card), and where it
records none, with thinking off and the target tokenizer's own template.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from draftforge import argtypes
from draftforge.errors import InputError
from draftforge.eval.config import NGRAM_MATCHES, EvalConfig, tie_tolerance_for
from draftforge.files import check_folder_writable, dangling_link, remove_stale_temporaries


def build_parser() -> argparse.ArgumentParser:
    from draftforge.data.workloads import WORKLOAD_NAMES

    defaults = EvalConfig()
    parser = argparse.ArgumentParser(
        prog="draftforge eval",
        description="Speculative decoding with the target: the DSpark draft beside no-draft and "
        "n-gram baselines, on the same prompts. Greedy runs are checked lossless.",
        epilog="Exit status: 0 done; 2 refused input (the message says what and where); 3 the "
        "greedy lossless check failed (an output differs from plain greedy decoding).",
    )
    parser.add_argument("draft", help="export folder, run directory or training checkpoint")
    parser.add_argument("--target", help="registered target name, 'random' (needs --recipe) or local HF folder; "
                        "without it and --recipe, the target the draft's saved training recipe names")
    parser.add_argument("--recipe", help="take the target section (and eval defaults) from this recipe; its "
                        "target.generation renders the workload prompts (thinking mode, chat template), and a "
                        "draft whose saved training recipe rendered them otherwise gets a note. Without it "
                        "they are rendered as that saved recipe (a checkpoint's recipe.yaml, a run's "
                        "config.yaml, an export's model card) records, else with thinking off and the "
                        "target tokenizer's template")
    parser.add_argument("--workloads", type=_names_once(WORKLOAD_NAMES),
                        help="comma-separated subset of humaneval,mtbench,gsm8k (default: the "
                        "recipe's eval.workloads, else all three)")
    parser.add_argument("--prompts-file", help="JSONL of {'workload': name, 'input_ids': [...]} instead of "
                        "--workloads (not with it)")
    parser.add_argument("--temperature", type=argtypes.non_negative_float,
                        help=f"0 = greedy (default: the recipe's eval.temperature, else {defaults.temperature})")
    parser.add_argument("--top-k", type=argtypes.non_negative_int,
                        help="sampling only: draw from the K most likely tokens, 0 = all (default: the "
                        f"recipe's eval.top_k, else {defaults.top_k}); the target's distribution, and the draft's with "
                        "--draft-sampling sample")
    parser.add_argument("--top-p", type=argtypes.nucleus,
                        help="sampling only: then from the smallest set of those whose probability "
                        f"reaches P, 1 = all (default: the recipe's eval.top_p, else {defaults.top_p}). "
                        "The CPU recipe's answers were sampled at temperature 0.7, top-k 20, top-p 0.8")
    parser.add_argument("--draft-sampling", choices=["greedy", "sample"],
                        help="sampling only: greedy, the draft proposes its most likely tokens, each "
                        "accepted with the target's probability of it (as llama.cpp verifies); "
                        "sample, it draws them from its own distribution, accepted with "
                        f"min(1, p_t/p_d) (default: the recipe's eval.draft_sampling, else "
                        f"{defaults.draft_sampling})")
    parser.add_argument("--max-new-tokens", type=argtypes.positive_int,
                        help=f"tokens generated per prompt, 2 or more (default: the recipe's "
                        f"eval.max_new_tokens, else {defaults.max_new_tokens})")
    parser.add_argument("--num-prompts", type=argtypes.positive_int,
                        help="per workload; one with fewer runs all of its own, and the run and the "
                        "report say so (default: the recipe's eval.num_prompts, else all)")
    parser.add_argument("--verify", choices=["full", "threshold"], help="verification mode (default: the recipe's eval.verify, else full)")
    parser.add_argument("--threshold", type=argtypes.probability,
                        help="confidence threshold for --verify threshold, in [0, 1] (default: the "
                        f"recipe's eval.confidence_threshold, else {defaults.confidence_threshold})")
    parser.add_argument("--baselines", type=_names_once(("none", "ngram")),
                        help="comma-separated subset of none,ngram (default: the recipe's "
                        "eval.baselines, else both); greedy decoding runs none anyway, as the "
                        "lossless check's reference, and reports it")
    parser.add_argument("--ngram-match", choices=NGRAM_MATCHES, default="latest",
                        help="which earlier occurrence of the suffix n-gram the n-gram baseline copies "
                        "from: latest (default) or earliest (vLLM's and transformers' rule)")
    parser.add_argument("--calibrate", metavar="OUT.json", type=argtypes.path, help="fit per-position confidence temperatures")
    parser.add_argument("--calibrate-rule", choices=CALIBRATE_RULES,
                        help="how --calibrate fits: conditional (default: each position's temperature "
                        "minimising the log loss of its acceptance given the earlier drafts were "
                        "accepted; ECE in 10 bins) or survival (SGLang's dspark_sts_fit: position by "
                        "position, the temperature of a 41-value grid from 0.1 to 10 minimising the ECE "
                        "of the survival probability, in 15 bins, over rounds whose every draft was "
                        "judged); refused without --calibrate")
    parser.add_argument("--out", default="runs/eval", type=argtypes.path,
                        help="report folder (default runs/eval); a report already there is replaced, "
                        "and the run says so before it starts")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="target dtype (default: float32, or the recipe's with --recipe); the "
                        "lossless check needs float32 to be exact")  # fmt: skip
    parser.add_argument("--device", default="auto",
                        help="where the target and the draft run: auto (default) is the recipe's "
                        "target GPUs (split.target_devices, else the GPUs LOCAL_RANK of its first "
                        "target group's ranks, as training places them) when CUDA is visible, else "
                        "cpu; or cpu, cuda (GPU 0), cuda:N, or a list cuda:0,cuda:1,... Over several GPUs the "
                        "target is split by layers, filling them in order (one that fits on the "
                        "first stays there); the draft runs on the first")
    parser.add_argument("--tie-tolerance", type=argtypes.non_negative_float,
                        help="greedy only: divergences where the emitted token lies less than this below the "
                        "target's own choice (in plain decoding's logits) "
                        "are counted as numerical near-ties, not failures (default: 1e-3 for a "
                        "float32 target, 1.0 for bfloat16, whose batched and one-token logits "
                        "differ by up to about a logit)")  # fmt: skip
    parser.add_argument("--seed", type=argtypes.seed,
                        help="seeds sampling and the tau estimate's anchors, 0..2**32-1 (default: the recipe's "
                        f"eval.seed, else {defaults.seed})")
    parser.add_argument("--no-estimate", action="store_true", help="skip the train-time tau estimate")
    return parser


CALIBRATE_RULES = ("conditional", "survival")


def _names_once(valid: Sequence[str]):
    """:func:`argtypes.names`, refusing a name given twice: it would be measured once, and the
    report's command would read as if it were measured twice."""
    parse = argtypes.names(valid)

    def parse_once(text: str) -> list[str]:
        chosen = parse(text)
        given = [n.strip() for n in text.split(",")]
        repeated = [n for n in chosen if given.count(n) > 1]
        if repeated:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, repeated))} given more than once, and "
                                             f"each runs once: give {','.join(chosen)}")
        return chosen

    return parse_once


def _listed_once(names: Sequence[str], key: str) -> list[str]:
    """The recipe's ``key`` (eval.workloads, eval.baselines) with a name listed twice kept once, said."""
    kept = list(dict.fromkeys(names))
    if len(kept) < len(names):
        repeated = [n for n in kept if names.count(n) > 1]
        print(f"eval: the recipe's {key} lists {', '.join(map(repr, repeated))} more than once; each is "
              "measured once", flush=True)
    return kept


def _say_fewer_prompts(workloads: dict[str, list[list[int]]], num_prompts: int | None, args) -> None:
    """One line per workload with fewer prompts than --num-prompts (or the recipe's
    eval.num_prompts) asks: all of its prompts are measured, and the report says how many."""
    asked = f"--num-prompts {num_prompts}" if args.num_prompts else f"the recipe's eval.num_prompts {num_prompts}"
    for name, prompts in workloads.items():
        if num_prompts and len(prompts) < num_prompts:
            count, measured = ("1 prompt", "it is") if len(prompts) == 1 else (f"{len(prompts)} prompts",
                                                                               f"all {len(prompts)} are")
            has = (f"--prompts-file {args.prompts_file} holds only {count} of workload {name!r}"
                   if args.prompts_file else f"workload {name!r} has only {count}")
            print(f"eval: {asked}: {has}; {measured} measured", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``draftforge eval``."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from draftforge.splitserve.supervisor import unwinding_on_sigterm

    # SIGTERM (a scheduler, timeout(1), the demo) stops it as Ctrl-C does: the lock and any
    # temporary file of the report are removed, an earlier report in --out is kept
    with unwinding_on_sigterm("draftforge eval", "the report is written only when the evaluation "
                              "finishes (an earlier one in --out is kept); rerun the same command"), \
            contextlib.ExitStack() as held:  # the --out folder's lock, once the paths are checked
        return _evaluate(args, argv, held)


def _evaluate(args, argv: Sequence[str] | None, held: contextlib.ExitStack) -> int:
    import torch

    from draftforge.eval.calibration import (
        calibrate,
        calibrate_survival,
        calibration_json,
        pooled_ece,
    )
    from draftforge.eval.demo_report import host_description
    from draftforge.eval.harness import EvalSettings, macro, run_workload, target_context
    from draftforge.eval.report import REPORT_FILES, draft_kind, write_report
    from draftforge.eval.speculative import LosslessCheckError
    from draftforge.eval.training_record import prompt_rendering, recorded_target, training_record
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.placement import (
        describe_placement,
        recipe_target_gpus,
        resolve_devices,
        spread_placement,
    )
    from draftforge.splitserve.target import build_target
    from draftforge.train.metrics import git_revision

    eval_cfg, target_cfg, target_gpus = EvalConfig(), None, None
    record = None  # what the draft records of its training, read once where needed
    if args.recipe:
        from draftforge.config import load_recipe

        recipe = load_recipe(args.recipe)
        eval_cfg, target_cfg = recipe.eval, recipe.target
        target_gpus = recipe_target_gpus(recipe.split)
        if args.target and args.target != target_cfg.model:
            # another target: the recipe's declared shape was its target's ('random' needs one)
            shape = target_cfg.shape if args.target == "random" else None
            if args.target == "random" and shape is None:  # model_copy runs no validator
                raise InputError(
                    f"--target random: a random target is built from the recipe's target.shape, and "
                    f"{args.recipe} declares none (its target is {target_cfg.model!r}); give a "
                    "recipe with a target.shape section"
                )
            target_cfg = target_cfg.model_copy(update={"model": args.target, "shape": shape})
        if args.dtype:
            target_cfg = target_cfg.model_copy(update={"dtype": args.dtype})
    elif args.target:
        from pydantic import ValidationError

        try:
            target_cfg = TargetConfig(model=args.target, dtype=args.dtype or "float32")
        except ValidationError as err:
            reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
            raise InputError(
                f"--target {args.target}: {reasons}; describe such a target in a recipe and pass "
                "--recipe RECIPE instead"
            ) from None
    else:  # the target the draft's saved training recipe names
        record = training_record(args.draft)
        target_cfg = recorded_target(record, args.dtype)
    if args.prompts_file and args.workloads:  # the file's rows name their own workloads
        raise InputError(
            f"--workloads {','.join(args.workloads)} and --prompts-file "
            f"{args.prompts_file}: give one; the file's rows name their own workloads"
        )
    if args.prompts_file:  # as every path option; a pipe (--prompts-file <(...), /dev/stdin) is read as a file
        given = Path(args.prompts_file).expanduser()
        if given.is_dir():
            raise InputError(f"--prompts-file {args.prompts_file}: is a folder; give the JSONL file")
        if not given.exists():
            raise InputError(f"--prompts-file {args.prompts_file}: no such file")
    num_prompts = args.num_prompts or eval_cfg.num_prompts
    # read before the target loads: a bad row is found in seconds, not after minutes
    file_prompts, file_lines = _prompts_from_file(args.prompts_file, num_prompts) if args.prompts_file else (None, {})
    temperature = eval_cfg.temperature if args.temperature is None else args.temperature
    sampling_only = [f"{flag} {value}" for flag, value in
                     (("--top-k", args.top_k), ("--top-p", args.top_p), ("--draft-sampling", args.draft_sampling))
                     if value is not None]  # fmt: skip
    if temperature <= 0 and sampling_only:
        raise InputError(
            f"{', '.join(sampling_only)}: only for sampling, but the temperature is 0 "
            "(greedy decoding, which they would not change): give --temperature above 0, or leave "
            "them out"
        )
    if temperature > 0 and args.tie_tolerance is not None:
        raise InputError(
            f"--tie-tolerance {args.tie_tolerance}: only for greedy decoding, whose "
            f"outputs are checked against plain decoding, but the temperature is {temperature}"
            f"{_source(args.temperature, args.recipe, 'eval.temperature')} (sampled outputs are not "
            "checked, so it would change nothing): give --temperature 0, or leave it out"
        )
    verify = args.verify or eval_cfg.verify
    if args.threshold is not None and verify != "threshold":
        raise InputError(
            f"--threshold {args.threshold}: only for --verify threshold, but "
            f"verification is {verify!r}{_source(args.verify, args.recipe, 'eval.verify')}, which "
            "verifies every block in full and ignores it: give --verify threshold, or leave it out"
        )
    if args.calibrate_rule is not None and not args.calibrate:
        raise InputError(f"--calibrate-rule {args.calibrate_rule} without --calibrate: nothing is fitted; "
                         "give --calibrate OUT.json, or leave --calibrate-rule out")
    if args.calibrate and verify == "threshold":
        raise InputError(
            f"--calibrate with threshold verification"
            f"{_source(args.verify, args.recipe, 'eval.verify')}: it verifies only the slots before "
            "the first whose confidence is below the threshold, so the fit would see no position "
            "the head rates below it; give --verify full"
        )
    if args.max_new_tokens is not None and args.max_new_tokens < 2:  # a recipe's is checked by its schema
        raise InputError(
            f"--max-new-tokens {args.max_new_tokens}: the first new token "
            "comes from the prompt's prefill, so no verification round would run and no acceptance "
            "length be measured; give 2 or more"
        )
    max_new_tokens = args.max_new_tokens or eval_cfg.max_new_tokens

    devices = resolve_devices(args.device, target_gpus)
    device = devices[0]  # the draft's, and where the target's inputs and features are
    if not args.dtype:  # an auto dtype was resolved for CUDA when there is one
        target_cfg = target_cfg.model_copy(update={"dtype": target_cfg.dtype_on(device)})
    if target_cfg.backend != "hf":
        # the verifier steps a KV cache token by token and reads the layers it captures in
        # place: it drives the model itself, so the target runs in transformers here
        print(f"eval: target.backend {target_cfg.backend!r} is for training; the evaluator runs "
              "the same weights in transformers", flush=True)
        target_cfg = target_cfg.model_copy(update={"backend": "hf"})
    # refused now, not after minutes of decoding, when the report or calibration is written
    _check_outputs_spare_inputs(args)  # the draft's own folder named as such, before the kinds of folder
    _check_output_paths(args.out, args.calibrate)
    out = Path(args.out).expanduser()
    if held.enter_context(_report_held(out)):  # a second eval into it: refused
        for name in REPORT_FILES:  # what an evaluation killed outright while writing them left
            remove_stale_temporaries(out / name)
    draft_cfg, load_draft, fingerprint = _draft_loader(args.draft)
    _check_fit(draft_cfg, target_cfg, args.draft)
    # the workloads rendered as the draft's training rendered its prompts (without --recipe)
    rendering = None
    if file_prompts is None:
        record = record or training_record(args.draft)
        rendering, generation = prompt_rendering(args.draft, record, args.recipe, target_cfg.generation)
        target_cfg = target_cfg.model_copy(update={"generation": generation})
    _warn_replacing(out)  # where write_report writes, once the draft is known to load
    if file_prompts is not None:  # before the target loads; the workloads' once tokenized
        _check_lengths(file_prompts, max_new_tokens, draft_cfg.max_position_embeddings,
                       lambda name, i: f"{args.prompts_file}:{file_lines[name][i]}")
    if not draft_cfg.enable_confidence_head:
        needs_head = []
        if verify == "threshold":
            needs_head.append("--verify threshold" + ("" if args.verify else " (the recipe eval.verify)"))
        if args.calibrate:
            needs_head.append("--calibrate")
        if needs_head:
            raise InputError(
                f"{args.draft}: {' and '.join(needs_head)} {'need' if len(needs_head) > 1 else 'needs'} the draft's "
                "confidence head, and this draft has none (enable_confidence_head false, as in "
                "the DFlash ablation); use --verify full and leave out --calibrate"
            )
    if args.calibrate and (num_prompts == 1 or (file_prompts and max(map(len, file_prompts.values())) < 2)):
        # every second prompt of each workload is held out: with one a workload, none would be
        given = (f"{args.prompts_file} holds one prompt a workload" if num_prompts != 1
                 else "--num-prompts is 1" if args.num_prompts else "the recipe's eval.num_prompts is 1")
        raise InputError(
            f"--calibrate {args.calibrate}: every second prompt of each workload is "
            f"held out to measure the ECE after fitting, and {given}, so none would be: give a "
            "workload 2 prompts or more (one to fit on, one held out)"
        )
    placement = None
    if len(devices) > 1:
        placement = spread_placement(devices, reserve_first_bytes=_draft_bytes(draft_cfg))
    where = f"on {device}" if placement is None else "over " + ", ".join(devices)
    print(f"eval: loading target {target_cfg.model!r} {where} (layers {draft_cfg.target_layer_ids})",
          flush=True)
    target = build_target(target_cfg, draft_cfg.target_layer_ids, device=device, placement=placement)
    if placement is not None:
        print(f"eval: target placed: {describe_placement(target.model.hf_device_map)}", flush=True)
    draft = load_draft(target, device)
    print(f"eval: draft {args.draft} (block {draft_cfg.block_size}, markov rank {draft_cfg.markov_rank})")

    sampling = _sampling_settings(args, eval_cfg, temperature, verify)
    settings = EvalSettings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        **sampling,
        verify=verify,
        threshold=eval_cfg.confidence_threshold if args.threshold is None else args.threshold,
        seed=eval_cfg.seed if args.seed is None else args.seed,
        baselines=tuple(args.baselines or _listed_once(eval_cfg.baselines, "eval.baselines")),
        estimate=not args.no_estimate,
        tie_tolerance=tie_tolerance_for(target_cfg.dtype, args.tie_tolerance),
        ngram_match=args.ngram_match,
    )
    if file_prompts is not None:
        _check_vocabulary(args.prompts_file, file_prompts, file_lines, target.model.get_input_embeddings().num_embeddings)
        workloads = file_prompts
    else:
        names = args.workloads or _listed_once(eval_cfg.workloads, "eval.workloads")
        workloads = {name: _workload_prompts(name, target, target_cfg, num_prompts) for name in names}
        _check_lengths(workloads, max_new_tokens, draft_cfg.max_position_embeddings,
                       lambda name, i: f"workload {name!r}, prompt {i}")
    _say_fewer_prompts(workloads, num_prompts, args)
    target_limit = target_context(target.model)
    if target_limit is not None:  # before any decodes, as the draft's limit above
        name_prompt = ((lambda name, i: f"{args.prompts_file}:{file_lines[name][i]}") if file_prompts is not None
                       else (lambda name, i: f"workload {name!r}, prompt {i}"))
        _check_lengths(workloads, max_new_tokens, target_limit, name_prompt, whose="target's")
    eos = _eos_ids(target)

    torch.manual_seed(settings.seed)
    results, started = [], time.perf_counter()
    for name, prompts in workloads.items():
        print(f"eval: {name}: {len(prompts)} prompts", flush=True)
        try:
            results.append(run_workload(name, prompts, draft, target, settings, eos_token_ids=eos))
        except LosslessCheckError as err:
            hint = "" if target_cfg.dtype == "float32" else " (the target runs in bfloat16: rerun with --dtype float32)"
            print(f"draftforge eval: LOSSLESS CHECK FAILED: {err}{hint}", file=sys.stderr)
            return 3

    meta = {
        "command": "draftforge eval " + shlex.join(list(sys.argv[1:] if argv is None else argv)),
        "draft": str(args.draft),
        "draft_path": str(Path(args.draft).expanduser().resolve()),  # the draft wherever this is read from
        "draft_fingerprint": fingerprint(),  # the weights read (every tensor's), which export compares
        "target": target_cfg.model,
        # what else makes the target the same one (draftforge eval compare checks it)
        "target_config": {
            "model": target_cfg.model,
            "dtype": target_cfg.dtype,
            "backend": target_cfg.backend,
            "seed": target_cfg.seed,  # defines a random target (model 'random') with its shape
            "shape": target_cfg.shape.model_dump() if target_cfg.shape is not None else None,
        },
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(settings).items()},
        "num_prompts_requested": num_prompts,  # per workload, None for all; each workload's num_prompts is measured
        # how the workloads' prompts were rendered (None for --prompts-file's token ids)
        "prompt_rendering": rendering,
        "device": device,
        "target_devices": devices,
        "block_size": draft_cfg.block_size,
        "draft_kind": draft_kind(draft_cfg),
        "wall_s": time.perf_counter() - started,
        "host": host_description(),  # where it was measured (draftforge demo prints it)
        "draftforge_revision": git_revision(),
    }
    survival = args.calibrate_rule == "survival"  # else conditional, the default
    if survival:  # whole rounds, each with its (workload, prompt): calibrate holds out whole prompts
        samples = [o for r in results for o in r.confidence_rounds]
        prompt_ids = [(r.name, p) for r in results for p in r.confidence_round_prompts]
    else:  # one sample per position a round reached
        samples = [s for r in results for s in r.confidence_samples]
        prompt_ids = [(r.name, p) for r in results for p in r.confidence_prompts]
    refused = None  # a calibration refused (non-finite confidence logits): said after the report
    try:
        fit = calibrate_survival if survival else calibrate
        calibration = fit(samples, draft_cfg.block_size, dataset=",".join(workloads),
                          prompt_ids=prompt_ids) if args.calibrate and samples else None
    except InputError as problem:
        refused, calibration = problem, None
    unwritten = None  # the calibration file could not be written (a full disk): said after the report
    also = []  # the calibration JSON, written with the report: both replaced, or neither
    held_out = 0  # the held-out samples (rounds, by the survival rule) the ECE is measured on
    if calibration is not None:
        if survival:  # its pooled ECE (SGLang's survival ECE) is its own
            held_out = calibration["held_out_samples"][0]
            meta["calibration"] = {**calibration, "path": str(args.calibrate)}
        else:
            held = calibration.pop("held_out")  # ECE on what the temperatures were not fitted on
            held_out = len(held)
            meta["calibration"] = {
                **calibration,
                "path": str(args.calibrate),
                "pooled_ece_before": pooled_ece(held),
                "pooled_ece_after": pooled_ece(held, calibration["temperatures"]),
            }
        also = [(Path(args.calibrate).expanduser(), calibration_json(calibration))]
    try:
        paths = write_report(results, args.out, meta, block_size=draft_cfg.block_size, also=also)
    except OSError as err:
        if not also or err.filename != str(also[0][0]):
            raise
        # only the calibration file failed: the report goes on its own, saying so (the decoding is kept)
        unwritten = err.strerror or str(err)
        meta["calibration"]["write_error"] = unwritten
        paths = write_report(results, args.out, meta, block_size=draft_cfg.block_size)
    if calibration is not None:
        what = f"survival ECE (pooled over the {held_out} held-out rounds)" if survival else \
            f"ECE (pooled over the {held_out} held-out samples)"
        ece = (f"{what} {meta['calibration']['pooled_ece_before']:.4f} -> {meta['calibration']['pooled_ece_after']:.4f}"
               if held_out else "no ECE: the held-out prompts (every second of each workload) "
               + ("gave no round with every draft judged" if survival else "verified no draft position"))
        print(
            f"eval: calibration {'fitted' if unwritten else f'written to {args.calibrate}'}: temperatures "
            f"{[round(t, 3) for t in calibration['temperatures']]}, {ece}"
        )
    print(paths["markdown"].read_text())
    summary = " ".join(f"al_{m}={macro(results, m):.3f}" for m in ("dspark", "ngram", "none"))
    out_dir = out  # a path a script reading the last line can open
    print(f"eval: report in {out_dir} ({', '.join(p.name for p in paths.values())})")
    print(f"eval_dir={out_dir} {summary}")
    if args.calibrate and not samples:  # the report is written: the decoding is not lost
        raise InputError(
            f"--calibrate {args.calibrate}: " + (
                "no round had every draft judged (--calibrate-rule survival needs rounds of a whole "
                "block verified, or cut by a rejection; every round here ended at the output's end)"
                if survival else "no confidence samples were recorded (no draft position was "
                "verified: every prompt ended at its first token)") + ", so nothing was written there"
        )
    if refused is not None:  # the report is written: the decoding is not lost
        raise InputError(f"--calibrate {args.calibrate}: nothing was written there: {refused}")
    if unwritten is not None:  # the report is written, with the temperatures
        raise InputError(f"--calibrate {args.calibrate}: could not be written ({unwritten}); nothing was "
                         f"written there, and the temperatures are in {out_dir / 'report.json'} "
                         "('calibration'). Free space (or choose another --calibrate) and rerun")
    return 0


def _refuse_inside_checkpoints(path: Path, option: str, given: str, instead: str) -> None:
    """Refuse an output path inside a training run's checkpoints, which the run prunes."""
    from draftforge.train.checkpoint import checkpoints_holding

    if (held := checkpoints_holding(path)) is not None:
        raise InputError(f"{option} {given}: lies inside the training run's checkpoints ({held}), whose "
                         "folders the run deletes when it prunes old checkpoints (train.keep_last); "
                         f"give a path of its own, e.g. {held.parent / instead}")


def _check_output_paths(out: str, calibrate: str | None) -> None:
    """Refuse an ``--out`` folder or a ``--calibrate`` file that cannot be written, or a
    ``--calibrate`` file the report would overwrite, naming the option, the path and what is
    wrong."""
    out_path = Path(out).expanduser()
    if (dangling := dangling_link(out_path)) is not None:  # it or a folder above it
        raise InputError(f"--out {out}: {dangling}; give a folder")
    if out_path.exists() and not out_path.is_dir():
        raise InputError(f"--out {out}: is a file, not a folder; give a folder for the report")
    from draftforge.train.export import is_model_folder

    if is_model_folder(out_path):
        raise InputError(f"--out {out}: is a model folder (config.json and its weights); the report "
                         "would sit among its files (and an export there would then refuse to replace "
                         f"it): give a folder of its own, e.g. {out_path.with_name(out_path.name + '-eval')}")
    if (out_path / "checkpoints").is_dir() or (out_path / "run.json").is_file():
        raise InputError(f"--out {out}: is a training run's folder; give a folder of its own for the "
                         f"report, e.g. {out_path / 'eval'} (where the demo writes a run's report and "
                         "draftforge export looks for one; eval's own default is runs/eval)")
    _refuse_inside_checkpoints(out_path, "--out", out, "eval")
    check_folder_writable(out_path, "--out", out)
    if calibrate is not None:
        cal_path = Path(calibrate).expanduser()
        if (dangling := dangling_link(cal_path)) is not None:  # it or a folder above it
            raise InputError(f"--calibrate {calibrate}: {dangling}; give the path of the JSON file to write")
        if cal_path.is_dir():
            raise InputError(f"--calibrate {calibrate}: is a folder; give the path of the JSON file "
                             f"to write, e.g. {cal_path / 'calibration.json'}")
        # the files write_report puts in --out, after the calibration is written
        report_files = ("report.md", "report.json", "acceptance_length.png", "position_acceptance.png")
        if cal_path.name in report_files and cal_path.parent.resolve() == out_path.resolve():
            raise InputError(f"--calibrate {calibrate}: is the report's {cal_path.name} in --out {out}, "
                             "which the report would write over the calibration; give another path, "
                             f"e.g. {out_path / 'calibration.json'}")
        _refuse_inside_checkpoints(cal_path, "--calibrate", calibrate, "eval/calibration.json")
        check_folder_writable(cal_path.parent, "--calibrate", calibrate)


def _check_outputs_spare_inputs(args) -> None:
    """Refuse an ``--out`` or ``--calibrate`` that would write over what this run reads, or into
    the draft being evaluated: the draft's folder (an export, whose loaders expect only its own
    files and which a later ``draftforge export`` into it refuses as not an export; or a
    checkpoint), the ``--prompts-file``, the ``--recipe``; and a ``--calibrate`` file that is
    ``--out`` itself or an existing file other than a calibration."""
    draft = Path(args.draft).expanduser()
    out = Path(args.out).expanduser()
    # a run folder takes its report in RUN/eval (draftforge export reads it there): only its
    # checkpoints are the draft's own files; an export's or a checkpoint's folder is all of them
    own = draft / "checkpoints" if (draft / "checkpoints").is_dir() else draft
    if out.resolve() == draft.resolve() or out.resolve().is_relative_to(own.resolve()):
        where = ("is the draft being evaluated" if out.resolve() == draft.resolve()
                 else f"is {own}, the draft's own files" if out.resolve() == own.resolve()
                 else f"is inside {own}, the draft's own files")
        raise InputError(f"--out {args.out}: {where}; the report would be written among them; give "
                         f"another folder, e.g. {draft.resolve().parent / 'eval'}")
    if args.calibrate is None:
        return
    cal = Path(args.calibrate).expanduser()
    inputs = [("the draft's files", own, True)] + [
        (option, Path(value).expanduser(), False)
        for option, value in (("--prompts-file", args.prompts_file), ("--recipe", args.recipe)) if value]
    suggestion = f"give a new path, e.g. {draft.resolve().parent / 'calibration.json'}"
    for what, path, folder in inputs:
        if (cal.resolve().is_relative_to(path.resolve()) if folder
                else cal.exists() and cal.resolve() == path.resolve()):
            raise InputError(f"--calibrate {args.calibrate}: is {'in ' if folder else ''}{what}"
                             f"{'' if folder else ' ' + str(path)}, which this run reads; {suggestion}")
    if cal.resolve() == out.resolve():
        raise InputError(f"--calibrate {args.calibrate}: is the --out folder {args.out}; give the path "
                         f"of the JSON file to write, e.g. {out / 'calibration.json'}")
    if cal.is_file() and not _is_calibration(cal):
        raise InputError(f"--calibrate {args.calibrate}: an existing file that is not a calibration "
                         f"written by draftforge eval, which this run would replace; {suggestion}, or "
                         "move the file away")


def _is_calibration(path: Path) -> bool:
    """Whether ``path`` holds SGLang's calibration JSON (an object with ``temperatures``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "temperatures" in data


def _report_held(out: Path):
    """Hold ``.NAME.eval.lock`` beside the ``--out`` folder while the evaluation runs: two into
    one folder would replace each other's report, or leave one's report.md beside the other's
    report.json. Refuses at once, naming the holder; a file system without ``flock`` runs unlocked."""
    from draftforge.files import lock_or_refuse

    lock = out.absolute().parent / f".{out.name}.eval.lock"
    return lock_or_refuse(lock, lambda holder: InputError(
        f"--out {out}: another draftforge eval is writing its report there ({holder} holds {lock}); "
        "wait for it, or give another --out"))


def _warn_replacing(out: Path) -> None:
    """Say up front (before minutes of decoding) that ``--out`` holds a report this run replaces;
    refuse a ``report.json`` there that ``draftforge eval`` did not write (the user's own)."""
    from draftforge.errors import InputError

    earlier = out / "report.json"
    if not earlier.is_file():
        return
    try:
        written = json.loads(earlier.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        written = None
    if not (isinstance(written, dict) and "workloads" in written and "draft" in written):
        raise InputError(f"--out {out}: holds a report.json that is no draftforge evaluation report (no "
                         "'workloads' and 'draft'), which this run would replace with its report.json, "
                         "report.md and plots; choose another --out, or move it away")
    draft = written["draft"]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(earlier.stat().st_mtime))
    print(f"eval: {out} holds a report of draft {draft} from {when}; this run replaces it "
          "(another --out keeps both)", flush=True)


def _draft_loader(path: str):
    """(DSparkConfig, loader(target, device) -> DSparkDraft, fingerprint() -> str | None) for an
    export folder or a training checkpoint; the fingerprint, known once the loader has run,
    says which weights were read (a run's newest checkpoint may change while this evaluates,
    an export be replaced), so that export puts this evaluation's table only on their card."""
    from draftforge.train.export import (
        CONFIG_FILE,
        draft_fingerprint,
        load_training_checkpoint,
    )
    from draftforge.train.hf_load import (
        config_from_serving,
        export_fingerprint,
        load_exported_draft,
        read_serving_config,
    )
    from draftforge.train.model import DSparkDraft

    folder = Path(path).expanduser()
    if (folder / CONFIG_FILE).is_file():
        # export replaces a folder whole, with files written anew: one whose files' sizes or times
        # differ once the weights are in was replaced after its config.json was read, or while read
        identity = _folder_identity(folder)
        cfg = config_from_serving(read_serving_config(folder), where=str(folder / CONFIG_FILE))
        read: list[str] = []

        def load_export(target, device):
            model = load_exported_draft(folder, target=target, dtype=_float32(), device=device)
            read.append(export_fingerprint(folder))
            if _folder_identity(folder) != identity:
                from draftforge.errors import InputError

                raise InputError(f"{folder} was replaced (by another 'draftforge export'?) while this "
                                 "evaluation read it, so its config and weights may be two exports'; "
                                 "rerun the evaluation")
            return model

        return cfg, load_export, lambda: read[-1] if read else None
    cfg, state = load_training_checkpoint(folder)
    if not (folder / "checkpoints").is_dir():  # a checkpoint named, not a run's newest complete one
        from draftforge.train.export import unmarked_checkpoint_note

        if (note := unmarked_checkpoint_note(folder, used="evaluated")) is not None:
            print(f"eval: note: {note}", flush=True)

    def load(target, device):
        model = DSparkDraft(cfg)
        model.load_target_embeddings(target.embed_tokens_weight(), target.lm_head_weight())
        full = {**model.state_dict(), **state}
        model.load_state_dict({k: v.to(model.fc.weight.dtype) for k, v in full.items()}, strict=True)
        return model.to(device).eval()

    fingerprint = draft_fingerprint(state)
    return cfg, load, lambda: fingerprint


def _folder_identity(folder: Path) -> tuple:
    """Each file's name, size and modification time (not inode numbers, which a remounted network
    file system may change)."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()))


def _check_fit(draft_cfg, target_cfg, draft_path: str) -> None:
    """Refuse a draft whose hidden size, vocabulary or layer ids do not fit the target, before loading it."""
    from dataclasses import asdict

    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.compat import check_draft_fits_target

    shape = resolve_target_shape(target_cfg)
    if shape is None:
        return  # unknown until loaded; the target engine checks the layer ids itself
    check_draft_fits_target(
        asdict(draft_cfg), draft_source=draft_path, target_name=target_cfg.model,
        hidden_size=shape.hidden_size, vocab_size=shape.vocab_size,
        num_hidden_layers=shape.num_hidden_layers,
    )


def _draft_bytes(draft_cfg) -> int:
    """Memory the draft takes on its GPU beside a spread target: its float32 weights (with its
    own copy of the embedding and lm_head) and room for its activations."""
    from draftforge.splitserve.dry_run import dspark_parameter_counts
    from draftforge.splitserve.placement import DRAFT_HEADROOM_BYTES

    with_embeddings, _ = dspark_parameter_counts(draft_cfg)
    return 4 * with_embeddings + DRAFT_HEADROOM_BYTES


def _float32():
    import torch

    return torch.float32


def _workload_prompts(name: str, target, target_cfg, num_prompts: int | None) -> list[list[int]]:
    """Chat-templated token ids of a workload's prompts, as the target will be served."""
    try:
        tokenizer = target.tokenizer
    except RuntimeError as err:  # a target built without one (a random target not of SmolLM2's vocabulary)
        raise InputError(f"workload {name!r}: its prompts are text, and {err}; give --prompts-file with "
                         "token ids instead") from None
    if target_cfg.generation.chat_template is None and not getattr(tokenizer, "chat_template", None):
        # a base model's folder: "set target.generation.chat_template" alone names a recipe
        # key that `eval --target DIR` without --recipe has nowhere to set
        raise InputError(
            f"workload {name!r}: its prompts are chats, and the tokenizer of target "
            f"{target_cfg.model} has no chat template (its tokenizer_config.json or "
            "chat_template.jinja gives none): pass --recipe with a recipe whose "
            "target.generation.chat_template holds the Jinja text of one, or give --prompts-file "
            "with token ids")
    texts = workload_texts(name, tokenizer, target_cfg.generation, num_prompts)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def workload_texts(name: str, tokenizer, generation, num_prompts: int | None) -> list[str]:
    """The first ``num_prompts`` prompts of a workload (all when None), chat-templated as text
    with the recipe's ``target.generation`` settings (template, thinking mode)."""
    from draftforge.data.tokenize import render
    from draftforge.data.workloads import load_workload

    return [  # as training renders prompts: a tokenizer without a template is a clear error
        render(tokenizer, prompt.messages, add_generation_prompt=True,
               chat_template=generation.chat_template, enable_thinking=generation.enable_thinking)
        for prompt in load_workload(name)[: num_prompts or None]
    ]


def _prompts_from_file(
    path: str, num_prompts: int | None
) -> tuple[dict[str, list[list[int]]], dict[str, list[int]]]:
    """The file's prompts by workload, and each prompt's line number (for
    :func:`_check_vocabulary`, which runs once the target and its vocabulary are known)."""
    workloads: dict[str, list[list[int]]] = {}
    lines: dict[str, list[int]] = {}
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no token
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); expected JSONL, one "
                         "{'workload': str, 'input_ids': [int, ...]} per line") from None
    # JSONL's rows end at "\n" alone: str.splitlines would also cut at U+2028, U+0085 and
    # the like, which JSON allows inside a string, refusing a valid row and misnumbering the rest
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        expected = "expected {'workload': str, 'input_ids': [int, ...]}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{line_no}: not JSON ({err}); {expected}") from None
        except RecursionError:  # arrays or objects nested thousands deep
            raise InputError(f"{path}:{line_no}: not a prompt row (JSON nested too deeply); {expected}") from None
        except ValueError as err:  # an integer of more digits than Python converts
            raise InputError(f"{path}:{line_no}: not a prompt row ({err}); {expected}") from None
        if not isinstance(row, dict):  # a list, a string: "input_ids ... got null" misnamed it
            kind = {list: "an array", str: "a string"}.get(type(row), f"a JSON {json.dumps(row)[:40]}")
            raise InputError(f"{path}:{line_no}: not a prompt row ({kind}, not an object); {expected}")
        if "input_ids" not in row:  # a text prompt, a misspelt key
            raise InputError(f"{path}:{line_no}: the row has no input_ids (its keys: "
                             f"{', '.join(map(str, row)) or 'none'}); {expected}")
        ids = row["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InputError(f"{path}:{line_no}: input_ids must be a list of token ids (integers), "
                             f"got {json.dumps(ids)[:80]}; {expected}")
        if not ids:
            raise InputError(f"{path}:{line_no}: empty input_ids")
        if min(ids) < 0:
            raise InputError(f"{path}:{line_no}: token id {min(ids)} is negative")
        name = row.get("workload", "prompts")
        if not isinstance(name, str):
            raise InputError(f"{path}:{line_no}: workload must be a string, got {json.dumps(name)}")
        if not name.strip() or any(c in name for c in "|\n\r`"):  # a report's table cell and row
            raise InputError(f"{path}:{line_no}: workload {json.dumps(name)}: give a name that is not "
                             "blank and holds no '|', backquote or line break (the reports' tables "
                             "show it in a cell)")
        if name == "macro":  # the reports' name for the mean over workloads
            raise InputError(f"{path}:{line_no}: workload name 'macro' is reserved for the mean over workloads")
        if name != name.strip():  # " humaneval" and "humaneval": two rows that read alike
            raise InputError(f"{path}:{line_no}: workload {json.dumps(name)} begins or ends with "
                             f"white space; write {json.dumps(name.strip())}")
        bucket = workloads.setdefault(name, [])
        if num_prompts is None or len(bucket) < num_prompts:
            bucket.append(ids)
            lines.setdefault(name, []).append(line_no)
    if not workloads:
        raise InputError(f"{path}: no prompts, every line is blank; expected one "
                         "{'workload': str, 'input_ids': [int, ...]} per line")
    return workloads, lines


def _check_vocabulary(
    path: str, workloads: dict[str, list[list[int]]], lines: dict[str, list[int]], vocab_size: int
) -> None:
    """Refuse a --prompts-file token id the target's embedding has no row for (on a GPU it
    would be a device-side assert, on the CPU an IndexError naming nothing)."""
    for name, prompts in workloads.items():
        for ids, line_no in zip(prompts, lines[name], strict=True):
            if max(ids) >= vocab_size:
                raise InputError(
                    f"{path}:{line_no}: token id {max(ids)} is outside the target's vocabulary "
                    f"({vocab_size} ids, 0 to {vocab_size - 1})"
                )


def _sampling_settings(args, eval_cfg, temperature: float, verify: str) -> dict:
    """top_k, top_p and draft_sampling as decoding uses them: the recipe's (or the options')
    when sampling; under greedy decoding their no-op values, so that report.json records what
    ran, with a note naming the recipe's settings that do not apply (the options are refused
    earlier). A confidence_threshold other than the default under full verification is noted too."""
    given = {"top_k": eval_cfg.top_k if args.top_k is None else args.top_k,
             "top_p": eval_cfg.top_p if args.top_p is None else args.top_p,
             "draft_sampling": args.draft_sampling or eval_cfg.draft_sampling}
    notes = []
    if temperature <= 0:
        neutral = {"top_k": 0, "top_p": 1.0, "draft_sampling": "greedy"}
        unused = [f"eval.{key} {value!r}" for key, value in given.items() if value != neutral[key]]
        if unused:
            notes.append(f"{', '.join(unused)} (decoding is greedy: temperature 0)")
        given = neutral
    default_threshold = type(eval_cfg).model_fields["confidence_threshold"].default
    if verify != "threshold" and eval_cfg.confidence_threshold != default_threshold:  # a run's
        # config.yaml writes every key, so set or not, only a value of the recipe's own is said
        notes.append(f"eval.confidence_threshold {eval_cfg.confidence_threshold!r} ({verify!r} "
                     "verification verifies every drafted slot)")
    if notes:
        print(f"eval: not applied from the recipe: {'; '.join(notes)}", flush=True)
    return given


def _source(given, recipe: str | None, key: str) -> str:
    """Where a setting not given on the command line came from, for a message."""
    return "" if given is not None else f" (the recipe's {key})" if recipe else " (the default)"


def _check_lengths(workloads: dict[str, list[list[int]]], max_new_tokens: int, limit: int, where, *,
                   whose: str = "draft's") -> None:
    """:func:`~draftforge.eval.harness.check_prompt_lengths` over every workload before any
    decodes; ``where(name, index)`` names a prompt (a --prompts-file line, or the workload),
    ``whose`` the limit (the draft's or the target's ``max_position_embeddings``)."""
    from draftforge.eval.harness import check_prompt_lengths

    for name, prompts in workloads.items():
        check_prompt_lengths(prompts, max_new_tokens, limit, lambda index, name=name: where(name, index),
                             option="--max-new-tokens", whose=whose)


def _eos_ids(target) -> list[int]:
    try:
        return list(target.eos_token_ids())
    except (RuntimeError, ValueError, AttributeError) as err:
        print(f"eval: no end-of-sequence token ({err}); decoding runs to --max-new-tokens")
        return []


if __name__ == "__main__":
    sys.exit(main())
