"""Row formats (app/data/formats/): each format's rows into the exact Conversation, every malformed case's
reason, data.columns, and auto's choice per row. Pure: no tokenizer, no Ray."""

from __future__ import annotations

import json
import typing
from typing import Any

import numpy as np
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from app.config import DataConfig, load_config
from app.data import DataError
from app.data.conversation import Conversation, MalformedRow
from app.data.formats import (
    AUTO_ORDER,
    FORMATS,
    NO_FORMAT,
    check_format_settings,
    column_map,
    describe_formats,
    detect,
    to_conversation,
)

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Weather in Paris?"}
ANSWER = {"role": "assistant", "content": "18C and sunny."}
CALL = {"type": "function", "id": "c1", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def reason(row: dict[str, Any], format_type: str = "auto", columns: dict[str, str] | None = None) -> str:
    with pytest.raises(MalformedRow) as err:
        to_conversation(row, format_type, columns)
    return str(err.value)


def test_every_configurable_format_is_registered_and_tried_by_auto() -> None:
    choices = typing.get_args(typing.get_type_hints(DataConfig)["format_type"])
    assert set(choices) == {"auto", *FORMATS} and set(AUTO_ORDER) == set(FORMATS)


# --- messages -------------------------------------------------------------------------------------------

def test_messages_openai_tool_calls_parts_and_tools() -> None:
    """OpenAI's wire form: arguments as a JSON string, a null content beside tool_calls, text parts."""
    row = {"messages": [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "id": "c1",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny", "weight": 1.0},
        ANSWER,
    ], "tools": TOOLS}
    assert to_conversation(row) == Conversation(messages=(
        SYSTEM, {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "18C, sunny", "tool_call_id": "c1"},
        ANSWER), tools=tuple(TOOLS), format="messages")


def test_messages_from_arrow_rows_drop_nulls_and_take_object_arrays() -> None:
    """Parquet struct columns fill absent fields with null; Ray's numpy batches hold lists as arrays."""
    messages = np.array([{"role": "user", "content": "Hi", "tool_calls": None, "name": None},
                         {"role": "assistant", "content": "Hello", "tool_calls": None, "name": None}], object)
    assert to_conversation({"messages": messages, "text": None, "tools": None}) == Conversation(
        messages=({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}),
        format="messages")


def test_tool_arguments_render_as_json_once() -> None:
    """transformers' templates write arguments with `| tojson` (its chat-template docs pass a dict): the
    string arguments of OpenAI's wire form are parsed, so they are not quoted a second time."""
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}"
                "{% endfor %}{% endfor %}")
    wire = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
    documented = [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}]
    ours = list(to_conversation({"messages": [wire]}).messages)
    rendered = render_jinja_template([ours], chat_template=template)[0][0]
    reference = render_jinja_template([documented], chat_template=template)[0][0]
    assert rendered == reference == '{"city": "Paris"}'


@pytest.mark.parametrize("row, expected", [
    ({"json_line": '{"messages": [1, 2'}, "bad JSON (Expecting ',' delimiter)"),
    ({"json_line": "[1, 2]"}, "a JSON line must be an object, not a list"),
    ({"messages": "a string"}, "messages is a string, not a list of {role, content}"),
    ({"messages": ["hello"]}, "messages[0] is a string, not a {role, content} object"),
    ({"messages": [{"content": "x"}]}, "messages[0] has no role"),
    ({"messages": [{"role": "user"}]}, "messages[0] has no content"),
    ({"messages": [{"role": "user", "content": None, "tool_calls": [CALL]}]}, "messages[0] has no content"),
    ({"messages": [{"role": 3, "content": "x"}]}, "messages[0].role is a number, not a string"),
    ({"messages": [{"role": "a\nb", "content": "x"}]}, "messages[0].role is empty or holds a newline"),
    ({"messages": [USER, {"role": "assistant", "content": 4}]},
     "messages[1].content is a number, not a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0] has type 'image_url', not 'text' (only text parts can be trained on)"),
    ({"messages": [{"role": "user", "content": ["Hi"]}]},
     "messages[0].content[0] is a string, not a {type, text} part"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text is a number, not a string"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": {"name": "f"}}]},
     "messages[0].tool_calls is an object, not a list"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0] has no function name"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments is not a JSON object"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"name": "f", "arguments": "[1]"}]}]},
     "messages[0].tool_calls[0].function.arguments is a list, not an object"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]},
     "messages[0].tool_call_id is a number, not a string"),
    ({"messages": [USER], "tools": "not json"}, "tools is a string that is not a JSON list"),
    ({"messages": [USER], "tools": ["weather"]}, "tools[0] is a string, not an object"),
    ({"messages": [USER]}, None),
])
def test_messages_malformed_reasons(row: dict[str, Any], expected: str | None) -> None:
    if expected is None:  # the control: the same shape without the defect reads
        assert to_conversation(row).messages == (USER,)
    else:
        assert reason(row) == expected


