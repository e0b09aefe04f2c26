"""``draftforge export RUN_DIR_OR_CHECKPOINT [--out DIR]``: write the folder SGLang and llama.cpp load.

``--arch`` chooses between the two DSpark architectures only (Qwen3DSparkModel,
LingDSparkModel). The DFlash ablation (markov_rank 0) has no DSpark export:
SGLang refuses it; evaluate it from its training checkpoint with ``draftforge eval``.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from draftforge import argtypes
from draftforge.train.config import ExportConfig

RECIPE_NAMES = ("recipe.yaml", "config.yaml", "resolved_recipe.yaml")
EXPORT_FILES_KEY = "export_files"  # the line `export_files=<sha256>`: train.export.export_digest


def build_parser() -> argparse.ArgumentParser:
    defaults = ExportConfig()
    parser = argparse.ArgumentParser(
        prog="draftforge export",
        description="Export a training checkpoint as a Hugging Face DSpark folder (config.json + "
        "safetensors + model card), atomically.",
    )
    parser.add_argument("source", help="run directory (newest complete checkpoint), checkpoint folder or model.safetensors")
    parser.add_argument("--out", type=argtypes.path, help="destination folder (default: the recipe's export.out_dir or <run>/export)")
    parser.add_argument("--arch", choices=["Qwen3DSparkModel", "LingDSparkModel"], help=f"default: the recipe's export.arch ({defaults.arch} when unset)")
    parser.add_argument("--with-embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="also write embed_tokens / lm_head (servers attach the target's anyway); "
                             "default: the recipe's export.with_embeddings, --no-with-embeddings overrides it")  # fmt: skip
    parser.add_argument("--max-shard-size-mb", type=argtypes.positive_float, help=f"shard above this size, in megabytes of 10^6 bytes as huggingface_hub's "
                        f"max_shard_size counts them (default: the recipe's export.max_shard_size_mb, "
                        f"{defaults.max_shard_size_mb} when unset)")
    parser.add_argument("--recipe", help="the recipe the run used (default: the one saved in the run directory)")
    parser.add_argument("--eval-report", help="markdown table from 'draftforge eval' for the model card (its report.md, or the folder holding it; default: "
                        "RUN_DIR/eval/report.md when exporting a run directory, used only if its report.json "
                        "names this run, its checkpoint or its export as the draft and is not older than the "
                        "checkpoint; else the card says Not measured). A report.md with the report.json "
                        "'draftforge eval' wrote beside it is refused unless that file's draft_fingerprint "
                        "is of the weights exported")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the export with huggingface_hub")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``draftforge export``."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from draftforge.splitserve.supervisor import unwinding_on_sigterm

    # SIGTERM (timeout(1), a scheduler) unwinds like Ctrl-C, from the first read on: the staging
    # folder (a partial copy of the draft) and the folders made above --out are removed, an
    # older export kept
    with unwinding_on_sigterm("draftforge export", "no partial folder was left; rerun the same command"):
        return _export(args)


def _export(args) -> int:
    from safetensors import SafetensorError

    from draftforge.errors import InputError
    from draftforge.train.export import export_draft, push_to_hub, read_newest

    source = Path(args.source).expanduser()
    if not source.exists():
        raise InputError(f"{source} does not exist; give a run directory, a "
                         "checkpoint folder or a model.safetensors")
    if args.push_to_hub:  # a malformed id never uploads: said before the export, not after it
        _check_repo_id(args.push_to_hub)
    if args.eval_report and Path(args.eval_report).is_dir():
        # the folder 'draftforge eval --out' wrote, as 'draftforge eval compare' takes it
        if not (Path(args.eval_report) / "report.md").is_file():
            raise InputError(f"--eval-report {args.eval_report}: a folder without report.md; give the "
                             "report.md that 'draftforge eval' wrote, or the folder holding it")
        args.eval_report = str(Path(args.eval_report) / "report.md")
    if args.eval_report and not Path(args.eval_report).is_file():
        raise InputError(f"--eval-report {args.eval_report}: no such file")
    run_dir = source if (source / "checkpoints").is_dir() else None
    if run_dir is None:  # a checkpoint the user named is not swapped for another
        from draftforge.train.export import unmarked_checkpoint_note

        export_cfg, card, out, cfg, state = _card_and_weights(args, source, None)
        if (note := unmarked_checkpoint_note(source, used="exported")) is not None:
            print(f"export: note: {note}", flush=True)
    else:
        # a run folder's newest checkpoint, resolved once a try: the card's recipe and report and
        # the weights all come from it, even if the training saves a newer one meanwhile; one it
        # prunes (train.keep_last) while read is replaced by the newest, card and weights alike
        source, (export_cfg, card, out, cfg, state) = read_newest(
            run_dir, lambda folder: (folder, _card_and_weights(args, folder, run_dir)))
    print(f"export: {source} -> {out}", flush=True)
    published: list[str] = []
    try:
        path = export_draft(
            (state, cfg),
            out,
            arch=args.arch or export_cfg.arch,
            with_embeddings=export_cfg.with_embeddings if args.with_embeddings is None else args.with_embeddings,
            max_shard_size_mb=args.max_shard_size_mb or export_cfg.max_shard_size_mb,
            card=card,
            published=published.append,
        )
    except (OSError, SafetensorError) as err:
        # a full disk, a read-only folder: export_draft left nothing partial. safetensors
        # reports its own write failing as "Error while serializing: I/O error: No space left
        # on device (os error 28)", a SafetensorError, not an OSError
        full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(err)
        raise InputError(
            f"writing the export to {out} failed ({err}); no partial folder was left and an older "
            "export there is untouched. "
            + ("Free space (or choose another --out) and rerun" if full else "Choose another --out and rerun")
        ) from None
    # the folder this export wrote, digested under its lock (export_digest): another export may
    # have replaced it since; the demo records this line's digest, not one it takes of the folder
    print(f"{EXPORT_FILES_KEY}={published[-1]}", flush=True)
    if args.push_to_hub:
        try:
            url = push_to_hub(path, args.push_to_hub)
        except RuntimeError as err:
            print(f"draftforge export: {err}", file=sys.stderr)
            return 1
        print(f"export: pushed to {url}")
    print(f"export_dir={path}")
    return 0


def _card_and_weights(args, source: Path, run_dir: Path | None):
    """(export settings, model card, --out, draft config, state dict) for ``source``,
    a checkpoint (a run folder's newest, ``run_dir`` then given), its recipe and report."""
    from draftforge.errors import InputError
    from draftforge.files import check_folder_writable, dangling_link
    from draftforge.train.export import (
        SINGLE_FILE,
        TRAINING_CONFIG_FILE,
        ModelCard,
        load_training_checkpoint,
    )

    recipe_path = Path(args.recipe) if args.recipe else saved_recipe(source)
    export_cfg, card = ExportConfig(), ModelCard()
    output_dir = None
    if recipe_path is not None:
        from draftforge.config import load_recipe

        recipe = load_recipe(recipe_path)
        export_cfg, output_dir = recipe.export, recipe.train.output_dir
        card.target = recipe.target.model
        card.recipe = recipe.to_yaml()
        print(f"model card: recipe from {recipe_path}", flush=True)
        card.data = training_data_line(recipe)
    out = args.out or export_cfg.out_dir
    if out is None:
        # a checkpoint's run is the folder above its checkpoints/, wherever this runs from
        # (train.output_dir may be relative to where training ran); so is a checkpoint's model.safetensors
        checkpoint = (source if source.is_dir() else source.parent).resolve()
        of_checkpoint = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
        base = run_dir or of_checkpoint or (Path(output_dir) if output_dir else None)
        if base is None:
            folder = source if source.is_dir() else source.parent
            if not ((folder / SINGLE_FILE).is_file() and (folder / TRAINING_CONFIG_FILE).is_file()
                    and (source.is_dir() or source.suffix == ".safetensors")):
                load_training_checkpoint(source)  # no checkpoint: says what the source is, weights unread
            raise InputError("give --out DIR (no recipe or run directory to derive it from)")
        out = base / "export"
    _check_out_apart(Path(out), source, run_dir)
    # where the export and its lock are made: a file in the path, or a folder not writable, is
    # said before the weights are read, not as "free space" after
    check_folder_writable(Path(out).expanduser().absolute().parent, "--out", str(out))
    if (dangling := dangling_link(Path(out).expanduser())) is not None:
        raise InputError(f"--out {out} {dangling}; give a folder")
    cfg, state = load_training_checkpoint(source)
    if args.eval_report:
        report = Path(args.eval_report)
        card.acceptance_table = read_eval_report(report, option="--eval-report ")
        check_report_measured(report, _fingerprints(state, cfg), source)
    else:  # RUN_DIR/eval/report.md, only where it measured this draft (the weights hashed only then)
        report = (default_report(run_dir, source, Path(out), weights=_fingerprints(state, cfg))
                  if run_dir and (run_dir / "eval" / "report.md").is_file() else None)
        try:
            card.acceptance_table = read_eval_report(report) if report is not None else None
        except InputError as err:
            print(f"model card: not used: {err}; the card says Not measured", flush=True)
            report = None
    if report is not None:
        print(f"model card: acceptance table from {report}", flush=True)
    if recipe_path is not None:
        differ = recipe_mismatch(recipe, cfg)
        if differ:
            raise InputError(
                f"the recipe {recipe_path} does not describe the checkpoint "
                f"{source} ({'; '.join(differ)}); its model card would show another draft's recipe. "
                "Pass the recipe the run used (its run folder holds it as config.yaml)"
            )
    return export_cfg, card, out, cfg, state


def _check_out_apart(out: Path, source: Path, run_dir: Path | None) -> None:
    """Refuse an ``--out`` that is, or holds, the checkpoint being exported or its run: an
    export replaces its destination whole, and the message for a non-export folder ("empty it
    first") would have the user delete the very checkpoints they export."""
    from draftforge.errors import InputError

    folder = (source if source.is_dir() else source.parent).resolve()
    run = run_dir or (folder.parent.parent if folder.parent.name == "checkpoints" else None)
    where = out.expanduser().resolve()
    for what, path in (("the run", run), ("the checkpoint", folder)):
        if path is None:
            continue
        path = path.resolve()
        if where == path or where in path.parents:
            relation = "is" if where == path else "holds"
            raise InputError(
                f"--out {out} {relation} {what} being exported ({path}); an export replaces its "
                f"folder whole, so choose a folder outside it (by default {run or folder}/export)")
    from draftforge.train.checkpoint import checkpoints_holding

    if (held := checkpoints_holding(where)) is not None:  # inside another run's, or this one's
        raise InputError(
            f"--out {out} lies inside a training run's checkpoints ({held}), whose folders the run "
            "deletes when it prunes old checkpoints (train.keep_last); choose a folder outside them "
            f"(e.g. {held.parent / 'export'})")


def _check_repo_id(repo_id: str) -> None:
    """Refuse a ``--push-to-hub`` id the Hub would refuse (huggingface_hub's own rule), naming it."""
    from draftforge.errors import InputError

    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # push_to_hub says how to install it, after the export
        return
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise InputError(f"--push-to-hub {repo_id!r}: not a Hub repository id ({err}); give "
                         "'namespace/name' or 'name'") from None


def recipe_mismatch(recipe, cfg) -> list[str]:
    """``key: recipe X, checkpoint Y`` for each draft-section field the recipe resolves that the
    checkpoint's :class:`~draftforge.train.model.DSparkConfig` holds otherwise (the attention
    backend is how it trained, not what it is), and for each field the recipe's target decides
    (vocabulary, the target's width and layers) where its shape is known without loading it."""
    from dataclasses import asdict

    from draftforge.splitserve.launch import _model_config

    held = asdict(cfg)
    named = {key: value for key, value in recipe.draft.model_dump().items() if value is not None}
    derived = {key: value for key, value in (_model_config(recipe) or {}).items() if key not in named}
    differ = []
    for fields, say in ((named, "draft.{key}: recipe {value!r}"),
                        (derived, f"{{key}}: recipe's target {recipe.target.model!r} gives {{value!r}}")):
        for key, value in fields.items():
            if key == "attention_backend" or key not in held:
                continue
            theirs = held[key]
            if isinstance(value, (list, tuple)):
                value, theirs = list(value), list(theirs)
            if value != theirs:
                differ.append(f"{say.format(key=key, value=value)}, checkpoint {theirs!r}")
    return differ


def training_data_line(recipe) -> str:
    """The model card's training-data line; the target's sampling settings only where it
    regenerated the answers, and a warning where the run skipped the held-out check."""
    data, generation = recipe.data, recipe.target.generation
    if data.regenerate:
        answers = (f"answers regenerated by the target (temperature {generation.temperature}, top_p "
                   f"{generation.top_p}, top_k {generation.top_k}, thinking {generation.enable_thinking})")
    else:
        answers = "answers as the files give them (not regenerated by the target)"
    # data.num_samples: the run read only the files' first N conversations, not the files whole
    files = f"Files {data.train_files}" + (f" (their first {data.num_samples} conversations)"
                                           if data.num_samples is not None else "")
    line = f"{files}, {answers}, max length {data.max_length}."
    if not data.overlap_check:
        line += " Held-out check off (data.overlap_check: false): evaluation prompts may be in the training data."
    return line


def read_eval_report(report: Path, *, option: str = "") -> str:
    """The markdown of an eval report (``report.md``) for the model card's acceptance section.
    Refused, naming the file: one that is not UTF-8 text (a plot handed by mistake), the
    ``report.json`` beside it (JSON, which the card would show raw), or a text without a
    markdown table (no line starting with ``|``): the card would claim a measurement it lacks."""
    from draftforge.errors import InputError

    advice = "give the report.md that 'draftforge eval' wrote"
    try:
        text = report.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{option}{report}: not a markdown eval report (not UTF-8 text); {advice}") from None
    try:
        json.loads(text)
    except ValueError:
        pass
    else:
        raise InputError(f"{option}{report}: is JSON (an eval's report.json?), not the markdown table "
                         f"for the model card; {advice} (beside its report.json)")
    if not any(line.lstrip().startswith("|") for line in text.splitlines()):
        raise InputError(f"{option}{report}: holds no markdown table (no line starting with '|'); {advice}")
    return text


def check_report_measured(report: Path, weights: set[str], source: Path) -> None:
    """Refuse an ``--eval-report`` whose ``report.json`` (the one 'draftforge eval' wrote beside
    its report.md) is unreadable, names no ``draft_fingerprint`` or one not in ``weights``
    (:func:`_fingerprints`): the card would show another draft's, or an earlier checkpoint's,
    measurement. A table without a report.json beside it is the user's own, taken as given; one
    edited since its report.json was written is taken, and said."""
    from draftforge.errors import InputError

    measured = report.with_name("report.json")
    if not measured.is_file():
        print(f"model card: note: no report.json beside {report}, so which draft it measured is not "
              "checked; its table is used as --eval-report asks", flush=True)
        return
    advice = (f"evaluate this draft ('draftforge eval {source} ...') and pass that report, or export "
              "without --eval-report")
    try:
        written = json.loads(measured.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InputError(f"--eval-report {report}: {measured} is not readable JSON ({err}), so "
                         f"which draft it measured is unknown; {advice}") from None
    fingerprint = written.get("draft_fingerprint") if isinstance(written, dict) else None
    if not isinstance(fingerprint, str):
        raise InputError(f"--eval-report {report}: {measured} records no draft_fingerprint (the weights "
                         f"the evaluation read), so which draft it measured is unknown; {advice}")
    if fingerprint not in weights:
        draft = written.get("draft_path") or written.get("draft")
        raise InputError(
            f"--eval-report {report}: {measured} has draft_fingerprint {fingerprint}, the weights of "
            f"another draft than {source} holds (it measured {draft or 'a draft it does not name'}: "
            f"another run, an earlier checkpoint, or an export of one); {advice}")
    if written.get("report_md_sha256") not in (None, _digest_of(report)):
        print(f"model card: note: {report} is not the table {measured.name} was written with (edited "
              "since?); it is used as --eval-report asks", flush=True)


def _fingerprints(state, cfg) -> set[str]:
    """The fingerprints an evaluation of these weights records (``draft_fingerprint``, of every
    tensor): of the checkpoint's as read, and as this export writes them (``fc.weight``'s
    column blocks in ascending target-layer order)."""
    from draftforge.train.export import ascending_target_layers, draft_fingerprint

    written = ascending_target_layers(state, cfg, progress=lambda _line: None)[0]
    both = (state, written) if written["fc.weight"] is not state["fc.weight"] else (state,)
    return {draft_fingerprint(weights) for weights in both}


def default_report(run_dir: Path, checkpoint: Path, out: Path, *, weights: set[str]) -> Path | None:
    """``run_dir/eval/report.md`` when its ``report.json`` measured this export's draft (the run,
    ``checkpoint``, the one exported, or the run's export folder) with the weights exported: its
    ``draft_fingerprint`` is one of ``weights`` (:func:`_fingerprints`; reports without one: no
    earlier than the checkpoint was completed); else None, with one line saying why a report
    there was not used."""
    import json

    from draftforge.train.checkpoint import COMPLETE
    from draftforge.train.export import SINGLE_FILE

    report = run_dir / "eval" / "report.md"
    if not report.is_file():
        return None
    measured = report.with_name("report.json")
    try:
        written = json.loads(measured.read_text())
        draft = written.get("draft_path") or written.get("draft")  # reports before draft_path: as typed
    except (OSError, ValueError, AttributeError):
        draft = None
    ours = {p.expanduser().resolve() for p in
            (run_dir, checkpoint, checkpoint / SINGLE_FILE, run_dir / "export", out)}
    done = checkpoint / COMPLETE
    if not isinstance(draft, str):
        why = f"{measured} is missing or names no draft, so which draft it measured is unknown"
    elif written.get("report_md_sha256") not in (None, _digest_of(report)):  # reports before it: not checked
        why = (f"{report} is not the table {measured.name} was written with (another evaluation's, or "
               "edited; pass it with --eval-report to use it)")
    elif Path(draft).expanduser().resolve() not in ours:
        why = f"{measured} measured draft {draft}, not this run, its checkpoint {checkpoint.name} or its export"
    elif written.get("draft_fingerprint") is not None:  # the weights it read decide
        if written["draft_fingerprint"] in weights:
            return report
        why = (f"{measured} measured other weights than checkpoint {checkpoint.name} holds (another "
               "checkpoint, or an export of one)")
    elif measured.stat().st_mtime < (done if done.exists() else checkpoint / SINGLE_FILE).stat().st_mtime:
        why = f"{measured} is older than checkpoint {checkpoint.name}, so it measured an earlier draft"
    else:
        return report
    print(f"model card: {report} not used ({why}); the card says Not measured", flush=True)
    return None


def _digest_of(report: Path) -> str | None:
    from draftforge.eval.report import text_digest

    try:
        return text_digest(report.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def saved_recipe(source: Path) -> Path | None:
    """The recipe saved with what ``source`` names: the checkpoint's own ``recipe.yaml`` (the run
    segment that wrote it; a run folder's newest checkpoint's), else the run folder's
    ``config.yaml``, the newest segment's, which may be a later rerun's that trained nothing."""
    folders = [source] if source.is_dir() else [source.parent]
    if (source / "checkpoints").is_dir():
        from draftforge.train.export import ExportError, latest_checkpoint

        try:
            folders.insert(0, latest_checkpoint(source))
        except ExportError:  # no checkpoint: loading it says so
            pass
    folders += [f.parent.parent for f in list(folders) if f.parent.name == "checkpoints"]
    for folder in folders:
        for name in RECIPE_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


if __name__ == "__main__":
    sys.exit(main())
