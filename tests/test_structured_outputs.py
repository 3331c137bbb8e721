"""Structured outputs through LLM.generate on a random-weight model: it babbles, so only the
constraint can make its outputs parse. Every output must parse and validate."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from vacpack import LLM, SamplingParams
from vacpack.engine.engine import MAX_IDLE_STEPS
from vacpack.structured.grammars import grammar_spec
from vacpack.structured.params import StructuredOutputsParams

# Free strings are bounded (maxLength), objects closed (additionalProperties false) and arrays
# capped: a babbling model would otherwise write until max_tokens and cut its document off.
SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 999},
        "minItems": 2,
        "maxItems": 5,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 100000},
            "note": {"type": "string", "maxLength": 8},
            "flag": {"type": "boolean"},
        },
        "required": ["id", "flag"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": -1.5, "maximum": 99.5},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
        "required": ["score", "ratio"],
        "additionalProperties": False,
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$"},
        },
        "required": ["code", "date"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "any_of_and_null": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "null"},
                    {"type": "boolean"},
                ]
            },
            "label": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["value", "label"],
        "additionalProperties": False,
    },
    "nested_arrays": {
        "type": "array",
        "minItems": 2,
        "maxItems": 3,
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {"type": "integer", "minimum": -9, "maximum": 9},
        },
    },
    "string_lengths": {
        "type": "object",
        "properties": {
            "short": {"type": "string", "minLength": 2, "maxLength": 4},
            "tags": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "string", "minLength": 1, "maxLength": 3},
            },
        },
        "required": ["short", "tags"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 50},
                    "y": {"type": "integer", "minimum": 0, "maximum": 50},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "const_and_boolean": {
        "type": "object",
        "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
        "additionalProperties": False,
    },
}
ARITHMETIC_GBNF = 'root ::= "(" expr ")"\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]{1,3}'
ARITHMETIC = re.compile(r"\(\d{1,3}([+-]\d{1,3})*\)")
PLATE_REGEX = r"[A-Z]{2}-[0-9]{3}-[a-z]{2}"


def _json(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


def _sampled(seed: int, structured: StructuredOutputsParams, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 200)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=structured, **kwargs)


def _assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> Iterator[LLM]:
    yield LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=512)


def test_every_schema_output_parses_and_validates(llm: LLM) -> None:
    names = list(SCHEMAS)
    params = [_sampled(seed, _json(SCHEMAS[name])) for seed, name in enumerate(names)]
    outputs = llm.generate(["Answer in JSON:"] * len(names), params, use_tqdm=False)
    for name, output in zip(names, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        _assert_valid(completion.text, SCHEMAS[name])


def test_json_object_regex_choice_and_grammars(llm: LLM) -> None:
    choices = ["yes", "no", "it depends"]
    constraints = [
        StructuredOutputsParams(regex=PLATE_REGEX),
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(grammar=ARITHMETIC_GBNF),
        StructuredOutputsParams(grammar='start: "<" WORD ("," WORD)* ">"\nWORD: /[a-z]{1,4}/'),
    ]
    params = [_sampled(seed, c, max_tokens=120) for c in constraints for seed in range(2)]
    # Any object: keys and strings are unbounded, so a bias towards closing them (on the
    # same masking path) keeps a babbling model's object short enough to finish.
    tokenizer = llm.get_tokenizer()
    closing = {tokenizer.convert_tokens_to_ids(t): 6.0 for t in ('"', "}")}
    params.append(_sampled(0, StructuredOutputsParams(json_object=True), logit_bias=closing))
    outputs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    texts = [output.outputs[0].text for output in outputs]
    plates, picks, sums, words = (texts[i : i + 2] for i in range(0, 8, 2))
    assert all(re.fullmatch(PLATE_REGEX, text) for text in plates), plates
    assert all(text in choices for text in picks), picks
    assert all(ARITHMETIC.fullmatch(text) for text in sums), sums
    assert all(re.fullmatch(r"<[a-z]{1,4}(,[a-z]{1,4})*>", text) for text in words), words
    assert isinstance(json.loads(texts[-1]), dict), texts[-1]


def test_n_samples_each_follow_the_schema(llm: LLM) -> None:
    schema = {**SCHEMAS["array_of_objects"], "title": "n samples"}  # not compiled before
    compiler = llm.engine.structured.compiler
    num_compiled_before = compiler.num_compiled
    [output] = llm.generate("List:", _sampled(7, _json(schema), n=4), use_tqdm=False)
    texts = [completion.text for completion in output.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1, texts  # distinct samples, all valid
    for text in texts:
        _assert_valid(text, schema)
    # Four matchers, one compiled grammar (cached by grammar and tokenizer).
    assert compiler.num_compiled == num_compiled_before + 1


def test_the_test_tokenizer_spells_json_byte_by_byte(llm: LLM) -> None:
    # A byte-level BPE over all 256 bytes: every character JSON needs is one token (or a few
    # byte tokens, for non-ASCII), so any document can be written.
    tokenizer = llm.get_tokenizer()
    for character in '{}[]":,.-+0123456789eE truefalsnu\\/bfnrt':
        assert len(tokenizer.encode(character, add_special_tokens=False)) == 1, character
    for text in ("é", "中", "😀"):
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(token_ids) == text


def test_cut_off_document_finishes_with_length(llm: LLM) -> None:
    schema = SCHEMAS["nested_object"]
    [output] = llm.generate("x", _sampled(0, _json(schema), max_tokens=4), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def test_stop_string_ends_a_constrained_output(llm: LLM) -> None:
    params = _sampled(0, StructuredOutputsParams(regex=r"ab(cd)+"), max_tokens=30, stop=["c"])
    [output] = llm.generate("x", params, use_tqdm=False)
    assert output.outputs[0].text == "ab" and output.outputs[0].stop_reason == "c"


def test_invalid_schema_is_refused_before_any_work(llm: LLM) -> None:
    bad = _sampled(0, _json({"type": "array", "minItems": 3, "maxItems": 1}))
    with pytest.raises(ValueError, match=r"prompt 1: .*minItems \(3\) is greater than"):
        llm.generate(["fine", "bad"], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    with pytest.raises(ValueError, match="unclosed character class"):
        llm.generate("x", _sampled(0, StructuredOutputsParams(regex="([a-")), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    [output] = llm.generate("still works", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


# (what a request's or --structured-outputs' JSON gave, words in the ValueError)
MALFORMED_CONSTRAINTS: list[tuple[dict[str, Any], str]] = [
    ({"choice": 5}, "choice must be a list of strings"),
    ({"choice": True}, "choice must be a list of strings"),
    ({"choice": {"yes": 1}}, "choice must be a list of strings"),
    ({"json": "[" * 100_000 + "]" * 100_000}, "structured_outputs.json nests JSON"),
    ({"json": {"type": "object", "x-guidance": 5}}, '"x-guidance" must be an object'),
]

# Grammars llguidance accepts that match the empty string alone: the output could only be "".
EMPTY_ONLY_GRAMMARS = [
    "root ::= ",
    "root ::= \n",
    'root ::= ""',
    'root ::= "" | ""',
    'root ::= ""*',
    'root ::= body\nbody ::= ""',
    "start: ",
    'start: ""',
]


@pytest.mark.parametrize(("given", "words"), MALFORMED_CONSTRAINTS)
def test_a_malformed_constraint_is_a_value_error(given: dict[str, Any], words: str) -> None:
    # A ValueError (GrammarError is one) is what the server, batch files and the command line
    # turn into a 400 or a usage error; a TypeError or RecursionError would be a crash.
    with pytest.raises(ValueError, match=re.escape(words)):
        grammar_spec(StructuredOutputsParams.from_dict(given))


@pytest.mark.parametrize("grammar", EMPTY_ONLY_GRAMMARS)
def test_a_grammar_matching_only_the_empty_string_is_refused(grammar: str) -> None:
    message = "the grammar's root rule matches only the empty string"
    with pytest.raises(ValueError, match=re.escape(message)):
        grammar_spec(StructuredOutputsParams(grammar=grammar))


def test_empty_only_constraints_are_refused_before_any_work(llm: LLM) -> None:
    empty = _sampled(0, StructuredOutputsParams(grammar="root ::= "))
    with pytest.raises(ValueError, match="prompt 1: the grammar's root rule matches only the emp"):
        llm.generate(["fine", "empty"], [SamplingParams(max_tokens=2), empty], use_tqdm=False)
    for regex in ("()", "a{0}"):
        with pytest.raises(ValueError, match="the regex matches only the empty string"):
            grammar_spec(StructuredOutputsParams(regex=regex))
    # Grammars that may be empty but need not be stay accepted, as do special-token grammars.
    for grammar in ('root ::= "a"?', "root ::= [0-9]*", "start: <|im_end|>"):
        grammar_spec(StructuredOutputsParams(grammar=grammar))
    [output] = llm.generate(
        "x", _sampled(0, StructuredOutputsParams(grammar='root ::= "ab"')), use_tqdm=False
    )
    assert output.outputs[0].text == "ab"


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [plain] = llm.generate("the quick brown fox", greedy, use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    forced_token = 100 if first != 100 else 101
    forced = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced_token: 100}
    )
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={first: -100})
    [with_forced, with_banned] = llm.generate(
        ["the quick brown fox"] * 2, [forced, banned], use_tqdm=False
    )
    assert with_forced.outputs[0].token_ids == [forced_token] * 6
    assert first not in with_banned.outputs[0].token_ids


def test_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    allowed = [10, 20, 30, 40]
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
    )
    [output] = llm.generate("x", params, use_tqdm=False)
    assert set(output.outputs[0].token_ids) <= set(allowed)

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [plain] = llm.generate("hello world", greedy, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    # A word the greedy output writes, of one or more tokens: with it banned, it is gone.
    word = tokenizer.decode(plain.outputs[0].token_ids[2:4]).strip()
    assert word and word in plain.outputs[0].text
    [cleaned] = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word]),
        use_tqdm=False,
    )
    assert word not in cleaned.outputs[0].text


def test_preemption_under_a_small_cache_keeps_outputs_valid(tiny_checkpoint) -> None:
    # 16 pages of 16 tokens for 6 sequences that each grow past 50 tokens: some are preempted
    # and recomputed, and their matchers carry on from the tokens they kept.
    llm = LLM(
        str(tiny_checkpoint("qwen2")),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        kv_cache_memory_bytes=16 * 16 * 2 * 2 * 2 * 16 * 4,
    )
    schema = SCHEMAS["nested_object"]
    params = [_sampled(seed, _json(schema)) for seed in range(6)]
    prompt = "Describe a person with their name and address, as JSON please:"
    outputs = llm.generate([prompt] * 6, params, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for output in outputs:
        _assert_valid(output.outputs[0].text, schema)


def test_async_scheduling_fills_masks_after_launch_with_the_same_outputs(tiny_checkpoint) -> None:
    checkpoint = str(tiny_checkpoint("qwen2"))
    schema = SCHEMAS["refs"]
    params = [_sampled(seed, _json(schema)) for seed in range(4)]
    texts = {}
    for async_scheduling in (False, True):
        llm = LLM(checkpoint, dtype="float32", max_model_len=256, async_scheduling=async_scheduling)
        outputs = llm.generate(["x"] * 4, params, use_tqdm=False)
        texts[async_scheduling] = [output.outputs[0].text for output in outputs]
        steps = [s for s in llm.engine.timeline.steps if s.mask_fill_end_s > 0]
        assert steps
        deferred = [s for s in steps if s.mask_fill_start_s > s.launch_s]
        # Synchronous: every mask is filled before its step is launched. Async: decode steps'
        # masks are filled after launch, while the forward runs.
        assert bool(deferred) == async_scheduling
    assert texts[True] == texts[False]
    for text in texts[True]:
        _assert_valid(text, schema)


def test_other_requests_run_while_a_grammar_compiles(llm: LLM) -> None:
    engine = llm.engine
    compiler = engine.structured.compiler
    release = threading.Event()
    original = compiler._compile

    def slow_compile(spec):
        release.wait(30)
        return original(spec)

    compiler._compile = slow_compile
    try:
        schema = {
            "type": "object",
            "properties": {"slow": {"type": "boolean"}},
            "required": ["slow"],
            "additionalProperties": False,
        }
        engine.add_request("waits", [5, 6, 7], _sampled(0, _json(schema), max_tokens=20))
        engine.add_request("runs", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
        finished = {}
        while "runs" not in finished:
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        assert "waits" not in finished  # still waiting for its grammar
        # Steps that run nothing while a grammar compiles are a wait, not a stuck engine.
        for _ in range(2 * MAX_IDLE_STEPS):
            assert engine.step() == []
    finally:
        release.set()
        compiler._compile = original
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert json.loads(finished["waits"].outputs[0].text) in ({"slow": True}, {"slow": False})


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm: LLM, monkeypatch) -> None:
    compiler = llm.engine.structured.compiler

    def failing_compile(spec):
        raise RuntimeError("out of grammar memory")

    monkeypatch.setattr(compiler, "_compile", failing_compile)
    schema = {"type": "object", "properties": {"fails": {"type": "null"}}, "required": ["fails"]}
    failing = _sampled(0, _json(schema), max_tokens=10)
    fine = SamplingParams(max_tokens=4, ignore_eos=True)
    failed, other = llm.generate(["x", "y"], [failing, fine], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "abort"
    assert len(other.outputs[0].token_ids) == 4
