"""Conversations -> token ids and loss masks, through the target's own chat template.

The whole conversation is rendered with the chat template (the recipe's override, if
any, and the serving thinking mode), then tokenised once. Each assistant turn's text is
located by rendering the conversation up to that turn twice: once ending with the
generation prompt (what the server sends before the model speaks) and once including
the turn. What lies between is what the model generates: the reply and the template's
end-of-turn marker (``<|im_end|>`` for ChatML). Whitespace the template puts after the
marker is never generated (serving stops at the marker) and is not supervised, nor is
what a template appends after the last message when no generation prompt follows (Phi-3's
``eos_token``): it ends the conversation, not a turn.

The server tokenises the prompt alone, so no token of what it serves spans the end of the
generation prompt. Tokenised as one string, a byte-level BPE merges the newline a
generation prompt ends with and the first spaces or newlines of a reply that starts with
two or more of them (``"\n   return"``: ``ĊĠĠ``, ``Ġreturn`` instead of ``Ċ``, ``ĠĠ``,
``Ġreturn``), and a pre-tokenizer's look-ahead (GPT-2's, SmolLM2's) splits a
generation prompt's final ``"\n\n"`` (Llama-3's, Qwen3's with thinking off) as ``Ċ``, ``Ċ``
before a reply but as ``ĊĊ`` at the end of the prompt the server tokenises: where a token
spans that point, or the text before it tokenises differently alone, the text before it and
the text from it are tokenised apart, as the server's prompt and the generated reply are.

A template that rewrites earlier turns once the conversation goes on (Qwen3's drops the
empty reasoning block from every assistant turn but the last) renders them in the
whole conversation as the server shows them in later prompts, not as the model wrote
them: those turns are left unsupervised (context, counted in the stats) and the last
assistant turn, rendered as it was generated, is supervised. A reply cut at the
generation limit is supervised from where its text starts (anything the template puts
before it was not generated; only whitespace there, such as Mistral's ``" " + content``, is
supervised from the generation prompt's end as in a finished turn: the first generated
token holds it, ``ĠHello``) to where it ends; templates that strip replies are matched on
the stripped text. What else the template puts before the last turn's cut reply is left out
of the sample: the served prompt did not show it either (Qwen3's empty reasoning block before
a reply cut inside its reasoning, which has no ``</think>``).

A reply whose token ids as the target generated them are known (``data regenerate`` records
them, and the producer's own answers carry them: ``reply_token_ids`` beside the messages) is
supervised as those ids where they spell its text exactly, not as its text tokenised again:
a byte-level BPE spells some text otherwise than the target generated it (SmolLM2 writes
``ĊĊ`` before a list item, which ``"\n\n1."`` tokenises as ``Ċ``, ``Ċ``, ``1``). The text before
and after such a reply is tokenised apart from it, as the served prompt and the end-of-turn
token are. Ids that spell other text (a template that strips or rewrites replies) leave the
reply tokenised from its text. Later turns' prompts still show earlier replies as their text
tokenised in one piece with the prompt, as a server does: there the sample keeps the earlier
reply as generated, so the context before a later turn can differ from the served prompt by
a token where a reply begins or ends with whitespace that merges across the boundary.

Tokens whose first character falls in such a span get loss mask 1. Samples are cut to
``max_length`` tokens; samples left with fewer than ``min_loss_tokens`` supervised
tokens are dropped and counted.

A reply whose own text spells a special token (a ShareGPT dump with a literal ``<|im_end|>`` or
``<|endoftext|>`` inside a reply) tokenises to that token's id, so the draft would learn to
end a turn (or emit another control token) in mid-reply, where the target never does: a
conversation in which a supervised token of an assistant reply's text (not the template's
marker after it, and before the cut to ``max_length``) is one of the tokenizer's special
tokens (``all_special_tokens`` and the added tokens marked special; Qwen3's ``<think>`` is
not one) is dropped and counted like a short one, never refused: the producer tokenises
chunk by chunk during training. The same text in a user or system turn, or in an earlier
turn the template rewrites (context, not supervised), is kept: the target's server
tokenises the prompt the same way, so the draft sees what the target sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jinja2 import TemplateError, TemplateSyntaxError

from draftforge.data.formats import Conversation
from draftforge.errors import InputError


class ChatTemplateError(InputError):
    """The chat template cannot be used to locate assistant turns, or fails on a conversation.

    ``conversation_index``: set when raised by a ``generate`` call, the failing
    conversation's index in it, for callers that know its id and source to name them.
    """

    conversation_index: int | None = None


class RewrittenReply(ChatTemplateError):
    """The text of an assistant reply cut at ``max_new_tokens`` is not in its rendering: the
    template rewrote it (Qwen3's ``\\n\\n</think>`` printed as ``\\n</think>``), so where its
    supervised tokens end cannot be found. The conversation is dropped and counted."""


# What rendering a chat template raises: jinja2's errors (``raise_exception(...)``, syntax), and
# Python's own from an expression in the template (``message['content'] + 1``: TypeError).
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, ArithmeticError)


def template_failure(exc: Exception, where: str) -> ChatTemplateError:
    """The error for a chat template that raised ``exc`` (one of ``TEMPLATE_ERRORS``, e.g.
    ``raise_exception('System role not supported')``) while rendering ``where``; a template
    that does not parse is the template's fault, not the conversation's, and says so."""
    if isinstance(exc, TemplateSyntaxError):
        return ChatTemplateError(
            f"the chat template is not valid Jinja (template line {exc.lineno}: {exc.message}); "
            "fix target.generation.chat_template (or the tokenizer's chat template)"
        )
    reason = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
    return ChatTemplateError(
        f"the chat template fails on {where} ({reason}); change the conversation or set "
        "target.generation.chat_template"
    )


@dataclass(frozen=True)
class TokenizedSample:
    """One training sample: token ids and a 0/1 loss mask of the same length."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_loss_tokens(self) -> int:
        """How many tokens are supervised."""
        return sum(self.loss_mask)


@dataclass
class TokenizeStats:
    """Counts from :func:`tokenize_conversations`."""

    num_conversations: int = 0
    num_kept: int = 0
    num_truncated: int = 0
    num_dropped_short: int = 0
    # the ids of every dropped conversation, whichever the reason (the producer sends them on)
    dropped_ids: list[str] = field(default_factory=list)
    num_context_turns: int = 0  # assistant turns the template rewrites later: left unsupervised
    # dropped because an assistant reply's text holds a special token's text (see the module notes)
    num_dropped_special: int = 0
    special_example: tuple[str, str] | None = None  # (conversation id, token text): the first one
    # dropped because the template rewrites the text of a reply cut at max_new_tokens (RewrittenReply)
    num_dropped_rewritten: int = 0
    rewritten_example: str | None = None  # the first one's conversation id

    def summary(self) -> str:
        """One line with the counts."""
        context = (f", {self.num_context_turns} earlier assistant turns left unsupervised (the chat "
                   "template rewrites them in later prompts)") if self.num_context_turns else ""
        return (
            f"{self.num_kept}/{self.num_conversations} samples kept, "
            f"{self.num_truncated} truncated, {self.num_dropped_short} dropped "
            f"(too few supervised tokens){special_note(self.num_dropped_special, self.special_example)}"
            f"{rewritten_note(self.num_dropped_rewritten, self.rewritten_example)}{context}"
        )


def special_note(count: int, example: tuple[str, str] | None) -> str:
    """``", N dropped (an assistant reply contains special-token text ...)"``, or nothing for 0."""
    if not count:
        return ""
    such = f" such as {example[1]!r}, e.g. conversation {example[0]!r}" if example else ""
    return f", {count} dropped (an assistant reply contains special-token text{such})"


def rewritten_note(count: int, example: str | None) -> str:
    """``", N dropped (the chat template rewrites the text of a reply cut ...)"``, or nothing for 0."""
    if not count:
        return ""
    such = f", e.g. conversation {example!r}" if example else ""
    return (f", {count} dropped (the chat template rewrites the text of a reply cut at "
            f"max_new_tokens, so its supervised tokens cannot be located{such})")


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool,
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> str:
    """The chat template's text for ``messages`` (no tokenisation)."""
    _require_template(tokenizer, chat_template)
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            enable_thinking=enable_thinking,
        )
    except TEMPLATE_ERRORS as exc:
        raise template_failure(exc, "this conversation") from exc


