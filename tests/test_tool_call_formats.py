"""Tool-call formats end to end: a chat template that names [TOOL_CALLS] picks the Mistral
parser, one that names <|python_start|> the pythonic one, and run-batch's forced calls come back
parsed in either (tool_parsers/'s own tests need no model)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from test_server_structured import MAX_MODEL_LEN, MESSAGES, PARAMETERS, TOOLS

from vacpack import LLM
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch

# As Mistral's templates do: tools listed up front, calls after [TOOL_CALLS] as a JSON list.
MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS] {{ message.tool_calls | tojson }}</s>
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""
# As Llama 4's pythonic template does: calls as a Python list between its python tags.
PYTHONIC_TEMPLATE = """{%- if tools %}Tools: {{ tools | tojson }}
Call them as [name(argument=value, ...)], between <|python_start|> and <|python_end|>.
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<user>{{ message.content }}</user>
{%- else %}<|python_start|>{{ message.content }}<|python_end|>{% endif %}
{%- endfor %}"""


@pytest.mark.parametrize("template_format", ["mistral", "pythonic"])
def test_the_template_picks_the_format_of_forced_calls(
    tiny_checkpoint, tmp_path, template_format: str
) -> None:
    """Forced calls come in the template's format and parse back; Mistral's with the
    nine-character ids its templates require."""
    model_dir = tmp_path / f"{template_format}-tools"
    shutil.copytree(tiny_checkpoint("qwen2"), model_dir)
    template = MISTRAL_TEMPLATE if template_format == "mistral" else PYTHONIC_TEMPLATE
    (model_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    # One call: a random model would go on adding calls to the list until max_tokens.
    body = {
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 150,
    }  # fmt: skip
    line = {"custom_id": "call", "method": "POST", "url": "/v1/chat/completions", "body": body}
    input_path = tmp_path / "in.jsonl"
    input_path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    output_path = tmp_path / "out.jsonl"
    run_batch(llm, BatchOptions(input_path, output_path, show_progress=False))
    (record,) = map(json.loads, output_path.read_text().splitlines())
    assert record["response"]["status_code"] == 200, record
    message = record["response"]["body"]["choices"][0]["message"]
    assert len(message.get("tool_calls", [])) == 1 and message["content"] is None, message
    for call in message["tool_calls"]:
        if template_format == "mistral":
            assert len(call["id"]) == 9 and call["id"].isalnum()
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]]
        )
