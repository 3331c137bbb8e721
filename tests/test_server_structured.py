"""Structured outputs and tool calls through a real server and the official `openai` client, a
batch file and the command line, on a random-weight model (only constraints make it parse)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_process import running_server

from vacpack import LLM, SamplingParams
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch
from vacpack.cli import main

# As Qwen 2.5's template does: tools in a system turn, calls as <tool_call> blocks.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call one or more functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tools' signatures take some 370 tokens of the tiny tokenizer's small vocabulary.
MAX_MODEL_LEN = 1024
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def tools_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("tools") / "qwen2"
    shutil.copytree(tiny_checkpoint("qwen2"), model_dir)
    (model_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    return model_dir


@pytest.fixture(scope="module")
def tools_llm(tools_checkpoint: Path) -> LLM:
    return LLM(str(tools_checkpoint), dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(tools_checkpoint: Path) -> Iterator[openai.OpenAI]:
    server = running_server(
        tools_checkpoint,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(8 << 20),
        "--served-model-name", "tiny",
        "--dtype", "float32",
    )  # fmt: skip
    with server as process, openai.OpenAI(base_url=process.api_url, api_key="unused") as api:
        yield api


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 150, **kwargs}
    return client.chat.completions.create(**kwargs)


def _strict_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def _assert_valid_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_json_schema_response_format_validates(client: openai.OpenAI) -> None:
    # strict adds "additionalProperties": false, as OpenAI's strict mode guarantees.
    response_format = _strict_json_schema(PERSON)
    response = _chat(client, response_format=response_format, n=3, temperature=1.0, seed=3)
    strict = {**PERSON, "additionalProperties": False}
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), strict)


def test_tool_choice_required_gives_calls_that_parse(client: openai.OpenAI) -> None:
    for seed in range(3):
        response = _chat(
            client,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
        )
        [choice] = response.choices
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        _assert_valid_call(call)


def test_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    response = _chat(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=5, n=2)
    for choice in response.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        _assert_valid_call(call)


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client: openai.OpenAI) -> None:
    kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 0}
    [whole] = _chat(client, **kwargs).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish_reasons = []
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert finish_reasons == ["tool_calls"]
    assert calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        whole.function.name,
        whole.function.arguments,
    )


def test_auto_tool_choice_parses_hermes_calls_and_content(client: openai.OpenAI) -> None:
    # A random model would not call a tool by itself: a regex makes it write one, which the
    # Hermes parser (picked from the template) splits from the content before it.
    call_text = (
        r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}'
        r"\n</tool_call>"
    )
    extra = {"structured_outputs": {"regex": call_text}}
    response = _chat(client, tools=TOOLS, temperature=0, extra_body=extra)
    message = response.choices[0].message
    assert message.content == "Sure. "
    [call] = message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["tz"] in ("UTC", "CET")


def test_tools_reach_the_chat_template(client: openai.OpenAI) -> None:
    without = _chat(client, max_tokens=2, temperature=0)
    with_tools = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=2, temperature=0)
    # The template writes the tools' signatures into the prompt; "none" parses nothing.
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 40
    assert with_tools.choices[0].message.tool_calls is None


def _tokenize(client: openai.OpenAI, **body: Any) -> list[int]:
    server_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    response = httpx.post(f"{server_url}/tokenize", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _conversation(arguments: str | None, user_content: Any = "And in Rome?") -> list[dict]:
    call: dict[str, Any] = {"name": "get_time"}
    if arguments is not None:
        call["arguments"] = arguments
    return [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "user", "content": user_content},
    ]


def test_tokenize_renders_messages_and_tools_as_chat_does(client: openai.OpenAI) -> None:
    messages = _conversation('{"tz": "UTC"}')
    chat = _chat(client, messages=messages, tools=TOOLS, max_tokens=1)
    with_tools = _tokenize(client, messages=messages, tools=TOOLS)
    assert len(with_tools) == chat.usage.prompt_tokens
    # The tools' signatures and the earlier call are in both.
    assert len(_tokenize(client, messages=messages)) < len(with_tools) - 40
    no_arguments = _tokenize(client, messages=_conversation("{}"))
    assert len(no_arguments) < len(_tokenize(client, messages=messages))


@pytest.mark.parametrize(
    "arguments", ["", "  ", "null", None], ids=["empty", "blank", "null", "absent"]
)
def test_an_earlier_call_without_arguments_reads_as_empty_arguments(
    client: openai.OpenAI, arguments: str | None
) -> None:
    # As vLLM reads them: some clients write a call without parameters so, and resend it.
    expected = _chat(client, messages=_conversation("{}"), max_tokens=1).usage.prompt_tokens
    given = _chat(client, messages=_conversation(arguments), max_tokens=1)
    assert given.usage.prompt_tokens == expected


def test_llm_chat_renders_earlier_calls_as_the_server_does(
    client: openai.OpenAI, tools_llm: LLM
) -> None:
    # Arguments given as JSON text: decoded once, not written out by tojson as a string.
    messages = _conversation('{"tz": "UTC"}')
    params = SamplingParams(max_tokens=1)
    [output] = tools_llm.chat(messages, params, use_tqdm=False, tools=TOOLS)
    assert output.prompt_token_ids == _tokenize(client, messages=messages, tools=TOOLS)
    [empty] = tools_llm.chat(_conversation(""), params, use_tqdm=False)
    assert empty.prompt_token_ids == _tokenize(client, messages=_conversation("{}"))


def test_text_parts_are_joined_one_per_line(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]
    as_parts = _tokenize(client, messages=[{"role": "user", "content": parts}])
    as_lines = _tokenize(client, messages=[{"role": "user", "content": "Line one.\nLine two."}])
    assert as_parts == as_lines


def test_bad_schema_and_bad_tool_choice_get_a_400_naming_the_problem(
    client: openai.OpenAI,
) -> None:
    bad_schema = {"type": "array", "minItems": 3, "maxItems": 1}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, response_format=response_format)
    error = caught.value.body
    assert error["param"] == "response_format"
    assert "minItems (3) is greater than maxItems (1)" in error["message"]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        _chat(client, logit_bias={"5": 101})


@pytest.mark.parametrize("grammar", ["root ::= ", 'root ::= ""', 'start: ""'])
def test_a_grammar_matching_only_the_empty_string_gets_a_400(
    client: openai.OpenAI, grammar: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="tiny",
            prompt="x",
            max_tokens=4,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
    error = caught.value.body
    assert error["param"] == "structured_outputs"
    assert "root rule matches only the empty string" in error["message"]


@pytest.mark.parametrize(
    ("guided_field", "key", "value"),
    [
        ("guided_json", "json", PERSON | {"additionalProperties": False}),
        ("guided_regex", "regex", "[0-9]{3}-[a-z]{2}"),
        ("guided_choice", "choice", ["alpha", "beta", "gamma"]),
        ("guided_grammar", "grammar", 'root ::= "yes" | "no" | "maybe"'),
    ],
)
def test_guided_fields_constrain_as_structured_outputs_does(
    client: openai.OpenAI, guided_field: str, key: str, value: Any
) -> None:
    """vLLM's guided_* fields: the same sampled choices as the structured_outputs key they name
    (a backend's name is taken and ignored)."""

    def texts(extra: dict[str, Any]) -> list[str]:
        response = client.completions.create(
            model="tiny", prompt="answer:", max_tokens=150, temperature=1.0, n=3, seed=5,
            extra_body=extra,
        )  # fmt: skip
        return [choice.text for choice in response.choices]

    guided = texts({guided_field: value, "guided_decoding_backend": "xgrammar"})
    assert guided == texts({"structured_outputs": {key: value}})
    assert guided != texts({})  # the constraint did something
    if key == "json":
        for text in guided:
            jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_choice": ["a"], "guided_regex": "a+"}, "guided_choice", "cannot be combined"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice", "cannot"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be non-empty strings"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ],
)
def test_bad_guided_fields_get_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param
    assert message in error["message"]