def _require_template(tokenizer: Any, chat_template: str | None) -> None:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "the tokenizer has no chat template; set target.generation.chat_template"
        )


def assistant_spans(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    chat_template: str | None = None,
    enable_thinking: bool = False,
    unfinished_turns: Sequence[int] = (),
) -> tuple[str, list[tuple[int, int]], list[int]]:
    """The rendered conversation, the ``[start, end)`` character span of each supervised
    assistant turn, and the indices of the assistant turns left unsupervised because the
    template renders them differently once the conversation goes on (see the module notes).

    For the message indices in ``unfinished_turns`` (replies cut at the
    generation limit) the span covers the reply's text only: the template's
    end-of-turn marker after it was never generated by the target.
    """
    text, spans, context, _, _, _ = _locate_turns(tokenizer, messages, chat_template=chat_template,
                                                  enable_thinking=enable_thinking,
                                                  unfinished_turns=unfinished_turns)
    return text, spans, context


def _locate_turns(tokenizer, messages, *, chat_template, enable_thinking, unfinished_turns,
                  added_messages: int = 0, entry: str = "message"):
    """:func:`assistant_spans` plus where each supervised turn's generation prompt ends (the
    end of the text the server tokenises as that turn's prompt) and where its reply's own text
    lies in the rendering (``(start, end)``, or its message index where the template rewrites
    the reply so that it cannot be found there). Errors name a turn as the row's own errors do
    (:mod:`draftforge.data.formats`): ``message 4 (assistant)``, the 4th of the row's own list
    counted from 1 over all roles (``entry``: ``turn`` for a ShareGPT row); ``added_messages``
    (a top-level ``system`` key's message) go before that list. Last, each supervised turn's
    message index."""
    kwargs = {"chat_template": chat_template, "enable_thinking": enable_thinking}
    text = render(tokenizer, messages, add_generation_prompt=False, **kwargs)
    assistant = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    trailer = _trailer(tokenizer, messages[: assistant[0]], **kwargs) if assistant else ""
    spans, context, prompt_ends, replies, turns = [], [], [], [], []
    for index in assistant:
        message = messages[index]
        name = f"{entry} {index + 1 - added_messages} (assistant)"  # as data/formats.py names it
        before = render(tokenizer, messages[:index], add_generation_prompt=True, **kwargs)
        upto = render(tokenizer, messages[: index + 1], add_generation_prompt=False, **kwargs)
        if trailer and upto.endswith(trailer) and text.endswith(trailer):
            upto = upto[: -len(trailer)]  # ends the conversation, not this turn
        if not (upto.startswith(before) and text.startswith(upto)):
            if index != assistant[-1]:
                context.append(index)  # rewritten in the later prompts: context there
                continue
            if (not upto.startswith(before)
                    and _extends(tokenizer, messages[: index + 1], chat_template, not enable_thinking)):
                # Qwen3's thinking off: a reply holding a reasoning block, which the served
                # prompt's empty block would precede
                raise ChatTemplateError(
                    f"{name} is not what the target writes with thinking "
                    f"{'on' if enable_thinking else 'off'} (the chat template renders it as an "
                    f"extension of the prompt only with thinking {'off' if enable_thinking else 'on'}"
                    f"{': its reply holds a reasoning block' if '</think>' in message['content'] else ''}); "
                    f"set target.generation.enable_thinking: {str(not enable_thinking).lower()} if "
                    "the data was written so, or regenerate it with the thinking mode served"
                )
            raise ChatTemplateError(
                f"the chat template does not render {name} as an extension "
                "of the conversation before it (it rewrites the prompt once the reply is added); "
                "cannot locate the supervised tokens. Use a template that keeps the prompt "
                "unchanged (target.generation.chat_template)"
            )
        start = len(before)
        end = start + len(upto[start:].rstrip())
        if end == start and message["content"].strip():
            # e.g. a chat_template given as a file path: that text, the same for every conversation
            raise ChatTemplateError(
                f"the chat template renders {name} as nothing (neither its "
                "text nor an end-of-turn marker), so none of it can be supervised; "
                "target.generation.chat_template takes the template's Jinja text, not a file path"
            )
        if index in unfinished_turns:
            reply = message["content"]
            content_at = text.find(reply, start, end)
            if content_at < 0 and reply.strip():  # a template that strips replies (``| trim``)
                reply = reply.strip()
                content_at = text.find(reply, start, end)
            if content_at < 0:
                raise RewrittenReply(
                    f"cannot find the text of {name}, cut at max_new_tokens, in its "
                    "rendering; the chat template rewrites replies"
                )
            end = content_at + len(reply)
            if text[start:content_at].strip():  # not whitespace: the template's, not generated
                if index == len(messages) - 1:
                    # nor seen by the target as it generated this reply (Qwen3's empty reasoning
                    # block before a reply cut in its reasoning, which has no '</think>'): the
                    # reply follows the generation prompt, as it was served
                    text = text[:start] + text[content_at:]
                    end -= content_at - start
                else:
                    start = content_at
            # else from the prompt's end, as a finished turn: the first token generated holds the
            # template's space before the reply (Mistral's ``" " + content | trim``: "ĠHello")
        if end > start:
            spans.append((start, end))
            prompt_ends.append(len(before))
            replies.append(_reply_place(text, message["content"], start, end, index))
            turns.append(index)
    return text, spans, context, prompt_ends, replies, turns