def test_bare_tool_schemas_are_wrapped_and_empty_tool_calls_are_none() -> None:
    """LLaMA-Factory files list bare schemas; Arrow gives a message without calls an empty list."""
    bare = [tool["function"] for tool in TOOLS]
    row = {"messages": [USER, {"role": "assistant", "content": "18C and sunny.", "tool_calls": []}],
           "tools": json.dumps(bare)}
    expected = Conversation(messages=(USER, ANSWER), tools=tuple(TOOLS), format="messages")
    assert to_conversation(row) == expected
    assert reason({"messages": [{"role": "assistant", "tool_calls": []}]}) == "messages[0] has no content"


def test_flat_tool_calls_and_missing_arguments_are_read() -> None:
    row = {"messages": [{"role": "assistant", "tool_calls": [{"name": "now"}]}]}
    call = {"type": "function", "function": {"name": "now", "arguments": {}}}
    assert to_conversation(row).messages == ({"role": "assistant", "content": None, "tool_calls": [call]},)


def test_empty_rows_are_empty_not_malformed() -> None:
    """Nothing to render is the template's `empty` status (no tokens), not a malformed row."""
    for row, name in (({"messages": []}, "messages"), ({"conversations": []}, "sharegpt"),
                      ({"prompt": [], "completion": []}, "prompt_completion")):
        conversation = to_conversation(row)
        assert conversation.format == name and not conversation.is_chat
        assert conversation.segments == (("", False),)
    assert to_conversation({"text": ""}).segments == (("", True),)


# --- sharegpt -------------------------------------------------------------------------------------------

def test_sharegpt_roles_function_calls_system_and_tools() -> None:
    row = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "18C, sunny"},
        {"from": "gpt", "value": "18C and sunny."},
    ], "system": "You are terse.", "tools": json.dumps(TOOLS)}
    assert to_conversation(row) == Conversation(messages=(
        SYSTEM, USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C, sunny"}, ANSWER), tools=tuple(TOOLS), format="sharegpt")


def test_sharegpt_system_turn_wins_over_the_system_column_and_openai_spellings_read() -> None:
    row = {"conversations": [{"role": "system", "content": "You are terse."}, {"from": "user", "value": "Hi"},
                             {"from": "assistant", "value": "Hello"}, {"from": "tool", "value": "x"}],
           "system": "ignored"}
    assert to_conversation(row) == Conversation(messages=(
        SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "tool", "content": "x"}), format="sharegpt")


@pytest.mark.parametrize("row, expected", [
    ({"conversations": "hi"}, "conversations is a string, not a list of {from, value}"),
    ({"conversations": [["human", "hi"]]}, "conversations[0] is a list, not a {from, value} object"),
    ({"conversations": [{"value": "hi"}]}, "conversations[0] has no from"),
    ({"conversations": [{"from": "human"}]}, "conversations[0] has no value"),
    ({"conversations": [{"from": "bot", "value": "hi"}]},
     "conversations[0].from is 'bot', not one of human, gpt, system, tool, function_call, observation "
     "(or user, assistant)"),
    ({"conversations": [{"from": "human", "value": 5}]},
     "conversations[0].value is a number, not a string"),
    ({"conversations": [{"from": "function_call", "value": "weather(Paris)"}]},
     "conversations[0].value is not a JSON function call"),
    ({"conversations": [{"from": "function_call", "value": '{"arguments": {}}'}]},
     "conversations[0].tool_calls[0] has no function name"),
    ({"conversations": [{"from": "human", "value": "hi"}], "system": 1}, "system is a number, not a string"),
])
def test_sharegpt_malformed_reasons(row: dict[str, Any], expected: str) -> None:
    assert reason(row) == expected


# --- alpaca ---------------------------------------------------------------------------------------------

def test_alpaca_instruction_input_system_and_history() -> None:
    row = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour",
           "system": "You are a translator.", "history": [["Hi", "Hello!"], ["Ready?", "Yes."]]}
    assert to_conversation(row) == Conversation(messages=(
        {"role": "system", "content": "You are a translator."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Ready?"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Translate to French.\nGood morning"},
        {"role": "assistant", "content": "Bonjour"}), format="alpaca")


def test_alpaca_empty_input_is_the_instruction_alone() -> None:
    for extra in ({"input": ""}, {}, {"input": None, "system": "", "history": None}):
        row = {"instruction": "Name a color.", "output": "Blue.", **extra}
        assert to_conversation(row) == Conversation(messages=(
            {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}),
            format="alpaca")


