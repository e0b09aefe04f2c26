"""``draftforge demo [RECIPE]``: regenerate, train DSpark and DFlash, export, evaluate, one table.

The README's main command (``make demo``). With the default CPU recipe
(``recipes/smollm2-cpu.yaml``) it runs, each stage a ``draftforge`` subcommand
in its own process:

1. ``data regenerate``: the target answers the recipe's prompts once, into the run's
   regenerated file (``data.regenerated_file``, default ``<run>/regenerated.jsonl``);
   both trainings read that file instead of regenerating on the fly;
2. ``train``: the DSpark draft, as the recipe says, except that its Markov head starts as
   the regenerated answers' bigram table (``train.markov_init=bigram``, +0.03-0.04 AL at
   the CPU recipe's budget), which the answers existing before training allows;
   ``--markov-init random`` keeps the recipe's start. Drafts without a vanilla or gated
   Markov head, and recipes that do not regenerate, keep theirs;
3. ``train``: the DFlash ablation, with the same recipe and budget and these overrides
   only: no Markov head, no confidence head, the pure cross-entropy objective, and
   its own run directory ``<run>-dflash`` (:data:`~draftforge.eval.demo_runs.DFLASH_OVERRIDES`);
4. ``export``: the DSpark draft to ``export.out_dir`` (default ``<run>/export``); the demo
   records the digest the export printed of the folder it wrote (``export_files=``, taken under
   its lock), and refuses to go on where another export has replaced that folder since;
5. ``eval`` (greedy, float32 target): the export against the no-draft and n-gram
   baselines on the same prompts in one run (``<run>/eval``), and the DFlash ablation
   from its training checkpoint on the same prompts (``<run>/eval-dflash``; SGLang
   refuses ``markov_rank: 0``, so it has no DSpark export). Both verify every drafted token
   (``--verify full``: DFlash has no confidence head, and the table subtracts one from the
   other), whatever the recipe's ``eval.verify``. The two run side by side on machines with
   two or more cores and no GPU, one thread each, else one after the other. The demo holds
   the export's lock while they run, so that no ``draftforge export`` replaces it meanwhile;
6. the export again, its model card now holding the measured table; then one
   markdown table, printed and written to ``<run>/demo.md``. The last line is::

       export_dir=<path> al_dspark=<macro> al_dflash=<macro> al_ngram=<macro>

A stage whose output already exists, is complete and is newer than its inputs is
skipped, so an interrupted demo continues where it stopped (training resumes from
its newest checkpoint). An existing regenerated file is used only if it answers the
recipe's prompts with its target and generation settings; otherwise the demo stops and
says what differs; a missing one is not regenerated where both trainings are finished and
record the answers they trained on. A run of another recipe (its training part) or trained on
other answers is refused; ``--retrain`` trains such a run again from scratch, keeping the answers
and the other run. ``--force`` starts over; ``--skip-train`` uses the runs as
they are (refused while a training holds either run, whose lock it then holds itself), and
evaluates the checkpoints it names (the final one, else the newest): a report of other weights
(``draft_fingerprint``) is never labelled with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from draftforge import argtypes
from draftforge.eval.demo_report import (
    counted,
    demo_markdown,
    lead_table,
    markdown_table,
    recorded_devices,
    table_rows,
)
from draftforge.eval.demo_runs import DemoPaths, demo_paths, dflash_overrides, dspark_overrides
from draftforge.eval.demo_stages import (
    DemoError,
    Stages,
    evaluations_side_by_side,
    run_side_by_side,
    run_stage,
)
from draftforge.eval.demo_state import (
    EXPORT_RECIPE,
    EXPORT_STAMP,
    answers_digest,
    check_answers_file,
    check_dflash_removable,
    check_export_destination,
    check_removable,
    check_run_removable,
    check_same_recipe,
    check_trained_on,
    check_training_data,
    checkpoint_fingerprints,
    checkpoint_step,
    data_ran_out,
    demo_held,
    eval_is_current,
    export_held,
    export_holds_other_weights,
    export_is_current,
    final_checkpoint,
    force_deletes,
    measured_other_weights,
    model_card_is_current,
    other_recipe,
    recorded_answers,
    remove_output,
    remove_training,
    reported_export_files,
    runs_as_they_are,
    stamp_answers,
    stamped_files,
    trained_on_other_answers,
    trainings_held,
    writers_held,
)
from draftforge.files import write_atomic
from draftforge.splitserve.supervisor import unwinding_on_sigterm

DEFAULT_RECIPE = "recipes/smollm2-cpu.yaml"
WORKLOADS = ("humaneval", "mtbench", "gsm8k")
# Prompts per workload when the recipe's eval.num_prompts is unset (all prompts would take
# hours on a CPU). The recipe's eval section gives the defaults otherwise: smollm2-cpu.yaml's
# 8 prompts x 128 tokens keep the whole demo at about an hour on 2 cores with native bf16 (64 min on
# 2026-12-03: regeneration 11, the two trainings 18 and 12, the two evaluations side by side 22).
FALLBACK_NUM_PROMPTS = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge demo",
        description="End to end: regenerate the recipe's data, train the DSpark draft and the "
        "DFlash ablation, export, evaluate against the baselines, print one table. Finished "
        "stages are skipped when rerun.",
    )
    parser.add_argument(
        "recipe", nargs="?", default=DEFAULT_RECIPE, help=f"default {DEFAULT_RECIPE}"
    )
    parser.add_argument(
        "--num-prompts",
        type=argtypes.positive_int,
        help="prompts per workload (default: the recipe's eval.num_prompts, "
        f"or {FALLBACK_NUM_PROMPTS} when it is unset)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=argtypes.positive_int,
        help="tokens generated per prompt, 2 or more (default: the recipe's eval.max_new_tokens)",
    )
    parser.add_argument("--workloads", type=argtypes.names(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: the recipe's "
                        "eval.workloads)")  # fmt: skip
    parser.add_argument(
        "--skip-train",
        action="store_true",
        help="use the trained runs as they are (no regeneration, no training)",
    )
    parser.add_argument(
        "--markov-init",
        choices=("bigram", "random"),
        default="bigram",
        help="how DSpark's Markov head starts: bigram (default) = train.markov_init=bigram, the "
        "regenerated answers' bigram table, where the draft's head allows it; random = the "
        "recipe's own train.markov_init",
    )
    parser.add_argument("--retrain", action="store_true",
                        help="train again from scratch each run whose recipe (its training part) or "
                        "answers differ from this demo's, which the demo otherwise refuses: deletes "
                        "only that run's training (checkpoints, metrics, config), keeping the "
                        "regenerated answers and the other run; the export and evaluations are redone "
                        "where they depend on it")
    parser.add_argument("--force", action="store_true",
                        help="redo every stage: deletes the demo's two runs (train.output_dir and "
                        "its -dflash twin), the regenerated answers (data.regenerated_file, wherever "
                        "it is), the export and the evaluations (with --skip-train: only the export "
                        "and evaluations)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``draftforge demo``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # a wrong option: argparse's usage error, status 2
    if args.retrain and (args.force or args.skip_train):
        parser.error("--retrain trains again the runs that are not this demo's, keeping the rest; "
                     f"{'--force deletes every output and starts over' if args.force else '--skip-train trains nothing'}: "
                     "give one of them")
    # SIGTERM unwinds like Ctrl-C, so the running stage (a whole training job) is stopped too
    def hint() -> str:  # --force's deletions done or not: a rerun without it would keep the rest
        if getattr(args, "forced", False):
            return RERUN_WITHOUT_FORCE
        if args.force:
            return "rerun the same command (with --force: the earlier outputs were not all deleted yet)"
        return "rerun the same command to continue (finished stages are skipped)"

    with unwinding_on_sigterm("\ndraftforge demo", hint):
        try:
            return run_demo(args, command=" ".join(["draftforge demo", *map(shlex.quote, argv)]))
        except DemoError as err:
            print(f"\ndraftforge demo: {err}", file=sys.stderr)
            if getattr(args, "forced", False):  # the stages' "rerun the demo" means without --force
                print(f"draftforge demo: {RERUN_WITHOUT_FORCE}", file=sys.stderr)
            return err.exit_status


RERUN_WITHOUT_FORCE = ("rerun without --force to continue (finished stages are skipped; with --force "
                       "the demo deletes them and starts over)")


def evaluation_commands(recipe: str, paths: DemoPaths, *, workloads: Sequence[str], num_prompts: int,
                        max_new_tokens: int, dflash_draft: Path | None = None) -> tuple[list[str], list[str]]:
    """The two ``draftforge eval`` commands: the same prompts and decoding, every drafted
    token verified (DFlash has no confidence head to cut its blocks at a threshold, and the
    table subtracts one from the other, so DSpark's is not the recipe's ``eval.verify``
    either), DSpark beside the baselines the table shows. ``dflash_draft``: the DFlash
    checkpoint to evaluate (the one the table names; default: the run's newest)."""
    common = [
        "--recipe", recipe, "--dtype", "float32", "--temperature", "0",
        "--workloads", ",".join(workloads), "--num-prompts", str(num_prompts),
        "--max-new-tokens", str(max_new_tokens),
    ]  # fmt: skip
    eval_args = ["eval", str(paths.export_dir), *common, "--baselines", "none,ngram", "--verify", "full",
                 "--out", str(paths.eval_dir)]  # fmt: skip
    dflash_args = ["eval", str(dflash_draft or paths.dflash_dir), *common, "--baselines", "none", "--no-estimate",
                   "--verify", "full", "--out", str(paths.dflash_eval_dir)]  # fmt: skip
    return eval_args, dflash_args


def run_demo(args: argparse.Namespace, *, command: str) -> int:
    """The stages (see the module docstring); prints the table and the summary line."""
    from draftforge.config import load_recipe

    recipe = args.recipe
    base = load_recipe(recipe, reread="the demo reads it again for each stage")
    if base.train.init_from is not None:
        raise DemoError(f"{recipe}: train.init_from {base.train.init_from}: the demo compares DSpark with "
                        "the DFlash ablation trained from scratch on the same budget, which a draft started "
                        "from an export would not be; leave train.init_from out of the demo's recipe (and "
                        "run 'draftforge train' and 'draftforge eval' for further training)", exit_status=2)
    paths = demo_paths(base)
    # a second demo on these runs is refused at once; held: the runs' training locks (--skip-train)
    with demo_held(paths.run_dir), contextlib.ExitStack() as held:
        return _run_stages(args, command=command, recipe=recipe, base=base, paths=paths, held=held)


def _run_stages(args: argparse.Namespace, *, command: str, recipe: str, base, paths: DemoPaths,
                held: contextlib.ExitStack) -> int:
    from draftforge.config import load_recipe

    dspark_args, markov_start = dspark_overrides(base, paths, args.markov_init)
    cfg = load_recipe(recipe, dspark_args)
    dflash_cfg = load_recipe(recipe, dflash_overrides(paths))
    args.num_prompts = args.num_prompts or cfg.eval.num_prompts or FALLBACK_NUM_PROMPTS
    # before the hour of stages whose table it would empty (a recipe's value: its schema)
    if args.max_new_tokens is not None and args.max_new_tokens < 2:
        from draftforge.errors import InputError

        raise InputError(
            f"--max-new-tokens {args.max_new_tokens}: the first new token comes from the prompt's "
            "prefill, so no verification round would run and no acceptance length be measured; "
            "give 2 or more"
        )
    args.max_new_tokens = args.max_new_tokens or cfg.eval.max_new_tokens
    # checked by argparse, the recipe by its schema; each once, as draftforge eval runs them
    workloads = list(dict.fromkeys(args.workloads or cfg.eval.workloads))
    stages = Stages(total=6)
    print(
        f"draftforge demo: recipe {recipe} (target {cfg.target.model} in {cfg.target.dtype}, "
        f"{cfg.train.steps} training steps per draft in {cfg.train.dtype}), {counted(len(workloads), 'workload')} "
        f"x {counted(args.num_prompts, 'prompt')}, "
        f"{args.max_new_tokens} new tokens; outputs under {paths.run_dir} and {paths.dflash_dir}\n"
        f"DSpark's Markov head starts as {markov_start}",
        flush=True,
    )

    trainings = (
        ("DSpark", paths.run_dir, cfg, dspark_args),
        ("DFlash", paths.dflash_dir, dflash_cfg, dflash_overrides(paths)),
    )
    # a DSpark run trained with the other --markov-init is named as such, not as another recipe's
    other_init = "random" if args.markov_init == "bigram" else "bigram"
    other_options = {"DSpark": (f"--markov-init {other_init}",
                                load_recipe(recipe, dspark_overrides(base, paths, other_init)[0]).to_yaml())}
    checkpoints: dict[str, Path] = {}
    if args.skip_train:  # checked before --force deletes anything: it keeps these runs
        # no training adds (or prunes) checkpoints while the ones picked here are exported and evaluated
        held.enter_context(trainings_held(trainings))
        checkpoints = runs_as_they_are(trainings, answers_digest(paths, cfg), other_options,
                                       regenerated=paths.data_file is not None)

    if args.force:
        # the recipe, where the demo runs, and the user's own training files (a data file kept
        # in the run folder would go with it)
        keep = [Path(recipe), Path.cwd(), *(Path(spec).expanduser() for spec in cfg.data.train_files
                                             if not spec.startswith("builtin:"))]
        outputs = [paths.export_dir, paths.eval_dir, paths.dflash_eval_dir, paths.table]
        if not args.skip_train:
            outputs = [paths.run_dir, paths.dflash_dir, paths.export_dir] + (
                [paths.data_file, paths.data_file.with_name(paths.data_file.name + ".partial")]
                if paths.data_file is not None
                else []
            )
        check_removable(outputs, keep, paths.export_dir)  # all of them before any is deleted
        if paths.dflash_dir in outputs:
            check_run_removable(paths.run_dir, paths.data_file, also=(
                paths.export_dir, paths.eval_dir, paths.dflash_eval_dir, paths.log_dir, paths.table))
            check_dflash_removable(paths.dflash_dir)
            check_training_data(cfg)  # the trainings would refuse it only after the deletions
        with writers_held(outputs, paths):  # a training or regeneration writing there: refused
            for path in outputs:
                remove_output(path, keep)
        args.forced = True  # from here on a rerun continues without --force

    if paths.data_file is not None and paths.data_file.is_file() and not args.skip_train:
        check_answers_file(cfg)
    # stage 4 would refuse it after the hour of stages before it
    check_export_destination(paths.export_dir, "the export stage would replace")
    retrain = set()  # --retrain: the runs of another recipe, trained again (their answers: at the stage)
    if not args.skip_train:  # both runs now: the DFlash one not after the hour of stages before it
        for what, run_dir, run_cfg, _ in trainings:
            if args.retrain and other_recipe(run_dir, run_cfg.to_yaml()) is not None:
                retrain.add(what)
                continue
            check_same_recipe(run_dir, run_cfg.to_yaml(), what, other_option=other_options.get(what),
                              force_does=force_deletes(paths))
    # 1. data
    since = stages.banner("regenerate the training data: the target answers the prompts")
    if args.skip_train:
        stages.skip("--skip-train")
    elif paths.data_file is None:
        stages.skip("data.regenerate is false: training uses data.train_files as they are", done_earlier=False)
    elif paths.data_file.is_file():
        stages.skip(f"{paths.data_file} already answers the recipe's prompts")
    elif (not retrain
          and all(final_checkpoint(run_dir, run_cfg.train.steps) is not None for _, run_dir, run_cfg, _ in trainings)
          and len(recorded := {recorded_answers(run_dir) for _, run_dir, _, _ in trainings}) == 1
          and None not in recorded):
        # answers regenerated now could differ from those both trained on (bf16 on other threads),
        # and nothing after the trainings reads them
        stages.skip(f"{paths.data_file} is missing, but both trainings are finished and record the "
                    "same answers they trained on, so they are not regenerated (--force regenerates "
                    "them and trains both drafts again)")
    else:
        # Its defaults: on a CPU one worker process per usable core, one thread each.
        run_stage("data regenerate", ["data", "regenerate", recipe])
        stages.done(since)

    # 2-3. the two trainings
    answers, regenerated = answers_digest(paths, cfg), paths.data_file is not None
    for what, run_dir, run_cfg, overrides in trainings:
        title = f"train the {what} draft ({run_cfg.train.steps} steps) into {run_dir}" + (
            " -- the ablation: no Markov or confidence head, cross-entropy only"
            if what == "DFlash"
            else ""
        )
        since = stages.banner(title)
        if args.skip_train:
            done = checkpoints[what]
            if done == final_checkpoint(run_dir, run_cfg.train.steps):
                stages.skip(f"finished: {done}")
            else:
                stages.skip(f"--skip-train: using the unfinished run's newest checkpoint {done}")
            continue
        if what in retrain or (args.retrain and trained_on_other_answers(run_dir, answers)):
            why = "of another recipe" if what in retrain else "trained on other answers than the data holds now"
            print(f"    --retrain: {run_dir} holds a {what} run {why}; it is trained again from scratch",
                  flush=True)
            remove_training(run_dir)
        done = final_checkpoint(run_dir, run_cfg.train.steps)
        if done is not None:
            check_trained_on(run_dir, answers, what, regenerated=regenerated)
            stages.skip(f"finished: {done}")
        else:
            if answers is not None:  # before it starts: a resumed training must not switch files
                stamp_answers(run_dir, answers, what, regenerated=regenerated)
            run_stage(f"train {what}", ["train", recipe, *overrides])
            done = final_checkpoint(run_dir, run_cfg.train.steps)
            if done is None:
                raise DemoError(
                    f"training {what} ended without its final checkpoint in {run_dir}/checkpoints; "
                    "the training output above says why (e.g. train.max_bad_steps)"
                )
            stages.done(since)
        checkpoints[what] = done

    # 4. export
    since = stages.banner(f"export the DSpark draft to {paths.export_dir}")
    # --recipe: the DSpark training's recipe as resolved now, its overrides included (the recipe
    # file alone would show the model card a random Markov start where the bigram one trained),
    # with the eval and export sections as they are now (the run's config.yaml keeps older ones)
    export_recipe = paths.run_dir / EXPORT_RECIPE
    write_atomic(export_recipe, cfg.to_yaml())
    export_args = [
        "export", str(paths.run_dir), "--recipe", str(export_recipe), "--out", str(paths.export_dir),
        "--arch", cfg.export.arch,
        "--max-shard-size-mb", str(cfg.export.max_shard_size_mb),
        *(["--with-embeddings"] if cfg.export.with_embeddings else []),
    ]  # fmt: skip
    stamp = paths.run_dir / EXPORT_STAMP
    # the weights of the checkpoints the table names (None where unreadable: nothing compared)
    fingerprints = {what: checkpoint_fingerprints(path) for what, path in checkpoints.items()}
    if export_is_current(paths, export_args, checkpoints["DSpark"]) and not export_holds_other_weights(
            paths.export_dir, fingerprints["DSpark"]):
        stages.skip(f"{paths.export_dir} is this export of {checkpoints['DSpark']}")
    else:
        stamp.unlink(missing_ok=True)  # the stamp names the folder's command: none while it changes
        # the digest the export took of the folder it wrote, under its own lock: another export
        # into the folder may have replaced it since, and a digest taken now would be that one's
        files = reported_export_files(run_stage("export", export_args, indent=True))
        with export_held(paths.export_dir, files):  # still the folder it wrote: else refused
            if export_holds_other_weights(paths.export_dir, fingerprints["DSpark"]):
                raise DemoError(
                    f"the export stage exported other weights than {checkpoints['DSpark']}, the DSpark "
                    f"checkpoint the demo picked (a newer checkpoint appeared in {paths.run_dir} since: a "
                    "training still writing there?); rerun the demo once no training writes there",
                    exit_status=2)
            write_atomic(stamp, json.dumps({"command": export_args, "files": files}))
        stages.done(since)

    # 5. evaluation: DSpark export + baselines, and DFlash from its checkpoint, same prompts
    eval_args, dflash_args = evaluation_commands(recipe, paths, workloads=workloads,
                                                 num_prompts=args.num_prompts,
                                                 max_new_tokens=args.max_new_tokens,
                                                 dflash_draft=checkpoints["DFlash"])  # fmt: skip
    threads = cfg.target.num_threads
    parallel = evaluations_side_by_side(threads)
    each = "one thread" if threads == 1 else f"{threads} threads"
    since = stages.banner(
        f"evaluate on {', '.join(workloads)}: DSpark vs no draft and n-gram, and the DFlash "
        f"ablation ({f'side by side, {each} each' if parallel else 'one after the other'})"
    )
    # what draftforge eval takes from the recipe's eval section and uses here: an edit there
    # means another evaluation (the seed only where something is drawn: greedy DFlash
    # without the estimate draws nothing; verification and baselines are on the command line)
    from_recipe = {"seed": cfg.eval.seed}
    jobs = {}
    if not eval_is_current(paths.eval_dir, eval_args[1:], stamp, from_recipe,  # stamp: the export
                           fingerprints=fingerprints["DSpark"]):
        jobs["eval-dspark"] = eval_args
    if not eval_is_current(paths.dflash_eval_dir, dflash_args[1:], checkpoints["DFlash"] / "COMPLETE",
                           fingerprints=fingerprints["DFlash"]):
        jobs["eval-dflash"] = dflash_args
    if jobs:
        # the export evaluated is the one stamped, and no export replaces it while it is read
        with (export_held(paths.export_dir, stamped_files(stamp)) if "eval-dspark" in jobs
              else contextlib.nullcontext()):
            run_side_by_side(jobs, paths.log_dir, parallel=parallel and len(jobs) > 1)
        stages.done(since)
    else:
        stages.skip(f"{paths.eval_dir} and {paths.dflash_eval_dir} hold this evaluation already")

    # 6. the model card gets the measured table; the demo's table
    since = stages.banner("the table (and the export's model card with the measured acceptance)")
    dspark_report = json.loads((paths.eval_dir / "report.json").read_text())
    dflash_report = json.loads((paths.dflash_eval_dir / "report.json").read_text())
    # the table names the checkpoints picked: never a report of other weights under their names
    for what, folder, report in (("DSpark", paths.eval_dir, dspark_report),
                                 ("DFlash", paths.dflash_eval_dir, dflash_report)):
        if (measured := measured_other_weights(report, fingerprints[what])) is not None:
            raise DemoError(
                f"{folder / 'report.json'} measured other weights ({measured}) than {checkpoints[what]}, "
                f"the {what} checkpoint the demo picked (a training wrote a newer one meanwhile?); "
                "rerun the demo once no training writes there", exit_status=2)
    if not model_card_is_current(paths):
        run_stage("export (model card)", [*export_args, "--eval-report", str(paths.eval_dir / "report.md")],
                  indent=True)
    rows = table_rows(dspark_report, dflash_report)
    table = markdown_table(rows) + "\n\n" + lead_table(
        (paths.eval_dir / "report.json", dspark_report),
        (paths.dflash_eval_dir / "report.json", dflash_report),
    )
    text = demo_markdown(
        table, command=command, cfg=cfg, paths=paths, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, block_size=cfg.draft.block_size,
        trained={what: checkpoint_step(path) for what, path in checkpoints.items()},
        stopped={what: "data_exhausted" for what, run_dir, _, _ in trainings
                 if data_ran_out(run_dir) == checkpoints[what]},
        skip_train=args.skip_train, devices=recorded_devices(dspark_report, dflash_report),
        prompts={name: entry["num_prompts"] for name, entry in dspark_report["workloads"].items()},
        reports=(dspark_report, dflash_report),
    )  # fmt: skip
    write_atomic(paths.table, text)
    stages.done(since)
    print(f"\n{text}")
    print(
        f"demo: table written to {paths.table}; {stages.elapsed()}"
    )
    macro = rows[-1]
    print(
        f"export_dir={paths.export_dir} al_dspark={macro['dspark']:.3f} "
        f"al_dflash={macro['dflash']:.3f} al_ngram={macro['ngram']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