def _extends(tokenizer, messages, chat_template, enable_thinking: bool) -> bool:
    """Whether the template renders the last message of ``messages`` (an assistant turn) as an
    extension of the generation prompt before it, in thinking mode ``enable_thinking``."""
    kwargs = {"chat_template": chat_template, "enable_thinking": enable_thinking}
    try:
        before = render(tokenizer, messages[:-1], add_generation_prompt=True, **kwargs)
        upto = render(tokenizer, messages, add_generation_prompt=False, **kwargs)
    except ChatTemplateError:
        return False
    return upto.startswith(before)


def _reply_place(text: str, reply: str, start: int, end: int, index: int) -> tuple[int, int] | int:
    """Where ``reply`` lies in ``text[start:end]`` (a template that strips replies: the stripped
    text), or ``index`` where the template rewrites it beyond that."""
    for candidate in (reply, reply.strip()):
        at = text.find(candidate, start, end)
        if at >= 0:
            return at, at + len(candidate)
    return index


def _trailer(tokenizer, prompt, **kwargs) -> str:
    """What the template appends after the last message when no generation prompt follows
    (Phi-3's ``{% else %}{{ eos_token }}``): it ends every rendering of a conversation, so
    it is neither the end of an assistant turn nor generated. Found in tokens, where the
    rendering of ``prompt`` without and with the generation prompt part ways (as text,
    ``<|endoftext|>`` and ``<|assistant|>`` share their first characters); whitespace is
    left out of the spans anyway. Where the closed rendering's text is all in the opened one
    there is none: the tokens part there only because a plain-text marker ending the last turn
    (``<|eot_id|>`` where the tokenizer has no such token) merges with the generation prompt's
    first characters, and that last token is the turn's own."""
    closed = render(tokenizer, prompt, add_generation_prompt=False, **kwargs)
    opened = render(tokenizer, prompt, add_generation_prompt=True, **kwargs)
    if opened.startswith(closed):
        return ""
    ids, offsets = _encode(tokenizer, closed, ())
    shared = 0
    for ours, theirs in zip(ids, tokenizer(opened, add_special_tokens=False)["input_ids"], strict=False):
        if ours != theirs:
            break
        shared += 1
    trailer = closed[offsets[shared][0] :] if shared < len(ids) else ""
    return trailer if trailer.strip() else ""


