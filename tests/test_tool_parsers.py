"""Tool-call parsing (Hermes, Llama 3 JSON, Mistral, pythonic), streaming that adds up to the
parse, and the grammars that force calls; no model needed."""

from __future__ import annotations

import json

import llguidance
import pytest

from vacpack.openai_api.output_constraints import strict_schema
from vacpack.openai_api.tool_parsers import ToolParser, tool_call_schema, tool_parser
from vacpack.openai_api.tool_streaming import ToolCallStream
from vacpack.structured.grammars import _byte_tokenizer, check_grammar, with_json_layout

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]
HERMES_TEXT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
    '{"name": "g", "arguments": {"b": [2, 3]}}\n</tool_call>'
)
LLAMA3_TEXT = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
MISTRAL_TEXT = (
    'Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
)
# Mistral's newer tokenizers (v11 on): each call after its own marker, its arguments after [ARGS].
MISTRAL_NAMED_TEXT = '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}'
PYTHONIC_TEXT = "[f(a=1, b='x', c=[True, None]), g()]"
# A tool with typed parameters, one of them required, for the pythonic grammar.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["days"],
        },
    },
}


@pytest.fixture(scope="module")
def hermes(bpe) -> ToolParser:
    return tool_parser("hermes", bpe)


@pytest.fixture(scope="module")
def llama3(bpe) -> ToolParser:
    return tool_parser("llama3_json", bpe)


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_hermes_splits_content_and_calls(hermes: ToolParser) -> None:
    parsed = hermes.parse(HERMES_TEXT)
    assert parsed.content == "Let me look.\n"
    assert _calls(parsed) == [("f", {"a": 1}), ("g", {"b": [2, 3]})]
    assert len({call.id for call in parsed.tool_calls}) == 2
    # No block, or blocks that are not calls: all of it is content.
    assert hermes.parse("just text").tool_calls == []
    broken = "x <tool_call>\n{not json}\n</tool_call>"
    assert hermes.parse(broken).content == broken


def test_llama3_json_calls(llama3: ToolParser) -> None:
    parsed = llama3.parse(LLAMA3_TEXT)
    assert parsed.content is None
    assert _calls(parsed) == [("f", {"a": 1}), ("g", {})]
    assert llama3.parse('{"name": "f"} trailing').tool_calls == []
    assert llama3.parse("Hello there").content == "Hello there"


def test_mistral_calls_in_both_forms(bpe) -> None:
    mistral = tool_parser("mistral", bpe)
    parsed = mistral.parse(MISTRAL_TEXT)
    assert parsed.content == "Checking. "
    assert _calls(parsed) == [("f", {"a": 1}), ("g", {})]
    named = mistral.parse(MISTRAL_NAMED_TEXT)
    assert (named.content, _calls(named)) == (None, [("f", {"a": 1}), ("g", {})])
    # Mistral's templates take back only ids of nine letters and digits.
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.tool_calls + named.tool_calls)
    # Anything that is not a whole call list is content, all of it.
    for text in (
        "no calls here",
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}] and more',
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"oops": 1}]',
        "[TOOL_CALLS]f[ARGS]{not json}",
        '[TOOL_CALLS][ARGS]{"a": 1}',
    ):
        assert (mistral.parse(text).content, mistral.parse(text).tool_calls) == (text, [])
    assert mistral.settled("Hi [TOOL") == (3, [])


def test_pythonic_calls(bpe) -> None:
    pythonic = tool_parser("pythonic", bpe)
    parsed = pythonic.parse(PYTHONIC_TEXT)
    assert parsed.content is None
    assert _calls(parsed) == [("f", {"a": 1, "b": "x", "c": [True, None]}), ("g", {})]
    # Llama 4 wraps the list in its python tags; JSON's constants read as Python's.
    wrapped = pythonic.parse('<|python_start|>[f(a=true, b=null, c={"k": false})]<|python_end|>')
    assert _calls(wrapped) == [("f", {"a": True, "b": None, "c": {"k": False}})]
    # Anything that is not a list of calls of literals is content, all of it: it is parsed,
    # never run.
    for text in (
        "Hello",
        "[1, 2]",
        "[]",
        "[f(1)]",
        "[f(a=g())]",
        "[f(a=__import__('os').getcwd())]",
        "[f(**x)]",
        "[x.y(a=1)]",
        "[f(a={1, 2})]",
        "[f(a=1e999)]",
        "[f(a=1)] and more",
    ):
        assert (pythonic.parse(text).content, pythonic.parse(text).tool_calls) == (text, [])
    assert pythonic.settled("Sure, ") == (len("Sure, "), [])
    assert pythonic.settled("<|python_st") == (0, [])


