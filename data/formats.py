"""Rows of a data file -> validated conversations.

Three row forms are understood (``format: auto`` picks by key, in this order):

- ``messages``: OpenAI form, ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``;
  a content may be a list of text parts ``[{"type": "text", "text": str}, ...]``, joined with
  spaces as SGLang's chat API joins them (parts of other types, such as images, are refused);
- ``conversations``: ShareGPT form, ``[{"from": "system"|"human"|"gpt", "value": str}, ...]``,
  or OpenAI's ``{"role": ..., "content": ...}`` turns under that key (SpecForge's prepared data);
- ``prompt``: a plain prompt, a string or a list of strings (successive user turns whose
  replies the target writes).

Each form may carry a top-level ``system`` string (as LLaMA-Factory's ShareGPT rows do): the
system prompt, refused beside a leading system message. An empty one is no system prompt
(LLaMA-Factory writes ``""`` for rows without one, and the template's default then applies,
as when serving a request without a system message). A system prompt of whitespace only, as
the key or as a leading system message, is refused: the template would render the blank text
in place of its default one (a leading system message that is empty is kept as it is given,
the empty system prompt a request holding it is served with).

Errors name an entry of a row by its place in the row's own list, counted from 1 over all its
entries whatever their role (a top-level ``system`` key is not one): ``message 4 (assistant)``
in a ``messages`` row, ``turn 4 (assistant)`` or ``turn 4 (gpt)`` in a ``conversations`` one;
so do tokenisation's (:mod:`draftforge.data.tokenize`). ``user turn 2`` or ``assistant turn 2``
(the held-out check, regeneration) counts the turns of that role only. ``unfinished_turns``
holds 0-based indices into the row's own list; ``reply_token_ids`` (written by ``data
regenerate``) is a list beside it.

A conversation is an optional leading system message, then user and assistant turns
alternating, starting with a user turn. Every malformed row raises
:class:`DataFormatError` naming the file, the row (the 1-based line for jsonl) and what is
wrong. What a row must contain depends on what it is read for (``expect``):

- ``"prompt"``: prompts for regeneration; assistant turns, if any, are dropped (the target
  writes new ones) and plain prompts are allowed;
- ``"conversation"``: finished conversations to train on; the last turn must be an
  assistant reply, and no assistant turn may keep its reasoning apart from its content
  (``reasoning_content``, as servers with a reasoning parser return a reply) or hold a tool
  call (``tool_calls``, ``function_call``): only the content is trained on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from draftforge.errors import InputError

RowFormat = Literal["auto", "messages", "sharegpt", "prompt"]
Expect = Literal["prompt", "conversation"]

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
_FORMAT_KEYS = {"messages": "messages", "sharegpt": "conversations", "prompt": "prompt"}
# where a reply's reasoning is kept apart from its content: OpenAI-compatible servers with a
# reasoning parser (SGLang, vLLM), Qwen3's template (reasoning_content), gpt-oss's (thinking)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# where a reply's tool calls are kept apart from its content: OpenAI's (and the legacy one)
TOOL_CALL_KEYS = ("tool_calls", "function_call")
TOOLS_KEYS = ("tools", "functions")  # a row's tool definitions (OpenAI; its older name)


class DataFormatError(InputError):
    """A data file or one of its rows is malformed; the message says where and what."""


@dataclass(frozen=True)
class RowLocation:
    """Where a row came from: ``path`` and its 1-based line (jsonl) or row (json, parquet)."""

    path: str
    number: int
    unit: Literal["line", "row"] = "line"

    def __str__(self) -> str:
        return f"{self.path}, {self.unit} {self.number}"


@dataclass(frozen=True)
class Conversation:
    """A validated conversation: a stable id, role/content messages and where it came from."""

    id: str
    messages: list[dict[str, str]]
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # what the row calls its entries, for errors naming one: "turn" in a 'conversations' row
    entry: str = field(default="message", compare=False)

    @property
    def system(self) -> str | None:
        """The system prompt, if the conversation has one."""
        if self.messages and self.messages[0]["role"] == "system":
            return self.messages[0]["content"]
        return None

    @property
    def user_turns(self) -> list[str]:
        """The user messages in order."""
        return [m["content"] for m in self.messages if m["role"] == "user"]


def _fail(where: RowLocation, problem: str) -> DataFormatError:
    return DataFormatError(f"{where}: {problem}")


def _check_unicode(text: str, where: RowLocation, what: str) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's ``"\\ud800"`` alone): Python reads it, but no
    UTF-8 encoder writes it, so it failed later with a traceback, in the tokenizer or when a
    target rank sent the sample's id to its trainer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _fail(
            where,
            f"{what} holds a lone UTF-16 surrogate ({text[err.start]!r}, character "
            f"{err.start + 1}), which is not valid Unicode; was the file written with a split "
            "surrogate pair?",
        ) from None


def detect_format(row: dict[str, Any]) -> str | None:
    """The row form named by the first of ``messages``, ``conversations``, ``prompt`` present."""
    for fmt, key in _FORMAT_KEYS.items():
        if row.get(key) is not None:  # parquet fills absent columns with null
            return fmt
    return None


def row_id(row: dict[str, Any], where: RowLocation, default: str) -> str:
    """The row's ``id`` field as a string, or ``default`` when the row has none."""
    if "id" not in row or row["id"] is None:
        return default
    value = row["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _fail(where, f"'id' must be a string or an integer, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise _fail(where, "'id' is empty")
    return text


def _messages_from_openai(value: Any, where: RowLocation) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise _fail(where, f"'messages' must be a list of messages, got {type(value).__name__}")
    out = []
    for i, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise _fail(where, f"message {i} must be an object with 'role' and 'content'")
        if "role" not in message:
            raise _fail(where, f"message {i} has no 'role'")
        role = message["role"]
        if role not in ROLES:
            raise _fail(
                where,
                f"message {i} has role {role!r}; valid roles: {', '.join(ROLES)}",
            )
        if "content" not in message:
            raise _fail(where, f"message {i} ({role}) has no 'content'")
        text = _text(message["content"], where, f"message {i} ({role}) content", role=role)
        out.append({"role": role, "content": text})
    return out


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words: "null", "a list", "a number", "a string", "a boolean"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _text(content: Any, where: RowLocation, what: str, *, role: str, parts: bool = True) -> str:
    """An OpenAI message's content as text: a string, or (``parts``) a list of text parts
    ``[{"type": "text", "text": ...}]`` joined with spaces, as SGLang's chat API joins them for
    a template that renders a string content. Parts of other types (images) are refused."""
    if isinstance(content, str):
        return content
    if not parts or not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        reply = content is None and role == "assistant"
        hint = " (an assistant message with only tool_calls? draftforge trains on text replies)" if reply else ""
        raise _fail(where, f"{what} must be a string, got {_type_name(content)}{hint}")
    texts = []
    for j, part in enumerate(content, start=1):
        kind = part.get("type")
        if kind != "text":
            raise _fail(
                where,
                f"{what} part {j} is of type {kind!r}; only text parts ({{\"type\": \"text\", "
                f"\"text\": ...}}) are accepted: draftforge trains on text only",
            )
        if not isinstance(part.get("text"), str):
            raise _fail(where, f"{what} part {j} (text) 'text' must be a string, got "
                               f"{_type_name(part.get('text'))}")
        texts.append(part["text"])
    return " ".join(texts)


def _messages_from_sharegpt(value: Any, where: RowLocation) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise _fail(where, f"'conversations' must be a list of turns, got {type(value).__name__}")
    out = []
    for i, turn in enumerate(value, start=1):
        if not isinstance(turn, dict):
            raise _fail(where, f"turn {i} must be an object with 'from' and 'value'")
        # SpecForge's prepared data: OpenAI's turns; a null 'from' is none (parquet fills the
        # fields a turn lacks when one column holds turns of both forms)
        if turn.get("from") is None and turn.get("role") is not None:
            who, what, roles = "role", "content", {role: role for role in ROLES}
        else:
            who, what, roles = "from", "value", SHAREGPT_ROLES
        if who not in turn:
            raise _fail(where, f"turn {i} has no 'from' (nor 'role')")
        speaker = turn[who]
        # not a string: a list or an object is no role, and not hashable (a TypeError in the lookup)
        if not isinstance(speaker, str) or speaker not in roles:
            raise _fail(
                where,
                f"turn {i} has {who!r} {speaker!r}; valid values: {', '.join(roles)}",
            )
        if what not in turn:
            raise _fail(where, f"turn {i} ({speaker}) has no {what!r}")
        text = _text(turn[what], where, f"turn {i} ({speaker}) {what}", role=roles[speaker],
                     parts=what == "content")
        out.append({"role": roles[speaker], "content": text})
    return out


def _messages_from_prompt(row: dict[str, Any], where: RowLocation) -> list[dict[str, str]]:
    value = row["prompt"]
    if isinstance(value, str):
        turns = [value]
    elif isinstance(value, list):
        if not value:
            raise _fail(where, "'prompt' is an empty list: give at least one user turn")
        for i, turn in enumerate(value, start=1):
            if not isinstance(turn, str):
                raise _fail(
                    where,
                    f"'prompt' must be a string or a list of strings; its item {i} is "
                    f"{'null' if turn is None else type(turn).__name__}",
                )
        turns = list(value)
    else:
        raise _fail(
            where, f"'prompt' must be a string or a list of strings, got {type(value).__name__}"
        )
    return [{"role": "user", "content": t} for t in turns]


def _system_from_key(row: dict[str, Any], where: RowLocation) -> list[dict[str, str]]:
    """The row's top-level ``system`` string as a system message; none when absent, null or
    empty (LLaMA-Factory's "no system prompt": an empty system message would replace the
    template's default one, which a request without a system message is served with). One of
    whitespace only is refused: neither empty (no system prompt) nor a prompt, it would replace
    the template's default with blank text (SmolLM2's "You are a helpful AI assistant named
    SmolLM, ..."), as a leading system message of whitespace only would (:func:`check_structure`)."""
    system = row.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise _fail(where, f"'system' must be a string, got {type(system).__name__}")
    if not system.strip():
        raise _fail(where, f"'system' holds only whitespace ({system!r}), which the chat template would "
                           "render in place of its default system prompt; for no system prompt (the "
                           "template's default applies, as when serving a request without one) leave it out "
                           "or give the key as \"\"; else write the system prompt")
    return [{"role": "system", "content": system}]


def check_structure(
    messages: list[dict[str, str]],
    where: RowLocation,
    expect: Expect,
    *,
    label: Callable[[int], str] = lambda i: f"message {i + 1}",
    own_replies: bool = False,
) -> None:
    """Check turn order: optional system first, then user/assistant alternating from a user.

    ``label`` names ``messages[i]`` in errors as the row itself does (``parse_row``: the
    place in its own list, which a top-level ``system`` key does not shift). ``own_replies``:
    the assistant turns are trained as the data gives them (not the target's answers, where an
    empty reply is what the target did), so an empty one is refused. A leading system message
    of whitespace only is refused (see the module notes); an empty one is kept."""
    if not messages:
        raise _fail(where, "the conversation is empty")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for i, message in enumerate(messages[1:], start=1):
        if message["role"] == "system":
            raise _fail(where, f"{label(i)} is a system message; only the first may be")
    if not any(m["role"] == "user" for m in body):
        raise _fail(where, "the conversation has no user turn")
    if messages[0]["role"] == "system" and messages[0]["content"] and not messages[0]["content"].strip():
        raise _fail(where, f"{label(0)} (system) holds only whitespace ({messages[0]['content']!r}), which the "
                           "chat template would render in place of its default system prompt; for no system "
                           "prompt (the template's default applies, as when serving a request without one) "
                           "remove the message, else write the system prompt")
    for i, m in enumerate(messages):
        if not m["content"].strip() and m["role"] == "user":
            raise _fail(where, f"{label(i)} (user) is empty")
        if not m["content"].strip() and m["role"] == "assistant" and own_replies and expect == "conversation":
            raise _fail(where, f"{label(i)} (assistant) is empty: trained as it is, it would teach the "
                               "draft to end the turn at once; fill the reply, remove it with the user "
                               "turn before it, or set data.regenerate: true to have the target answer")
    if expect == "prompt":
        # Assistant turns are replaced by the target; only the user turns' order matters.
        if body[0]["role"] != "user":
            raise _fail(where, "the conversation must start with a user turn (after any system)")
        return
    offset = len(messages) - len(body)
    for i, message in enumerate(body):
        wanted = "user" if i % 2 == 0 else "assistant"
        if message["role"] != wanted:
            raise _fail(
                where,
                f"{label(i + offset)} is {message['role']!r} where {wanted!r} is expected: "
                "turns must alternate user, assistant, user, ... after an optional system message",
            )
    last = body[-1]["role"]
    if expect == "conversation" and last != "assistant":
        raise _fail(
            where,
            "the conversation ends with a user turn that has no assistant reply; "
            "training conversations must end with an assistant turn "
            "(or set data.regenerate: true to have the target answer)",
        )


def parse_row(
    row: Any,
    where: RowLocation,
    *,
    default_id: str,
    fmt: RowFormat = "auto",
    expect: Expect = "prompt",
    own_replies: bool = False,
) -> Conversation:
    """Validate one row and return it as a :class:`Conversation`.

    With ``expect="prompt"`` assistant turns are dropped (and ``unfinished_turns``, which
    indexes them): the result holds the system prompt (if any) and the user turns, ready
    for regeneration. ``own_replies``: see :func:`check_structure`.
    """
    if not isinstance(row, dict):
        raise _fail(where, f"a row must be a JSON object, got {_json_kind(row)}")
    chosen = detect_format(row) if fmt == "auto" else fmt
    if chosen is None or row.get(_FORMAT_KEYS[chosen]) is None:
        # a null is no value (parquet fills a column a row lacks with null): say so, rather
        # than list 'messages' among the keys of a row said to have no 'messages'
        keys = ", ".join(sorted(str(k) for k, v in row.items() if v is not None)) or "none"
        nulls = sorted(str(k) for k, v in row.items() if v is None)
        keys += f"; null: {', '.join(nulls)}" if nulls else ""
        wanted = (
            "'messages', 'conversations' or 'prompt'"
            if fmt == "auto"
            else f"'{_FORMAT_KEYS[fmt]}' (data.format: {fmt})"
        )
        raise _fail(where, f"the row has no {wanted} (its keys: {keys})")
    if chosen == "prompt" and expect == "conversation":
        raise _fail(
            where,
            "a plain 'prompt' row has no reply to train on; set data.regenerate: true "
            "to have the target answer it",
        )
    if chosen == "messages":
        messages = _messages_from_openai(row["messages"], where)
    elif chosen == "sharegpt":
        messages = _messages_from_sharegpt(row["conversations"], where)
    else:
        messages = _messages_from_prompt(row, where)
    system = _system_from_key(row, where)
    if system and messages and messages[0]["role"] == "system":
        raise _fail(
            where,
            f"the row has a 'system' key and its '{_FORMAT_KEYS[chosen]}' start with a system "
            "message too; keep one of them",
        )
    messages = system + messages
    noun = "message" if chosen == "messages" else "turn"  # as the row's own errors name them
    check_structure(messages, where, expect, label=lambda i: f"{noun} {i + 1 - len(system)}",
                    own_replies=own_replies)
    _refuse_tools(row, where)
    ident = row_id(row, where, default_id)
    _check_unicode(ident, where, "'id'")
    for i, message in enumerate(messages):
        what = "'system'" if i < len(system) else f"{noun} {i + 1 - len(system)} ({message['role']}) content"
        _check_unicode(message["content"], where, what)
    if expect == "conversation" and chosen != "prompt":
        _refuse_reasoning(row[_FORMAT_KEYS[chosen]], messages[len(system):], where, noun)
    extra = {k: v for k, v in row.items() if k not in ("id", "messages", "conversations", "prompt")}
    if "unfinished_turns" in extra:  # written by 'data regenerate': replies cut at the limit
        # indices into the row's own list, which a top-level 'system' key does not shift
        own = _unfinished_turns(extra["unfinished_turns"], messages[len(system):], where)
        extra["unfinished_turns"] = [i + len(system) for i in own]
    if "reply_token_ids" in extra:  # written by 'data regenerate': the replies' ids as generated
        extra["reply_token_ids"] = [None] * len(system) + _reply_token_ids(
            extra["reply_token_ids"], messages[len(system):], where)
    if expect == "prompt":  # the target writes new replies: the old ones go, and which were cut
        messages = [m for m in messages if m["role"] != "assistant"]
        extra.pop("unfinished_turns", None)
        extra.pop("reply_token_ids", None)
    return Conversation(id=ident, messages=messages, source=str(where), extra=extra, entry=noun)


def _holds(value: Any) -> bool:
    """Whether a key's ``value`` holds anything: a string with text, or any other value but
    null and an empty list or object (reasoning given as text parts or an object counts)."""
    if isinstance(value, str):
        return bool(value.strip())
    return value is not None and value != [] and value != {}


def _refuse_tools(row: dict, where: RowLocation) -> None:
    """Refuse a row that defines tools: only its messages reach the chat template, so the prompt
    would be rendered without them, not as the target is served (templates such as Qwen3's and
    Llama 3.1's write the tools into the prompt), and regeneration would answer without them."""
    key = next((k for k in TOOLS_KEYS if _holds(row.get(k))), None)
    if key is not None:
        raise _fail(where, f"the row defines tools in {key!r}, which draftforge does not pass to the chat "
                           "template: the prompt would be rendered (and answered) without them, not as "
                           "the target is served; remove the key to train without tools, or the row")


def _refuse_reasoning(
    turns: list[Any], messages: list[dict[str, str]], where: RowLocation, noun: str
) -> None:
    """Refuse an assistant turn to train on that holds its reasoning or a tool call beside its
    content: only role and content reach the chat template, so the reasoning (most of what a
    thinking target generates) or the call would be left out of training without a word; and
    one whose per-turn ``weight`` asks not to train on it, which would be trained on."""
    for i, (turn, message) in enumerate(zip(turns, messages, strict=True), start=1):
        key = next((k for k in REASONING_KEYS if _holds(turn.get(k))), None)
        weight = turn.get("weight")  # axolotl's per-turn 0/1: whether to train on the turn
        if message["role"] == "assistant" and weight is not None and weight != 1:
            raise _fail(
                where,
                f"{noun} {i} (assistant) has 'weight' {weight!r}: draftforge supervises every assistant "
                "turn of a conversation trained as it is and honours no per-turn weight; remove the key "
                "to train on the turn, or the turn with the user turn before it",
            )
        calls = next((k for k in TOOL_CALL_KEYS if turn.get(k)), None)  # null or [] is none
        if message["role"] == "assistant" and calls is not None:
            raise _fail(
                where,
                f"{noun} {i} (assistant) holds {calls!r} beside its content: the target generated "
                "a tool call there, which only role and content cannot show, so the draft would "
                "learn to end the turn where the target calls a tool; draftforge trains on text "
                "replies: remove the conversation (or the key, if the call is not the target's)",
            )
        if message["role"] == "assistant" and key is not None:
            raise _fail(
                where,
                f"{noun} {i} (assistant) has its reasoning in {key!r}, beside its content, which "
                "alone is trained on: put the reasoning into the content as the target writes it "
                "(Qwen3: '<think>\\n...\\n</think>\\n\\n' before the reply), or remove the key "
                "to train on the reply alone",
            )


def _reply_token_ids(value: Any, messages: list[dict[str, str]], where: str) -> list[list[int] | None]:
    """The replies' generated token ids, a list beside the row's messages (null for the others);
    null (a parquet column other rows fill) is none. Anything else is refused."""
    if value is None:
        return [None] * len(messages)
    ok = isinstance(value, list) and len(value) == len(messages) and all(
        ids is None or (message["role"] == "assistant" and isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids))
        for ids, message in zip(value, messages, strict=False))
    if not ok:
        raise DataFormatError(
            f"{where}: reply_token_ids must be a list beside the {len(messages)} messages holding each "
            f"assistant reply's generated token ids (non-negative integers) or null, got "
            f"{json.dumps(value)[:80]}")
    return value


def _unfinished_turns(value: Any, messages: list[dict[str, str]], where: str) -> list[int]:
    """The message indices of replies cut at the generation limit; null (a parquet column
    other rows fill) is none. Anything but assistant message indices is refused."""
    if value is None:
        return []
    assistant = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    if (not isinstance(value, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i in assistant for i in value)):
        raise DataFormatError(
            f"{where}: unfinished_turns must list the indices of assistant messages (replies "
            f"cut at the generation limit), got {json.dumps(value)[:80]}; assistant messages "
            f"here: {sorted(assistant)}"
        )
    return value