def tokenize_messages(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    chat_template: str | None = None,
    enable_thinking: bool = False,
    unfinished_turns: Sequence[int] = (),
    reply_token_ids: Sequence[Sequence[int] | None] = (),
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask with 1 on assistant tokens.
    ``reply_token_ids``: beside ``messages``, each reply's ids as the target generated them
    (None where unknown), which stand for its text where they spell it (:func:`_generated`)."""
    done = _tokenize(tokenizer, messages, chat_template=chat_template, enable_thinking=enable_thinking,
                     unfinished_turns=unfinished_turns, reply_token_ids=reply_token_ids)  # fmt: skip
    return done.ids, done.mask


class _Tokenized(NamedTuple):
    """:func:`tokenize_messages`'s ids and mask, and what the checks after it need."""

    text: str  # the rendered conversation
    ids: list[int]
    mask: list[int]
    offsets: list[tuple[int, int]]  # each token's characters in ``text``
    context: list[int]  # the assistant turns left unsupervised (rewritten later)
    replies: list[tuple[int, int] | int]  # each supervised reply's text in ``text`` (_locate_turns)
    spans: list[tuple[int, int]]  # each supervised turn's characters in ``text``, as ``replies``


def _tokenize(tokenizer, messages, *, chat_template, enable_thinking, unfinished_turns,
              added_messages: int = 0, entry: str = "message",
              reply_token_ids: Sequence[Sequence[int] | None] = ()) -> _Tokenized:
    """:func:`tokenize_messages` plus the assistant turns left unsupervised and where things are."""
    text, spans, context, prompt_ends, replies, turns = _locate_turns(
        tokenizer,
        messages,
        chat_template=chat_template,
        enable_thinking=enable_thinking,
        unfinished_turns=unfinished_turns,
        added_messages=added_messages,
        entry=entry,
    )
    generated = _generated(tokenizer, text, replies, turns, prompt_ends, reply_token_ids)
    cuts = sorted({*prompt_ends, *(at for start, end, _ in generated for at in (start, end))})
    ids, offsets = _encode(tokenizer, text, cuts)
    for start, end, reply_ids in reversed(generated):  # from the end: the earlier places stay put
        first = next(n for n, (lo, _hi) in enumerate(offsets) if lo >= start)  # _encode cut there
        after = next((n for n in range(first, len(offsets)) if offsets[n][0] >= end), len(offsets))
        ids[first:after] = reply_ids
        offsets[first:after] = _spread(tokenizer, reply_ids, start, end)
    mask = []
    previous = 0
    span_index = 0
    for start, _end in offsets:
        if start < previous:
            raise ChatTemplateError("the tokenizer returned non-monotonic character offsets")
        previous = start
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        inside = span_index < len(spans) and spans[span_index][0] <= start
        mask.append(1 if inside else 0)
    return _Tokenized(text, ids, mask, offsets, context, replies, spans)


def _generated(tokenizer, text: str, replies, turns: Sequence[int], prompt_ends: Sequence[int],
               reply_token_ids: Sequence[Sequence[int] | None]) -> list[tuple[int, int, list[int]]]:
    """``(start, end, ids)`` for each supervised reply whose generated ids spell its text in
    ``text`` exactly, to where it ends: from where its generation prompt ends, as the ids spell
    it after other text (a SentencePiece decoder strips a first token's leading space alone:
    Mistral's ``▁Hello`` is "Hello" alone, " Hello" after the prompt, where the template writes
    ``" " + content``), else from where the reply's own text starts. Those ids are supervised
    there instead of the text tokenised again. A reply whose ids spell something else (a
    template that strips or rewrites replies, a special token the target generated inside a
    reply, which its text leaves out), or hold an id the tokenizer has no token for or a special
    token (ids edited by hand; such a token in mid-reply would teach the draft to end a turn
    there), is tokenised from its text, as a reply without ids is."""
    out = []
    special = anchor = None  # found once a reply has ids
    for place, index, prompt_end in zip(replies, turns, prompt_ends, strict=True):
        reply_ids = list(reply_token_ids[index] or ()) if index < len(reply_token_ids) else []
        if not reply_ids or isinstance(place, int):
            continue
        if special is None:
            special = set(special_tokens(tokenizer))
            anchor = tokenizer("a", add_special_tokens=False)["input_ids"][-1]  # an ordinary token
        if any(not 0 <= i < len(tokenizer) or i in special for i in reply_ids):
            continue
        in_context = tokenizer.decode([anchor, *reply_ids])[len(tokenizer.decode([anchor])):]
        for start, spelt in ((prompt_end, in_context), (place[0], tokenizer.decode(reply_ids))):
            if start < place[1] and text[start : place[1]] == spelt:
                out.append((start, place[1], reply_ids))
                break
    return out


def _spread(tokenizer, reply_ids: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
    """Character offsets in ``[start, end)`` for ``reply_ids``, which spell that text: each
    token's start is the length of the texts of the tokens before it, each decoded alone (a
    piece of a character decodes to one U+FFFD, so this is approximate there), kept inside the
    span (non-decreasing, before its end) so that the mask supervises every one."""
    pieces = tokenizer.batch_decode([[token] for token in reply_ids])
    starts, at = [], 0
    for piece in pieces:
        starts.append(start + min(at, end - start - 1))
        at += len(piece)
    return [(lo, hi) for lo, hi in zip(starts, [*starts[1:], end], strict=True)]


def special_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's special tokens, id -> text: ``all_special_tokens`` and the added tokens
    marked special (not those added as ordinary text, such as Qwen3's ``<think>``)."""
    out: dict[int, str] = {}
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False) and str(token):
            out[int(token_id)] = str(token)
    for token in getattr(tokenizer, "all_special_tokens", None) or ():
        token_id = tokenizer.convert_tokens_to_ids(token)  # the unk id for one not in the vocabulary
        if token and isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            out.setdefault(token_id, token)
    return out


def _special_in_replies(tokenizer: Any, done: _Tokenized, messages: Sequence[dict[str, str]],
                        special: Mapping[int, str]) -> str | None:
    """The first special token that a supervised assistant reply's own text tokenises to
    (within ``done.ids``, already cut to ``max_length``), as its text; None if there is none.

    A token counts where it lies in the reply's text and is that token's text, not an unknown
    piece the tokenizer maps to its ``unk_token``; the template's end-of-turn marker lies after
    the reply and does not count. A reply the template rewrites beyond finding is checked alone,
    as far as its turn is kept: not at all when the cut to ``max_length`` falls before it, else
    as many of its characters as its turn keeps (its rewritten text's length, so approximate)."""
    if not special:
        return None
    # where the cut to max_length falls in ``text`` (the offsets are those of the whole rendering)
    kept_end = done.offsets[len(done.ids)][0] if len(done.ids) < len(done.offsets) else len(done.text)
    places = [place for place in done.replies if not isinstance(place, int)]
    for token_id, supervised, (start, end) in zip(done.ids, done.mask, done.offsets, strict=False):
        if not supervised or token_id not in special:
            continue
        token = special[token_id]
        inside = any(lo <= start < hi or (start < lo < end) for lo, hi in places)
        if inside and done.text[start:end].strip() == token.strip():
            return token
    for place, (turn_start, _turn_end) in zip(done.replies, done.spans, strict=True):
        if isinstance(place, int) and turn_start < kept_end:
            reply = messages[place]["content"]
            encoded = tokenizer(reply, add_special_tokens=False, return_offsets_mapping=True)
            for token_id, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=False):
                if start >= kept_end - turn_start:
                    break  # cut off by max_length: never trained on
                if token_id in special and reply[start:end].strip() == special[token_id].strip():
                    return special[token_id]
    return None


def _encode(tokenizer, text: str, cuts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``text``, no token spanning a position in ``cuts``
    (where a generation prompt ends: see the module notes).

    Pieces are split off in a loop, not by recursion: a conversation of a thousand turns whose
    every reply starts with spaces split at each turn and passed Python's recursion limit."""
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pending = [(0, len(text), list(cuts))]  # pieces of ``text`` left to encode, the next last
    while pending:
        lo, hi, piece_cuts = pending.pop()
        piece_ids, piece_offsets, cut = _encode_piece(tokenizer, text[lo:hi], [c - lo for c in piece_cuts])
        if cut is None:
            ids += piece_ids
            offsets += [(start + lo, end + lo) for start, end in piece_offsets]
            continue
        at = lo + cut  # tokenised apart: the text before it, then the text from it
        pending.append((at, hi, [c for c in piece_cuts if c > at]))
        pending.append((lo, at, [c for c in piece_cuts if c < at]))
    return ids, offsets


def _encode_piece(tokenizer, text: str, cuts: Sequence[int]):
    """``text``'s token ids and offsets, and the first position in ``cuts`` where it must be
    tokenised in two (None if none)."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError) as exc:
        raise ChatTemplateError(
            f"the tokenizer cannot report character offsets ({exc}); a fast tokenizer is needed"
        ) from None
    ids = list(encoded["input_ids"])
    offsets = [tuple(offset) for offset in encoded["offset_mapping"]]
    for cut in cuts:
        # also where no token spans the cut: a pre-tokenizer's look-ahead (GPT-2's ``\s+(?!\S)``)
        # splits a prompt's final "\n\n" as Ċ, Ċ before a reply but as ĊĊ at the end of the text
        before = next((n for n, (start, _end) in enumerate(offsets) if start >= cut), len(offsets))
        if (any(start < cut < end for start, end in offsets)
                or tokenizer(text[:cut], add_special_tokens=False)["input_ids"] != ids[:before]):
            return ids, offsets, cut
    return ids, offsets, None


def tokenize_conversations(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    *,
    max_length: int,
    min_loss_tokens: int,
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> tuple[list[TokenizedSample], TokenizeStats]:
    """Tokenise, truncate to ``max_length`` and drop samples with too few supervised tokens,
    whose supervised reply text holds a special token's text (see the module notes), or whose
    reply cut at ``max_new_tokens`` the template rewrites (:class:`RewrittenReply`); all are
    counted, and their ids listed in ``dropped_ids``.

    A conversation the chat template cannot render or locate the replies in raises
    :class:`ChatTemplateError` naming its source and id."""
    _require_template(tokenizer, chat_template)  # said once, not as a fault of the first row
    stats = TokenizeStats()
    samples = []
    special = special_tokens(tokenizer)
    for conv in conversations:
        stats.num_conversations += 1
        try:
            done = _tokenize(
                tokenizer,
                conv.messages,
                chat_template=chat_template,
                enable_thinking=enable_thinking,
                unfinished_turns=conv.extra.get("unfinished_turns", ()),
                # a row's top-level 'system' key became its first message (data/formats.py)
                added_messages=1 if conv.extra.get("system") else 0,
                entry=getattr(conv, "entry", "message"),  # a row's own name for its entries
                reply_token_ids=conv.extra.get("reply_token_ids") or (),
            )
        except RewrittenReply:
            stats.num_dropped_rewritten += 1
            stats.rewritten_example = stats.rewritten_example or conv.id
            stats.dropped_ids.append(conv.id)
            continue
        except ChatTemplateError as err:
            raise ChatTemplateError(f"{conv.source or 'conversation'} (id {conv.id!r}): {err}") from err
        ids, mask = done.ids, done.mask
        stats.num_context_turns += len(done.context)
        if len(ids) > max_length:
            stats.num_truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
            done = done._replace(ids=ids, mask=mask)
        token = _special_in_replies(tokenizer, done, conv.messages, special)
        if token is not None:
            stats.num_dropped_special += 1
            stats.special_example = stats.special_example or (conv.id, token)
            stats.dropped_ids.append(conv.id)
            continue
        if sum(mask) < min_loss_tokens:
            stats.num_dropped_short += 1
            stats.dropped_ids.append(conv.id)
            continue
        samples.append(TokenizedSample(conv.id, ids, mask))
        stats.num_kept += 1
    return samples, stats