def _grammar_accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(
        _byte_tokenizer(), llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("parallel", [False, True])
def test_pythonic_grammar_forces_calls_that_parse(bpe, parallel: bool) -> None:
    pythonic = tool_parser("pythonic", bpe)
    schema = with_json_layout(tool_call_schema([*TOOLS, WEATHER_TOOL]))
    grammar = pythonic.call_grammar(schema, parallel)
    accepted = [
        "[weather(days=2)]",
        '[weather(city="Paris", days=2, unit="c")]',
        '[weather(days=3, unit="f")]',
        '[f(anything=[1, {"x": null}], more="y")]',
        "[g()]",
    ]
    for text in accepted:
        assert _grammar_accepts(grammar, text), text
        assert pythonic.parse(text).tool_calls, text
    rejected = [
        '[weather(city="Paris")]',  # days is required
        '[weather(days="two")]',  # not an integer
        '[weather(unit="c", days=2)]',  # out of the schema's order
        '[weather(days=2, unit="k")]',
        "[h()]",  # no such tool
        "weather(days=2)",
    ]
    for text in rejected:
        assert not _grammar_accepts(grammar, text), text
    both = "[g(), weather(days=1)]"
    assert _grammar_accepts(grammar, both) == parallel


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_json_nested_past_the_stack_is_content(bpe, parser_name: str) -> None:
    # A model looping on '[' until max_tokens: json raises RecursionError, not a decode error
    # (and Python's parser a SyntaxError or RecursionError).
    marker = {
        "hermes": "<tool_call>\n",
        "llama3_json": "<|python_tag|>",
        "mistral": "[TOOL_CALLS]",
        "pythonic": "",
    }
    text = marker[parser_name] + "[" * 100_000
    parser = tool_parser(parser_name, bpe)
    parsed = parser.parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
    closed = text + "\n</tool_call>" if parser_name == "hermes" else text
    assert parser.settled(closed)[1] == []


@pytest.mark.parametrize(
    ("parser_name", "text"),
    [
        ("hermes", HERMES_TEXT),
        ("llama3_json", LLAMA3_TEXT),
        ("hermes", "plain <tool_ text"),
        ("mistral", MISTRAL_TEXT),
        ("mistral", MISTRAL_NAMED_TEXT),
        ("pythonic", PYTHONIC_TEXT),
        ("pythonic", "[a link](x) is content"),
    ],
)
def test_streamed_pieces_add_up_to_the_parse(bpe, parser_name: str, text: str) -> None:
    parser = tool_parser(parser_name, bpe)
    for piece_size in (1, 3, 7):
        stream = ToolCallStream(parser)
        content = ""
        calls = []
        pieces = [text[i : i + piece_size] for i in range(0, len(text), piece_size)]
        for index, piece in enumerate(pieces):
            new_content, new_calls = stream.feed(piece, finished=index == len(pieces) - 1)
            content += new_content
            calls += stream.call_deltas(new_calls)
        parsed = parser.parse(text)
        assert content == (parsed.content or "")
        assert [c["index"] for c in calls] == list(range(len(parsed.tool_calls)))
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (call.name, call.arguments) for call in parsed.tool_calls
        ]


def test_without_parallel_calls_a_stream_keeps_the_first(hermes: ToolParser) -> None:
    stream = ToolCallStream(hermes, max_calls=1)
    _, calls = stream.feed(HERMES_TEXT, finished=True)
    assert [call.name for call in calls] == ["f"]


def test_hermes_holds_back_a_possible_marker(hermes: ToolParser) -> None:
    assert hermes.settled("Hi <tool") == (3, [])
    assert hermes.settled("Hi <b>") == (len("Hi <b>"), [])


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammars_compile(bpe, parser_name: str, parallel: bool) -> None:
    parser = tool_parser(parser_name, bpe)
    grammar = parser.call_grammar(with_json_layout(tool_call_schema(TOOLS)), parallel)
    check_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), "the tool grammar")


def test_auto_parser_follows_the_chat_template(bpe, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tool_parser("auto", bpe).name == "hermes"
    for template, name in (
        ("{{ '[TOOL_CALLS] ' + calls }}", "mistral"),
        ("{{ '<|python_tag|>' }}", "llama3_json"),
        ("{{ '<|python_start|>' }}", "pythonic"),
        ("{{ '<tool_call>' }}{{ '[TOOL_CALLS]' }}", "hermes"),
    ):
        monkeypatch.setattr(bpe, "chat_template", template, raising=False)
        assert tool_parser("auto", bpe).name == name
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_parser("nope", bpe)


def test_strict_schema_closes_every_object() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {}}},
            "open": {"type": "object", "additionalProperties": True},
        },
    }
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["inner"]["additionalProperties"] is False
    assert strict["properties"]["list"]["items"]["additionalProperties"] is False
    assert strict["properties"]["open"]["additionalProperties"] is True
