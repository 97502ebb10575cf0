"""Chat templates: which one renders a run's chats, rendering through transformers, and the label spans.

    data.chat_template  template                                          when the tokenizer has none
    auto                the tokenizer's own chat_template                 ChatML (the bundled `qwen`)
    model               the tokenizer's own chat_template                 DataError (data.chat_template,
                                                                          data.tokenizer)
    chatml              CHATML_TEMPLATE
    none                no template: one (system?) user -> assistant exchange as plain text (template.py)
    PATH                a Jinja file (read on the driver: TemplateSettings.template_text)

A chat renders with transformers' own renderer (`render_jinja_template`, what apply_chat_template runs),
given the tokenizer's special tokens map (bos_token, eos_token, ...) as apply_chat_template gives it, so
the template's default system prompt, BOS and end-of-turn tokens are exactly the model's. The result is
a string plus the character spans that carry a loss (data.labels=assistant; `all` is one span over
everything); app/data/chat_encode.py turns both into ids and labels.

Label spans, for the assistant turns at message index >= Conversation.loss_from:
    {% generation %}   the template marks them: the spans transformers' return_assistant_tokens_mask uses
    otherwise          the prefix method: for assistant message k,
                           before  = render(messages[:k], add_generation_prompt=True)   ends with its header
                           through = render(messages[:k+1])                             ends with its turn
                       the turn's span is [len(before), len(through)), less whitespace after a final
                       control token (ChatML's "\\n" after <|im_end|>): content + end-of-turn token(s).
                       Exact when `before` is a prefix of `through` and `through` of the whole rendering
                       (the prefix property); a row where it fails is malformed naming data.chat_template,
                       never trained with guessed labels. docs/design.md "Chat templates and label spans".

Tool calls and tool turns render through the template's own tool support; a row whose tool calls, tool
results or tools list do not appear in the rendering is malformed (the template cannot render them).
`check_chat_template` runs all of this on a probe chat on the driver, before Ray starts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.data import DataError
from app.data.chat_encode import Controls, Span, controls_of, escape_controls
from app.data.conversation import Conversation, MalformedRow
from app.data.tokenizer import TextTokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, no default system message: the
template of the bundled `qwen` tokenizer and of data.chat_template=chatml."""
KEYWORDS = ("auto", "model", "chatml", "none")
PREFIX_REASON = ("data.chat_template renders an earlier turn differently once the chat goes on (a prefix of "
                 "the chat is not a prefix of its rendering), so assistant spans cannot be exact")
PROBE = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
)
"""The driver-side check's chat: two exchanges, so both the first turn and a later one are located."""


@dataclass(frozen=True)
class ChatTemplate:
    """A resolved data.chat_template: its Jinja text (None for `none`), where it came from, its controls."""

    text: str | None
    setting: str
    """data.chat_template as configured."""
    source: str
    """For messages: "the tokenizer's own template", "ChatML", "the Jinja file x.jinja", "none"."""
    controls: Controls
    generation: bool
    """The template marks assistant output with {% generation %} blocks."""


def is_template_file(setting: str) -> bool:
    return setting not in KEYWORDS


def read_template_file(path: str) -> str:
    """A Jinja chat template file's text; DataError naming data.chat_template when it cannot be read."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"data.chat_template={path!r} is not one of {', '.join(KEYWORDS)} nor a readable "
                        f"Jinja template file ({type(err).__name__}: {err})") from None
    if not text.strip():
        raise DataError(f"data.chat_template={path!r} is an empty file")
    return text


def resolve_template(tok: TextTokenizer, setting: str, template_text: str = "") -> ChatTemplate:
    """data.chat_template for this tokenizer (memoized on it); `template_text`: a PATH's text, if read."""
    key = ("chat_template", setting, template_text)
    if key not in tok.cache:
        tok.cache[key] = template_of(tok, *_template_text(tok, setting, template_text), setting=setting)
    return tok.cache[key]


def template_of(tok: TextTokenizer, text: str | None, source: str, setting: str = "") -> ChatTemplate:
    """A ChatTemplate of Jinja `text` (None: none) for this tokenizer; DataError when it does not parse."""
    if text is not None:
        _compile(text, setting or source)
    return ChatTemplate(text=text, setting=setting or source, source=source,
                        controls=controls_of(tok.control_tokens(text or "")),
                        generation=text is not None and _has_generation_block(text))


def _template_text(tok: TextTokenizer, setting: str, template_text: str) -> tuple[str | None, str]:
    if setting == "none":
        return None, "none"
    if setting == "chatml" or (setting == "auto" and tok.chat_template is None):
        return CHATML_TEMPLATE, "ChatML"
    if setting in ("auto", "model"):
        if tok.chat_template is None:
            raise DataError(
                f"data.chat_template=model, but data.tokenizer={tok.name!r} has no chat template "
                "(data.tokenizer defaults to model.name_or_path's tokenizer); set data.chat_template to "
                "auto, chatml, none or a Jinja template file")
        return tok.chat_template, "the tokenizer's own template"
    return template_text or read_template_file(setting), f"the Jinja file {setting}"


