"""How ``draftforge eval`` renders the workloads' prompts, and the check that a draft is not
measured on prompts rendered otherwise than its training rendered them: without ``--recipe``
the default ``target.generation`` (thinking off, the tokenizer's own template) is used, and a
draft whose saved training recipe says otherwise is refused."""

from __future__ import annotations

import sys
from pathlib import Path

from draftforge.errors import InputError
from draftforge.recipe_errors import RecipeError
from draftforge.recipe_yaml import read_yaml
from draftforge.train.export import CARD_FILE, CONFIG_FILE
from draftforge.train.export_cli import saved_recipe


def prompt_rendering(draft: str, recipe: str | None, generation) -> tuple[dict, dict | None]:
    """How the workloads' prompts are rendered (report.json's ``prompt_rendering``), said in one
    line, and what the draft records it was trained with (None with ``--recipe``, whose
    ``target.generation`` is used as given, with a note where the draft records other
    settings, or where it records nothing).

    Without ``--recipe`` the prompts are rendered with the default ``target.generation``
    (thinking off, the tokenizer's own template): a draft whose saved training recipe has
    ``enable_thinking`` otherwise is refused, since its acceptance length would be measured on
    prompts unlike those it was trained on (:func:`check_training_template` checks the
    template once the tokenizer is loaded)."""
    thinking = f"thinking {'on' if generation.enable_thinking else 'off'}"
    template = ("the recipe's target.generation.chat_template" if generation.chat_template is not None
                else "the target tokenizer's chat template")
    rendering = {"enable_thinking": generation.enable_thinking,
                 "chat_template": "target.generation" if generation.chat_template is not None else "tokenizer",
                 "training_recipe": None}
    recorded = None
    if recipe:
        said = f"{thinking} (the recipe's target.generation.enable_thinking) and {template}"
        trained, where = _training_generation(draft)
        differs = [] if trained is None else [
            f"{key} {_shown(trained[key])} where --recipe has {_shown(getattr(generation, key))}"
            for key in ("enable_thinking", "chat_template") if trained[key] != getattr(generation, key)]
        if trained is not None:
            rendering["training_recipe"] = where
        if differs:  # the recipe given is the user's choice: said, not refused
            print(f"eval: note: {draft} was trained with target.generation {' and '.join(differs)} "
                  f"(as {where} records): its acceptance length is measured on prompts rendered "
                  "otherwise than its training's", file=sys.stderr, flush=True)
    else:
        recorded, where = _training_generation(draft)
        if recorded is None:
            said = (f"{thinking} (the default without --recipe) and {template}; {where}: if it was "
                    "trained with other target.generation settings (enable_thinking, chat_template), "
                    "pass the recipe it was trained with as --recipe")
        else:
            if recorded["enable_thinking"] != generation.enable_thinking:
                trained = str(recorded["enable_thinking"]).lower()
                against = f"against {recorded['model']!r}, " if recorded["model"] else ""
                raise InputError(
                    f"{draft}: trained with target.generation.enable_thinking {trained} ({against}"
                    f"as {where} records), but without --recipe the workload prompts "
                    f"are rendered with enable_thinking {str(generation.enable_thinking).lower()} (the "
                    "default), so its acceptance length would be measured on prompts unlike those it "
                    f"was trained on: {recorded['fix']}")
            rendering["training_recipe"] = where
            said = f"{thinking} (the default without --recipe, as {where} records its training) and {template}"
    print(f"eval: workload prompts rendered with {said}", flush=True)
    return rendering, recorded


def _shown(value: object) -> str:
    """A recorded setting in a note: booleans as YAML writes them, a template by its length."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"a template of {len(value)} characters"
    return "none (the tokenizer's template)"


def _training_generation(draft: str) -> tuple[dict | None, str]:
    """``({"enable_thinking", "chat_template", "model", "where", "fix"}, where)``: the ``target.generation``
    settings of the recipe the draft was trained with, as it records it, and the file read: a
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
        fix = (f"pass --recipe with the recipe it was trained with (the YAML of {card}'s Recipe section, "
               "saved as a file), or --prompts-file with token ids rendered as its training rendered them")
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
        fix = (f"pass --recipe {path} (the recipe it was trained with), or --prompts-file with token ids "
               "rendered as its training rendered them")
    try:
        data = read_yaml(text, where)
    except RecipeError:
        return None, f"the draft's training recipe {where} could not be read as YAML"
    target = data.get("target") if isinstance(data, dict) else None
    generation = target.get("generation") if isinstance(target, dict) else None
    generation = {} if generation is None else generation  # a section left out: its defaults
    thinking = generation.get("enable_thinking", False) if isinstance(generation, dict) else None
    template = generation.get("chat_template") if isinstance(generation, dict) else None
    if not isinstance(target, dict) or not isinstance(thinking, bool) or not isinstance(template, (str, type(None))):
        return None, f"the draft's training recipe {where} gives no readable target.generation"
    return {"enable_thinking": thinking, "chat_template": template, "model": target.get("model"),
            "where": where, "fix": fix}, where


def check_training_template(recorded: dict, target, draft: str) -> None:
    """Without ``--recipe``: refuse a draft trained with a ``target.generation.chat_template``
    other than the target tokenizer's own, which renders the workloads here."""
    template = recorded["chat_template"]
    if template is None:
        return
    try:
        own = target.tokenizer.chat_template
    except (RuntimeError, AttributeError):  # no tokenizer: the workloads' rendering says so
        return
    if own == template:
        return
    shown = template if len(template) <= 40 else template[:37] + "..."
    raise InputError(
        f"{draft}: trained with target.generation.chat_template {shown!r} ({len(template)} characters, as "
        f"{recorded['where']} records), but without --recipe the workload prompts are rendered with "
        f"the target tokenizer's own template, {'which differs' if own else 'and it has none'}, so its "
        f"acceptance length would be measured on prompts unlike those it was trained on: {recorded['fix']}")
