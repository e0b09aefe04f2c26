"""What ``draftforge eval`` takes from the recipe a draft was trained with, as the draft records
it (a checkpoint's ``recipe.yaml``, its run's ``config.yaml``, an export's model card): without
``--recipe``, how the workloads' prompts are rendered (thinking mode and chat template, so that a
draft is not measured on prompts unlike its training's), and without ``--target`` either, the
target it was trained against. With ``--recipe``, its ``target.generation`` renders them."""

from __future__ import annotations

import sys
from pathlib import Path

from draftforge.recipe_errors import RecipeError
from draftforge.recipe_yaml import read_yaml
from draftforge.train.export import CARD_FILE, CONFIG_FILE
from draftforge.train.export_cli import saved_recipe


def prompt_rendering(draft: str, record: tuple[dict | None, str], recipe: str | None,
                     generation) -> tuple[dict, object]:
    """How the workloads' prompts are rendered (report.json's ``prompt_rendering``) and the
    ``target.generation`` that renders them, said in one line. ``record`` is
    ``training_record(draft)``'s answer, read once by eval for this and ``recorded_target``.

    With ``--recipe`` its ``target.generation`` is used as given, with a note where the draft's
    saved training recipe records other settings. Without it, the thinking mode and chat
    template the draft's training recipe records are used, so that its acceptance length is
    measured on prompts rendered as its training's were; a draft that records none gets the
    defaults (thinking off, the tokenizer's own template) and a line saying what to do if it
    was trained otherwise."""
    rendering = {"training_recipe": None}
    if recipe:
        trained, where = record
        differs = [] if trained is None else [
            f"{key} {_shown(trained[key])} where --recipe has {_shown(getattr(generation, key))}"
            for key in ("enable_thinking", "chat_template") if trained[key] != getattr(generation, key)]
        if trained is not None:
            rendering["training_recipe"] = where
        if differs:  # the recipe given is the user's choice: said, not refused
            print(f"eval: note: {draft} was trained with target.generation {' and '.join(differs)} "
                  f"(as {where} records): its acceptance length is measured on prompts rendered "
                  "otherwise than its training's", file=sys.stderr, flush=True)
        source = "the recipe's target.generation"
    else:
        recorded, where = record
        if recorded is None:
            source = (f"the default without --recipe; {where}: if it was trained with other "
                      "target.generation settings (enable_thinking, chat_template), pass the recipe it "
                      "was trained with as --recipe")
        else:
            generation = generation.model_copy(update={"enable_thinking": recorded["enable_thinking"],
                                                       "chat_template": recorded["chat_template"]})
            rendering["training_recipe"] = where
            source = f"as {where} records its training"
    thinking = f"thinking {'on' if generation.enable_thinking else 'off'}"
    template = (f"a chat template of {len(generation.chat_template)} characters from target.generation"
                if generation.chat_template is not None else "the target tokenizer's chat template")
    rendering.update(enable_thinking=generation.enable_thinking,
                     chat_template="target.generation" if generation.chat_template is not None else "tokenizer")
    print(f"eval: workload prompts rendered with {thinking} and {template} ({source})", flush=True)
    return rendering, generation


