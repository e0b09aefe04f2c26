"""Conversations -> token ids and loss masks, through the target's own chat template.

The whole conversation is rendered with the chat template (the recipe's override, if
any, and the serving thinking mode), then tokenised once. Each assistant turn's text is
located by rendering the conversation up to that turn twice: once ending with the
generation prompt (what the server sends before the model speaks) and once including
the turn. What lies between is what the model generates: the reply and the template's
end-of-turn marker (``<|im_end|>`` for ChatML). Whitespace the template puts after the
marker is never generated (serving stops at the marker) and is not supervised.

Tokens whose first character falls in such a span get loss mask 1. Samples are cut to
``max_length`` tokens; samples left with fewer than ``min_loss_tokens`` supervised
tokens are dropped and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from draftforge.data.formats import Conversation


class ChatTemplateError(ValueError):
    """The chat template cannot be used to locate assistant turns."""


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
    dropped_ids: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line with the counts."""
        return (
            f"{self.num_kept}/{self.num_conversations} samples kept, "
            f"{self.num_truncated} truncated, {self.num_dropped_short} dropped "
            "(too few supervised tokens)"
        )


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool,
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> str:
    """The chat template's text for ``messages`` (no tokenisation)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "the tokenizer has no chat template; set target.generation.chat_template"
        )
    return tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        enable_thinking=enable_thinking,
    )


def assistant_spans(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character span of each assistant turn."""
    kwargs = {"chat_template": chat_template, "enable_thinking": enable_thinking}
    text = render(tokenizer, messages, add_generation_prompt=False, **kwargs)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:index], add_generation_prompt=True, **kwargs)
        upto = render(tokenizer, messages[: index + 1], add_generation_prompt=False, **kwargs)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ChatTemplateError(
                f"the chat template does not render assistant turn {index + 1} as an extension "
                "of the conversation before it (it rewrites earlier turns, e.g. by removing "
                "reasoning); cannot locate the supervised tokens. Use a template that keeps "
                "history unchanged (target.generation.chat_template)"
            )
        start = len(before)
        end = start + len(upto[start:].rstrip())
        if end > start:
            spans.append((start, end))
    return text, spans


def tokenize_messages(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask with 1 on assistant tokens."""
    text, spans = assistant_spans(
        tokenizer, messages, chat_template=chat_template, enable_thinking=enable_thinking
    )
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError) as exc:
        raise ChatTemplateError(
            f"the tokenizer cannot report character offsets ({exc}); a fast tokenizer is needed"
        ) from None
    ids = list(encoded["input_ids"])
    offsets = list(encoded["offset_mapping"])
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
    return ids, mask


def tokenize_conversations(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    *,
    max_length: int,
    min_loss_tokens: int,
    chat_template: str | None = None,
    enable_thinking: bool = False,
) -> tuple[list[TokenizedSample], TokenizeStats]:
    """Tokenise, truncate to ``max_length`` and drop samples with too few supervised tokens."""
    stats = TokenizeStats()
    samples = []
    for conv in conversations:
        stats.num_conversations += 1
        ids, mask = tokenize_messages(
            tokenizer, conv.messages, chat_template=chat_template, enable_thinking=enable_thinking
        )
        if len(ids) > max_length:
            stats.num_truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) < min_loss_tokens:
            stats.num_dropped_short += 1
            stats.dropped_ids.append(conv.id)
            continue
        samples.append(TokenizedSample(conv.id, ids, mask))
        stats.num_kept += 1
    return samples, stats