def _compile(text: str, setting: str) -> None:
    """DataError naming data.chat_template when the Jinja does not parse."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as err:
        raise DataError(f"data.chat_template={setting!r}: the template is not valid Jinja ({err})") from None


def _has_generation_block(text: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None


def render_chats(template: ChatTemplate, tok: TextTokenizer, chats: Sequence[Sequence[dict[str, Any]]],
                 tools: Sequence[dict[str, Any]] = (), *, prompt: bool = False,
                 track: bool = False) -> tuple[list[str], list[list[Span]]]:
    """(rendered texts, {% generation %} spans of each when `track`) of several chats in one call;
    MalformedRow when the template refuses one (its own raise_exception, a missing field, ...)."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    if not chats:
        return [], []
    try:
        rendered, spans = render_jinja_template(
            conversations=[list(chat) for chat in chats], tools=list(tools) or None,
            chat_template=template.text, return_assistant_tokens_mask=track, add_generation_prompt=prompt,
            **tok.template_vars)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        why = " ".join(str(err).split())[:120]
        raise MalformedRow(f"data.chat_template cannot render this chat ({type(err).__name__}: "
                           f"{why})") from None
    return rendered, [[tuple(span) for span in found] for found in spans] if track else []


def template_input(tok: TextTokenizer, template: ChatTemplate,
                   conversation: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) as the template gets them: keys whose value is None dropped (as apply_chat_template
    does), control-token strings from the data escaped, NFC for the qwen vocabulary."""
    nfc = tok.kind == "tiktoken"
    messages = [escape_controls({k: v for k, v in m.items() if v is not None}, template.controls, nfc)
                for m in conversation.messages]
    return messages, [escape_controls(tool, template.controls, nfc) for tool in conversation.tools]


def chat_spans(template: ChatTemplate, tok: TextTokenizer, conversation: Conversation,
               labels: str) -> tuple[str, list[Span]]:
    """(rendered chat, character spans that carry a loss); MalformedRow when the row cannot be rendered.

    labels: all (every character, less the blocks of excluded messages) | assistant | last_turn (the
    assistant messages of Conversation.trained_messages)."""
    messages, tools = template_input(tok, template, conversation)
    if labels == "all":
        (full,), _ = render_chats(template, tok, [messages], tools)
        blocks = _message_blocks(template, tok, messages, tools, full, sorted(conversation.excluded))
        spans = _complement([(0, len(full))], blocks.values())
    elif template.generation:
        turns = conversation.trained_messages(labels)
        (full,), (spans,) = render_chats(template, tok, [messages], tools, track=True)
        every = [k for k, message in enumerate(messages) if message.get("role") == "assistant"]
        if list(turns) != every:  # some assistant messages carry no loss: keep the spans inside the others
            blocks = _message_blocks(template, tok, messages, tools, full, list(turns))
            spans = [(first, last) for first, last in spans
                     if any(start <= first < end for start, end in blocks.values())]
    else:
        turns = list(conversation.trained_messages(labels))
        full, spans = _prefix_spans(template, tok, messages, tools, turns)
    _check_tools_rendered(full, messages, tools)
    return full, spans


def _message_blocks(template: ChatTemplate, tok: TextTokenizer, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]], full: str, indices: list[int]) -> dict[int, Span]:
    """{k: [len(render(messages[:k])), len(render(messages[:k+1])))}: the characters message k adds to the
    rendering (header, content, end of turn), by the prefix method; MalformedRow when the prefixes are not
    prefixes of `full` (the prefix property, docs/design.md §12)."""
    if not indices:
        return {}
    cuts = sorted({k for k in indices} | {k + 1 for k in indices})
    rendered, _ = render_chats(template, tok, [messages[:n] for n in cuts if n], tools)
    prefix = dict(zip([n for n in cuts if n], rendered, strict=True)) | {0: ""}
    if not all(full.startswith(prefix[n]) for n in cuts):
        raise MalformedRow(PREFIX_REASON)
    return {k: (len(prefix[k]), len(prefix[k + 1])) for k in indices}


def _complement(spans: list[Span], holes: Any) -> list[Span]:
    """`spans` less the character ranges `holes`."""
    for first, last in sorted(holes):
        spans = [piece for start, end in spans
                 for piece in ((start, min(end, first)), (max(start, last), end)) if piece[0] < piece[1]]
    return spans


def _prefix_spans(template: ChatTemplate, tok: TextTokenizer, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]], turns: list[int]) -> tuple[str, list[Span]]:
    """(whole rendering, span of each assistant message in `turns`) by the prefix method: two render
    calls, one for every prefix that ends with an assistant turn (and the whole chat), one for every
    prefix before such a turn with the generation prompt."""
    ends = sorted({k + 1 for k in turns} | {len(messages)})
    rendered, _ = render_chats(template, tok, [messages[:n] for n in ends], tools)
    through = dict(zip(ends, rendered, strict=True))
    before, _ = render_chats(template, tok, [messages[:k] for k in turns], tools, prompt=True)
    full = through[len(messages)]
    return full, [_turn_span(template, head, through[k + 1], full)
                  for k, head in zip(turns, before, strict=True)]


def _turn_span(template: ChatTemplate, before: str, through: str, full: str) -> Span:
    """The characters an assistant turn adds after its header (the prefix method, module docstring)."""
    if not (through.startswith(before) and full.startswith(through)):
        raise MalformedRow(PREFIX_REASON)
    turn = through[len(before):].rstrip()
    if template.controls.at_end.search(turn):  # drop the formatting after the end-of-turn token
        return len(before), len(before) + len(turn)
    return len(before), len(through)


def _check_tools_rendered(full: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
    """MalformedRow when the rendering lost the row's tool calls, tool results or tools list."""
    for message in messages:
        calls = message.get("tool_calls") or ()
        if any(_function_name(call) not in full for call in calls):
            raise MalformedRow("data.chat_template does not render tool calls (a tool call's name is missing "
                               "from the rendered chat)")
        content = message.get("content")
        if message.get("role") == "tool" and isinstance(content, str) and not _appears(content, full):
            raise MalformedRow("data.chat_template does not render tool results (a tool message's content is "
                               "missing from the rendered chat)")
    if any(_function_name(tool) not in full for tool in tools):
        raise MalformedRow("data.chat_template does not render the tools list (a tool's name is missing from "
                           "the rendered chat)")