def _shown(value: object) -> str:
    """A recorded setting in a note: booleans as YAML writes them, a template by its length."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"a template of {len(value)} characters"
    return "none (the tokenizer's template)"


def training_record(draft: str) -> tuple[dict | None, str]:
    """``({"enable_thinking", "chat_template", "model", "trust_remote_code"}, where)``: the
    ``target.generation`` settings and the target of the recipe the draft was trained with, as
    it records it (``model`` as written, None where it records none), and the file read: a
    checkpoint's ``recipe.yaml`` (a run folder's newest checkpoint's), else its run's
    ``config.yaml``; an export's model card (README.md's Recipe section, which ``draftforge
    export`` writes). ``(None, why)`` where it records none, or not readably."""
    folder = Path(draft).expanduser()
    heading = "\n## Recipe\n\n```yaml\n"  # export.model_card's last section
    if (folder / CONFIG_FILE).is_file():  # an export
        card = folder / CARD_FILE
        try:
            text = card.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None, f"the draft records no training recipe (no readable {card})"
        if heading not in text:
            return None, f"the draft records no training recipe ({card} has no Recipe section)"
        body = text.split(heading, 1)[1]
        end = body.rfind("\n```")  # the closing fence: the card's last line but its blank one
        text, where = body if end < 0 else body[:end], f"{card} (its Recipe section)"
    else:
        try:
            path = saved_recipe(folder)
        except OSError:
            path = None
        if path is None:
            return None, f"the draft records no training recipe (no recipe.yaml or config.yaml with {draft})"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None, f"the draft's training recipe {path} could not be read"
        where = str(path)
    try:
        data = read_yaml(text, where)
    except RecipeError:
        return None, f"the draft's training recipe {where} could not be read as YAML"
    if not isinstance(data, dict):
        return None, f"the draft's training recipe {where} is not a YAML mapping of sections"
    target = data.get("target")
    if not isinstance(target, dict):
        return None, (f"the draft's training recipe {where} has no target section" if target is None else
                      f"the draft's training recipe {where} has a target that is not a section of keys")
    generation = target.get("generation")
    generation = {} if generation is None else generation  # a section left out: its defaults
    thinking = generation.get("enable_thinking", False) if isinstance(generation, dict) else None
    template = generation.get("chat_template") if isinstance(generation, dict) else None
    if not isinstance(thinking, bool) or not isinstance(template, (str, type(None))):
        return None, f"the draft's training recipe {where} gives no readable target.generation"
    model = target.get("model")
    return {"enable_thinking": thinking, "chat_template": template,
            "model": None if isinstance(model, str) and not model.strip() else model,
            "trust_remote_code": target.get("trust_remote_code") is True}, where


def recorded_target(record: tuple[dict | None, str], dtype: str | None = None):
    """Without ``--target`` or ``--recipe``: the target the draft's saved training recipe names
    (``record``: ``training_record``'s answer),
    as eval's ``TargetConfig`` (in ``dtype``, else float32, as eval's default), said in one line. Refused (the
    message names the record) where it records none, a random target (built from its recipe's
    shape) or one whose recipe turns on ``trust_remote_code`` (only a recipe turns it on)."""
    from pydantic import ValidationError

    from draftforge.errors import InputError
    from draftforge.splitserve.config import TargetConfig

    ask = "give --target NAME_OR_DIR (or --recipe RECIPE)"
    recorded, where = record
    if recorded is None or recorded["model"] is None:
        raise InputError(f"{ask}: {where if recorded is None else f'{where} names no target.model'}")
    model = recorded["model"]
    if not isinstance(model, str):  # a hand-edited record: a number, a list
        raise InputError(f"{ask}: {where} records target.model {model!r} ({type(model).__name__}), "
                         "which is neither a name nor a folder")
    if model == "random":
        raise InputError(f"{ask}: {where} records the random target, which is built from its recipe's "
                         "target.shape: pass that recipe as --recipe")
    if recorded["trust_remote_code"]:
        raise InputError(f"{ask}: {where} records target {model!r} with target.trust_remote_code true, which "
                         "eval turns on only from a recipe: pass that recipe as --recipe")
    from draftforge.splitserve import smollm2

    if model != smollm2.NAME and not Path(model).expanduser().is_dir():  # not on this machine
        relative = (", a path relative to where the training ran" if not Path(model).expanduser().is_absolute()
                    else "")
        raise InputError(f"{ask}: {where} records target {model!r}{relative}, which is neither a registered "
                         f"name ({smollm2.NAME}) nor a folder here: give this machine's copy as --target")
    try:
        target = TargetConfig(model=model, dtype=dtype or "float32")
    except ValidationError as err:
        reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        raise InputError(f"{ask}: {where} records target {model!r}: {reasons}") from None
    here = "" if model == smollm2.NAME or Path(model).expanduser().is_absolute() else \
        f" (a relative path, found here as {Path(model).resolve()})"
    print(f"eval: target {model!r}{here}, as {where} records its training (--target chooses another)", flush=True)
    return target