def test_completion_choice_and_logit_bias(client: openai.OpenAI, tools_checkpoint) -> None:
    choices = ["alpha", "beta"]
    response = client.completions.create(
        model="tiny",
        prompt="pick one:",
        max_tokens=10,
        temperature=1.0,
        n=4,
        seed=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(choice.text in choices for choice in response.choices)
    forced = client.completions.create(
        model="tiny",
        prompt="the quick brown fox",
        max_tokens=4,
        temperature=0,
        logit_bias={"300": 100},
        extra_body={"ignore_eos": True},
    )
    from vacpack.tokenizer import load_tokenizer

    assert forced.choices[0].text == load_tokenizer(str(tools_checkpoint)).decode([300] * 4)


def test_llm_chat_passes_tools_to_the_template(tools_llm: LLM) -> None:
    params = SamplingParams(max_tokens=1)
    [plain] = tools_llm.chat(MESSAGES, params, use_tqdm=False)
    [with_tools] = tools_llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS)
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids) + 40


def test_batch_file_with_schema_and_forced_tool_calls(tools_llm: LLM, tmp_path) -> None:
    response_format = _strict_json_schema(PERSON)
    bodies = {
        "person": {"messages": MESSAGES, "response_format": response_format, "max_tokens": 150},
        "call": {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 150,
            "seed": 0,
        },
    }
    lines = [
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b})
        for cid, b in bodies.items()
    ]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    output_path = tmp_path / "out.jsonl"
    run_batch(tools_llm, BatchOptions(input_path, output_path, show_progress=False))
    records = {r["custom_id"]: r for r in map(json.loads, output_path.read_text().splitlines())}
    person = records["person"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(person), {**PERSON, "additionalProperties": False})
    # "required" asks for one call or more (parallel calls are on by default).
    calls = records["call"]["response"]["body"]["choices"][0]["message"]["tool_calls"]
    assert calls
    for call in calls:
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]]
        )


def test_command_line_jsonl_lines_carry_their_constraints(tiny_checkpoint, tmp_path) -> None:
    """In-process: the command's start-up is tested elsewhere."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "a", "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        {"prompt": "b", "structured_outputs": {"json": PERSON | {"additionalProperties": False}}},
        {"prompt": "c"},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    results = tmp_path / "results.jsonl"
    command = [
        "generate", "--model", str(tiny_checkpoint("qwen2")),
        "--dtype", "float32", "--input", str(prompts), "--output", str(results),
        "--max-tokens", "150", "--temperature", "1.0", "--sampling-seed", "1", "--quiet",
        "--structured-outputs", '{"choice": ["left", "right"]}',
    ]  # fmt: skip
    assert main(command) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    records.sort(key=lambda record: record["index"])  # written as they finish
    texts = [record["outputs"][0]["text"] for record in records]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", texts[0])
    jsonschema.validate(json.loads(texts[1]), PERSON)
    assert texts[2] in ("left", "right")  # the flag's constraint, for lines without their own