def _function_name(item: dict[str, Any]) -> str:
    function = item.get("function") if isinstance(item.get("function"), dict) else item
    return str(function.get("name", ""))


def _appears(text: str, full: str) -> bool:
    """The text, stripped, appears in the rendering as is or JSON-escaped (a template may `| tojson` it)."""
    stripped = text.strip()
    return stripped in full or json.dumps(stripped)[1:-1] in full


def end_of_turn(template: ChatTemplate, tok: TextTokenizer) -> str:
    """The control token that ends the probe's assistant turns (ChatML: <|im_end|>); DataError when the
    turns cannot be located, or a span is not one answer closed by a control token (`_check_answer_span`)."""
    try:
        text, spans = chat_spans(template, tok, Conversation(messages=PROBE), "assistant")
    except MalformedRow as err:
        raise DataError(f"data.chat_template={_named(template)} cannot render a plain two-exchange chat for "
                        f"data.tokenizer={tok.name!r}: {err}") from None
    answers = [m["content"] for m in PROBE if m["role"] == "assistant"]
    if len(spans) != len(answers):
        raise DataError(f"data.chat_template={_named(template)} marks {len(spans)} assistant spans in a chat "
                        f"with {len(answers)} answers; its {{% generation %}} blocks must wrap each answer")
    ends = [_check_answer_span(template, tok, text[first:last], answer)
            for (first, last), answer in zip(spans, answers, strict=True)]
    return ends[-1]


def _check_answer_span(template: ChatTemplate, tok: TextTokenizer, span: str, answer: str) -> str:
    """The control token closing one probe answer's labeled span; DataError when the span misses the
    answer, holds a special token before it (a turn header: add_generation_prompt does not open the
    assistant turn the way the template writes one), or does not end with a control token."""
    if answer not in span:
        raise DataError(f"data.chat_template={_named(template)}: the labeled span {span!r} of an assistant "
                        f"turn does not hold its answer {answer!r}")
    specials = [text for text, (_, special) in tok.added_tokens.items() if special]
    header = span[: span.index(answer)]
    if any(token in header for token in specials):
        raise DataError(f"data.chat_template={_named(template)}: the labeled span of an answer starts with "
                        f"{header!r}, a turn header: the template's add_generation_prompt must write the "
                        "same assistant header that it writes before an assistant message")
    found = template.controls.at_end.search(span.rstrip())
    if found is None:
        raise DataError(
            f"data.chat_template={_named(template)}: an assistant turn ends with {span[-12:]!r}, not with a "
            f"special token of data.tokenizer={tok.name!r} (model.name_or_path's tokenizer by default), so "
            "the model would never learn to stop; use a template that closes each turn with an end-of-turn "
            "or EOS token of this tokenizer")
    return found.group(0)


def check_chat_template(tok: TextTokenizer, settings: Any) -> None:
    """Before Ray starts: data.chat_template resolves and renders a probe chat whose assistant turns are
    located exactly and end with an end-of-turn/EOS token of the tokenizer, which has an EOS token.
    `settings` is a TemplateSettings (app/data/template.py). DataError otherwise."""
    if tok.eos_id is None:
        raise DataError(f"data.tokenizer={tok.name!r} (model.name_or_path's tokenizer by default) has no EOS "
                        "token; text rows, data.chat_template=none and the end of every answer need one")
    template = resolve_template(tok, settings.chat_template, settings.template_text)
    if template.text is not None:
        end_of_turn(template, tok)


def _named(template: ChatTemplate) -> str:
    return f"{template.setting!r} ({template.source})"