@pytest.mark.parametrize("row, expected", [
    ({"instruction": "x", "output": 3}, "output is a number, not a string"),
    ({"instruction": ["x"], "output": "y"}, "instruction is a list, not a string"),
    ({"instruction": "x", "input": 1, "output": "y"}, "input is a number, not a string"),
    ({"instruction": "x", "output": "y", "history": "a"},
     "history is a string, not a list of [user, assistant] pairs"),
    ({"instruction": "x", "output": "y", "history": [["a"]]},
     "history[0] has 1 items, not a [user, assistant] pair"),
    ({"instruction": "x", "output": "y", "history": [["a", 2]]}, "history[0][1] is a number, not a string"),
    ({"instruction": "x"}, "no output column"),
])
def test_alpaca_malformed_reasons(row: dict[str, Any], expected: str) -> None:
    assert reason(row, "alpaca") == expected


# --- prompt_completion ----------------------------------------------------------------------------------

def test_prompt_completion_standard_is_an_unlabeled_prompt_and_a_labeled_completion() -> None:
    assert to_conversation({"prompt": "The sky is", "completion": " blue."}) == Conversation(
        segments=(("The sky is", False), (" blue.", True)), format="prompt_completion")


def test_prompt_completion_conversational_labels_from_the_completion() -> None:
    prompt = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, USER]
    row = {"prompt": prompt, "completion": [ANSWER], "tools": TOOLS}
    assert to_conversation(row) == Conversation(messages=(*prompt, ANSWER), tools=tuple(TOOLS), loss_from=4,
                                                format="prompt_completion")


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "x", "completion": [ANSWER]},
     "prompt is a string and completion a list; both must be strings or both lists of messages"),
    ({"prompt": 1, "completion": "y"},
     "prompt is a number and completion a string; both must be strings or both lists of messages"),
    ({"prompt": [USER], "completion": [{"role": "assistant"}]}, "completion[0] has no content"),
    ({"prompt": ["x"], "completion": [ANSWER]}, "prompt[0] is a string, not a {role, content} object"),
    ({"completion": "y", "prompt": None}, "no prompt column"),
])
def test_prompt_completion_malformed_reasons(row: dict[str, Any], expected: str) -> None:
    assert reason(row, "prompt_completion") == expected


# --- text -----------------------------------------------------------------------------------------------

def test_text_is_one_labeled_segment() -> None:
    assert to_conversation({"text": "Plain text."}) == Conversation(segments=(("Plain text.", True),),
                                                                    format="text")
    assert reason({"text": 7}) == "text is a number, not a string"
    assert reason({"messages": [USER]}, "text") == "no text column"


# --- data.columns ---------------------------------------------------------------------------------------

def test_columns_read_a_sharegpt_file_as_messages() -> None:
    columns = {"messages": "conversations", "role": "from", "content": "value", "user": "human",
               "assistant": "gpt"}
    row = {"conversations": [{"from": "system", "value": "You are terse."},
                             {"from": "human", "value": "Weather in Paris?"},
                             {"from": "gpt", "value": "18C and sunny."}]}
    assert to_conversation(row, "messages", columns) == Conversation(messages=(SYSTEM, USER, ANSWER),
                                                                     format="messages")
    assert to_conversation(row, "auto", columns).format == "messages"
    assert to_conversation(row).format == "sharegpt"  # the same row without the mapping


