"""What the demo derives from a recipe: where its runs and outputs go (:class:`DemoPaths`)
and the overrides that make the DSpark draft and the DFlash ablation of it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def _default_position_weighting() -> str:
    from draftforge.train.config import LossConfig

    return LossConfig.model_fields["position_weighting"].default


# DFlash = the same draft without the Markov and confidence heads, trained on pure
# cross-entropy. Everything else (data, steps, anchors, lr, layers) stays the recipe's.
# (No Markov head, so no bigram start either; and no KL term or D-PACE position weighting,
# whatever the recipe sets: D-PACE weights slots by the confidence targets, DSpark's objective.)
DFLASH_OVERRIDES = (
    "draft.markov_rank=0",
    "draft.enable_confidence_head=false",
    "draft.confidence_head_with_markov=false",
    "train.markov_init=random",
    "train.loss.ce_weight=1",
    "train.loss.tv_weight=0",
    "train.loss.bce_weight=0",
    "train.loss.kl_weight=0",
    f"train.loss.position_weighting={_default_position_weighting()}",
)


@dataclass(frozen=True)
class DemoPaths:
    """Everything the demo reads and writes, derived from the recipe."""

    run_dir: Path
    dflash_dir: Path
    data_file: Path | None  # None when the recipe trains on its files as they are
    export_dir: Path
    eval_dir: Path
    dflash_eval_dir: Path
    log_dir: Path
    table: Path


def demo_paths(cfg) -> DemoPaths:
    """The demo's paths for a loaded recipe (a ``RecipeConfig``)."""
    from draftforge.data.loading import regenerated_path

    run_dir = Path(cfg.train.output_dir)
    if run_dir.name in ("", ".."):
        from draftforge.eval.demo_stages import DemoError

        raise DemoError(
            f"train.output_dir {str(cfg.train.output_dir)!r}: the demo writes the DFlash ablation's "
            "run beside the DSpark run, in a folder named after it with '-dflash' added, so the "
            "output folder needs a name of its own: set train.output_dir to one such as "
            "runs/smollm2-cpu", exit_status=2)
    return DemoPaths(
        run_dir=run_dir,
        dflash_dir=run_dir.with_name(run_dir.name + "-dflash"),
        data_file=regenerated_path(cfg.data, run_dir) if cfg.data.regenerate else None,
        # expanded as draftforge export expands it: a "~/..." folder is the one the export writes
        export_dir=Path(cfg.export.out_dir).expanduser() if cfg.export.out_dir else run_dir / "export",
        eval_dir=run_dir / "eval",
        dflash_eval_dir=run_dir / "eval-dflash",
        log_dir=run_dir / "demo-logs",
        table=run_dir / "demo.md",
    )


def dspark_overrides(cfg, paths: DemoPaths, markov_init: str) -> tuple[list[str], str]:
    """The DSpark training's overrides and a line saying how its Markov head starts.

    ``bigram`` applies where it can: the answers exist before training (the demo
    regenerates them first) and the head is a vanilla or gated table."""
    if markov_init == "random":
        return [], f"the recipe's ({cfg.train.markov_init}), as --markov-init random asks"
    if paths.data_file is None:
        return [], f"the recipe's ({cfg.train.markov_init}): no regenerated answers to count"
    if not cfg.draft.has_markov_table:
        return [], (
            f"the recipe's ({cfg.train.markov_init}): a bigram start needs a vanilla or gated "
            f"head (this draft: rank {cfg.draft.markov_rank}, {cfg.draft.markov_head_type})"
        )
    return ["train.markov_init=bigram"], "the regenerated answers' bigram table"


def dflash_overrides(paths: DemoPaths) -> list[str]:
    """The DFlash ablation's overrides: its objective and architecture, its own run
    directory, and the DSpark run's regenerated data (so it trains on the same answers)."""
    overrides = [*DFLASH_OVERRIDES, _path_override("train.output_dir", paths.dflash_dir)]
    if paths.data_file is not None:
        overrides.append(_path_override("data.regenerated_file", paths.data_file))
    return overrides


def _path_override(key: str, path: Path) -> str:
    """``key=PATH``, the path quoted where an override's YAML would read it as something else
    (``/exp #3/run`` as ``/exp``, ``/a: b/run`` as a mapping)."""
    from draftforge.config import RecipeError, parse_override

    plain = f"{key}={path}"
    try:
        if parse_override(plain)[1] == str(path):
            return plain
    except RecipeError:
        pass
    return f"{key}={json.dumps(str(path), ensure_ascii=False)}"