def test_columns_rename_keys_and_role_values_of_each_format() -> None:
    alpaca = {"question": "Name a color.", "answer": "Blue.", "sys": "Be brief."}
    mapped = to_conversation(alpaca, "auto", {"instruction": "question", "output": "answer", "system": "sys"})
    assert mapped == Conversation(messages=({"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Name a color."},
                                            {"role": "assistant", "content": "Blue."}), format="alpaca")
    sharegpt = {"conversations": [{"speaker": "USER", "value": "Hi"}, {"speaker": "BOT", "value": "Hello"}]}
    roles = {"role": "speaker", "user": "USER", "assistant": "BOT"}
    assert to_conversation(sharegpt, "auto", roles).messages == (
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})
    completion = {"prompt": [{"speaker": "human", "text": "Hi"}],
                  "completion": [{"speaker": "ai", "text": "Yo"}]}
    columns = {"role": "speaker", "content": "text", "user": "human", "assistant": "ai"}
    assert to_conversation(completion, "auto", columns).messages == (
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"})


def test_columns_swap_and_a_mapped_key_replaces_the_rows_own() -> None:
    swapped = to_conversation({"prompt": " blue.", "completion": "The sky is"}, "auto",
                              {"prompt": "completion", "completion": "prompt"})
    assert swapped.segments == (("The sky is", False), (" blue.", True))
    both = {"body": "mapped", "text": "own"}
    assert to_conversation(both, "auto", {"text": "body"}).segments == (("mapped", True),)
    own = {"body": None, "text": "own"}
    assert to_conversation(own, "auto", {"text": "body"}).segments == (("own", True),)


@pytest.mark.parametrize("columns, message", [
    ({"question": "q"}, r"data.columns: unknown key 'question'; accepted .*: messages, conversations, "
                        r"instruction, input, output, system, history, prompt, completion, text, tools, "
                        r"role, content, train, weight, user, assistant, tool$"),
    ({"text": ""}, r"data.columns.text must be the file's key or role name \(a non-empty string\), not ''"),
    ({"text": ["a"]}, r"data.columns.text must be .*, not \['a'\]"),
    ({"instruction": "q", "prompt": "q"},
     r"data.columns maps both 'instruction' and 'prompt' to the file's 'q'"),
    ({"user": "human", "system": "human"},
     r"data.columns maps both 'user' and 'system' to the file's 'human'"),
])
def test_bad_columns_are_one_data_error_naming_data_columns(columns: dict[str, Any], message: str) -> None:
    with pytest.raises(DataError, match=message):
        column_map(columns)
    with pytest.raises(DataError, match=message):  # raised for the whole mapping, never counted as a row
        to_conversation({"text": "x"}, "auto", columns)


def test_columns_are_checked_once_and_travel_as_items() -> None:
    """A settings object that is a cache key holds data.columns as a tuple of pairs; both spellings give
    the one cached, checked mapping."""
    items = (("messages", "conversations"),)
    assert column_map(items) is column_map({"messages": "conversations"})
    assert to_conversation({"conversations": [USER]}, "auto", items).format == "messages"
    assert check_format_settings("sharegpt", items) is column_map(items)
    with pytest.raises(DataError, match="data.format_type='csv'"):
        check_format_settings("csv", {})


def test_columns_from_the_config_file_shape() -> None:
    data = load_config(None, ["data.columns={messages: conversations, role: from, content: value}"]).data
    assert column_map(data.columns).keys == {"conversations": "messages"}
    assert column_map(data.columns).message_keys == {"from": "role", "value": "content"}


# --- auto -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, expected", [
    ({"messages", "conversations", "instruction", "output", "prompt", "completion", "text"}, "messages"),
    ({"conversations", "instruction", "output", "prompt", "completion", "text"}, "sharegpt"),
    ({"instruction", "output", "prompt", "completion", "text"}, "alpaca"),
    ({"instruction", "prompt", "completion", "text"}, "prompt_completion"),
    ({"instruction", "input", "prompt", "text"}, "text"),
    ({"instruction", "input", "prompt"}, None),
    (set(), None),
])
def test_auto_takes_the_first_format_in_its_order(keys: set[str], expected: str | None) -> None:
    assert detect(keys) == expected
    values = {"messages": [USER, ANSWER], "conversations": [{"from": "human", "value": "Hi"}],
              "instruction": "Name a color.", "input": "", "output": "Blue.", "prompt": "The sky is",
              "completion": " blue.", "text": "Plain."}
    row = {key: values[key] for key in keys}
    if expected is None:
        assert reason(row) == NO_FORMAT
    else:
        assert to_conversation(row).format == expected


def test_auto_ignores_null_keys_and_detect_applies_columns() -> None:
    assert to_conversation({"messages": None, "text": "Plain."}).format == "text"
    assert to_conversation({"instruction": "x", "output": None, "text": "Plain."}).format == "text"
    assert detect(["question", "answer"], {"instruction": "question", "output": "answer"}) == "alpaca"
    assert detect(["conversations"], {"messages": "conversations"}) == "messages"
    assert NO_FORMAT == "no messages, conversations, instruction/output, prompt/completion or text column"


def test_an_explicit_format_reads_only_its_own_keys() -> None:
    assert reason({"messages": [USER]}, "sharegpt") == "no conversations column"
    assert reason({"text": "x"}, "messages") == "no messages column"
    with pytest.raises(DataError, match=r"data.format_type='chatml' is not one of: auto, "):
        to_conversation({"text": "x"}, "chatml")


def test_describe_formats_only_when_not_all_messages() -> None:
    assert describe_formats({}) == describe_formats({"messages": 9}) == ""
    assert describe_formats({"text": 2, "messages": 2, "sharegpt": 5}) == \
        "formats: sharegpt=5, messages=2, text=2"
