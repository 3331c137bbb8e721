"""A table of bad inputs: each gets its documented exit code or status and a message naming what
is at fault, nothing a user owns is touched, and the engine answers the next request.

Command lines run as real processes (forked from one zygote that has vacpack imported); the
Python API, batch files and prompt files share one loaded tiny model. The server's table is in
test_server_errors.py, which shares one server process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bad_input_files import (
    batch_line,
    build_broken_checkpoints,
    completion_line,
    read_records,
    write_lines,
)
from cli_zygote import Zygote

from vacpack import LLM, SamplingParams
from vacpack.batch.options import BatchOptions
from vacpack.batch.prompt_file import GenerateOptions, PromptSource, run_generate_file
from vacpack.batch.runner import run_batch
from vacpack.errors import (
    CorruptWeightsError,
    ExitCode,
    InvalidConfigError,
    ModelNotFoundError,
    TokenizerLoadError,
    WeightsMismatchError,
)
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

MAX_MODEL_LEN = 256
ENGINE_FLAGS = [
    "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
    "--kv-cache-memory-bytes", str(4 << 20),
]  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=3)
TRUNCATION_OVER_CONTEXT = (
    f"truncate_prompt_tokens must be None, -1 (the context's limit) or in [1, {MAX_MODEL_LEN}] "
    f"(max_model_len), got {MAX_MODEL_LEN + 1}"
)


@dataclass(frozen=True)
class Workspace:
    root: Path
    model: Path
    broken: dict[str, Path]
    batch_input: Path
    prompts: Path
    notes: Path  # a user's file, never to be touched
    other_output: Path  # a finished run-batch output for another input
    stale_output: Path  # a run-batch output for an earlier version of batch_input
    classifier: Path  # a model without an LM head

    def protected_files(self) -> dict[Path, bytes]:
        outputs = (self.notes, self.other_output, self.stale_output)
        return {path: path.read_bytes() for path in outputs}


@pytest.fixture(scope="module")
def workspace(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    root = tmp_path_factory.mktemp("bad_inputs")
    model = tiny_checkpoint("qwen2")
    notes = root / "notes.txt"
    notes.write_text("my notes\n")
    other_output = root / "other-output.jsonl"
    record = {"id": "batch_req_1", "custom_id": "someone-else", "response": None, "error": None}
    other_output.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    # It answers custom_id "a", but its id does not carry the digest of batch_input's line.
    stale_output = root / "stale-output.jsonl"
    stale = {"id": f"batch_req_{'0' * 32}", "custom_id": "a", "response": None, "error": None}
    stale_output.write_text(json.dumps(stale, separators=(",", ":")) + "\n")
    return Workspace(
        root=root,
        model=model,
        broken=build_broken_checkpoints(model, root / "broken"),
        batch_input=write_lines(root / "batch.jsonl", [completion_line("a")]),
        prompts=write_lines(root / "prompts.jsonl", [json.dumps({"prompt": "hello"})]),
        notes=notes,
        other_output=other_output,
        stale_output=stale_output,
        classifier=build_tiny_classifier_checkpoint("qwen2", root / "classifier", num_labels=2),
    )


def _generate(model: Path, *args: str) -> list[str]:
    return ["generate", "--model", str(model), *ENGINE_FLAGS, "--quiet", *args]


def _run_batch(model: Path, input_path: Path, output_path: Path | str, *args: str) -> list[str]:
    return ["run-batch", "--model", str(model), *ENGINE_FLAGS, "--quiet",
            "-i", str(input_path), "-o", str(output_path), *args]  # fmt: skip


def _broken(name: str) -> Callable[[Workspace], list[str]]:
    return lambda w: _generate(w.broken[name], "--prompt", "hi")


# (id, argv from the workspace, exit code, words in the one error line)
CLI_CASES: list[tuple[str, Callable[[Workspace], list[str]], ExitCode, str]] = [
    ("generate: input missing",
     lambda w: _generate(w.model, "--input", "nope.jsonl"), ExitCode.FILE_NOT_FOUND,
     "cannot read input file 'nope.jsonl': No such file"),
    ("generate: input a directory",
     lambda w: _generate(w.model, "--input", str(w.root)), ExitCode.IO_ERROR, "Is a directory"),
    ("run-batch: input missing",
     lambda w: _run_batch(w.model, w.root / "nope.jsonl", w.root / "o.jsonl"),
     ExitCode.FILE_NOT_FOUND, "nope.jsonl"),
    ("embed: input missing",
     lambda w: ["embed", "--model", str(w.model), "--input", "nope.txt"],
     ExitCode.FILE_NOT_FOUND, "cannot read input file 'nope.txt'"),
    ("loglikelihood: input missing",
     lambda w: ["loglikelihood", "--model", str(w.model), "--input", "nope.txt"],
     ExitCode.FILE_NOT_FOUND, "nope.txt"),
    ("loglikelihood: a model without an LM head",
     lambda w: ["loglikelihood", "--model", str(w.classifier), "--input", str(w.prompts)],
     ExitCode.USAGE, "has no language-model head"),
    ("generate: output directory missing",
     lambda w: _generate(w.model, "--prompt", "hi", "--output", "no-dir/out.jsonl"),
     ExitCode.FILE_NOT_FOUND, "cannot write output file 'no-dir/out.jsonl'"),
    ("run-batch: output directory missing",
     lambda w: _run_batch(w.model, w.batch_input, "no-dir/out.jsonl"),
     ExitCode.FILE_NOT_FOUND, "no-dir/out.jsonl"),
    ("generate: output where files cannot be created",
     lambda w: _generate(w.model, "--prompt", "hi", "--output", "/sys/vacpack-out.jsonl"),
     ExitCode.PERMISSION_DENIED, "/sys/vacpack-out.jsonl"),
    ("run-batch: output a directory",
     lambda w: _run_batch(w.model, w.batch_input, w.root), ExitCode.IO_ERROR, "Is a directory"),
    ("run-batch: output a user's file",
     lambda w: _run_batch(w.model, w.batch_input, w.notes), ExitCode.OUTPUT_EXISTS,
     "notes.txt' exists and is not an earlier run's output"),
    ("run-batch: output of another input",
     lambda w: _run_batch(w.model, w.batch_input, w.other_output), ExitCode.OUTPUT_EXISTS,
     "custom_id 'someone-else', which the input does not have"),
    ("run-batch: output of an earlier version of the input",
     lambda w: _run_batch(w.model, w.batch_input, w.stale_output), ExitCode.OUTPUT_EXISTS,
     "answers custom_id 'a', whose line in the input has changed since"),
    ("generate: output a user's file",
     lambda w: _generate(w.model, "--input", str(w.prompts), "--output", str(w.notes)),
     ExitCode.OUTPUT_EXISTS, "--overwrite"),
    ("generate: output another command's results",
     lambda w: _generate(w.model, "--input", str(w.prompts), "--output", str(w.other_output)),
     ExitCode.OUTPUT_EXISTS, "not a result record"),
    ("embed: output a user's file",
     lambda w: ["embed", "--model", str(w.model), "--input", str(w.prompts), "--output",
                str(w.notes)], ExitCode.OUTPUT_EXISTS, "notes.txt"),
    ("run-batch: output a full device",
     lambda w: _run_batch(w.model, w.batch_input, "/dev/full"), ExitCode.NO_SPACE,
     "cannot write output file '/dev/full': No space left on device"),
    ("generate: output a full device",
     lambda w: _generate(w.model, "--input", str(w.prompts), "--output", "/dev/full"),
     ExitCode.NO_SPACE, "No space left on device"),
    ("run-batch: output is the input",
     lambda w: _run_batch(w.model, w.batch_input, w.batch_input), ExitCode.USAGE,
     "must not be the input"),
    ("model: no such directory",
     lambda w: _generate(w.root / "no-model", "--prompt", "hi"), ExitCode.MODEL_NOT_FOUND,
     "no-model' is not a directory"),
    ("model: no config.json", _broken("no_config"), ExitCode.MODEL_NOT_FOUND, "has no config.json"),
    ("model: config.json not JSON", _broken("invalid_config_json"), ExitCode.INVALID_CONFIG,
     "config.json"),
    ("model: unsupported architecture", _broken("unsupported_architecture"),
     ExitCode.INVALID_CONFIG, "WizardForCausalLM"),
    ("model: truncated safetensors", _broken("truncated_weights"), ExitCode.CORRUPT_WEIGHTS,
     "model.safetensors' is not valid safetensors"),
    ("model: garbage safetensors", _broken("garbage_weights"), ExitCode.CORRUPT_WEIGHTS,
     "not valid safetensors"),
    ("model: index names a missing shard", _broken("missing_shard"), ExitCode.CORRUPT_WEIGHTS,
     "model-00002-of-00002.safetensors"),
    ("model: config shapes disagree with weights", _broken("wrong_intermediate_size"),
     ExitCode.WEIGHTS_MISMATCH, "has shape [64, 128], but config.json implies [64, 96]"),
    ("model: hidden size disagrees", _broken("wrong_hidden_size"), ExitCode.WEIGHTS_MISMATCH,
     "model.embed_tokens.weight"),
    ("model: more layers than weights", _broken("extra_layer"), ExitCode.WEIGHTS_MISMATCH,
     "layers.2"),
    ("model: no tokenizer files", _broken("no_tokenizer"), ExitCode.TOKENIZER_ERROR,
     "has no tokenizer files"),
    ("flag: negative temperature",
     lambda w: _generate(w.model, "--prompt", "hi", "--temperature", "-1"), ExitCode.USAGE,
     "temperature must be"),
    ("flag: --n above --max-n for an input file",
     lambda w: _generate(w.model, "--input", str(w.prompts), "--n", "200"), ExitCode.USAGE,
     "--n 200 is above --max-n 128"),
    ("flag: context over the model's",
     lambda w: [*_generate(w.model, "--prompt", "hi"), "--max-model-len", "100000"],
     ExitCode.USAGE, "max_model_len=100000 exceeds"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make_argv", "exit_code", "words"),
    [case[1:] for case in CLI_CASES],
    ids=[case[0] for case in CLI_CASES],
)
def test_cli_bad_input_exits_with_its_code_and_one_line(
    cli_zygote: Zygote, workspace: Workspace, make_argv, exit_code: ExitCode, words: str
) -> None:
    protected = workspace.protected_files()
    argv = make_argv(workspace)
    finished = cli_zygote.run(argv, env={"VACPACK_CPU_PREPACK": "0"})
    assert finished.status == exit_code, finished.stderr
    error_lines = [line for line in finished.stderr.splitlines() if "error:" in line]
    assert error_lines == [line for line in error_lines if line.startswith(f"vacpack {argv[0]}:")]
    assert len(error_lines) == 1, finished.stderr
    assert words in error_lines[0]
    assert "Traceback" not in finished.stderr
    assert workspace.protected_files() == protected


def test_debug_shows_the_traceback_and_the_same_code(
    cli_zygote: Zygote, workspace: Workspace
) -> None:
    argv = _generate(workspace.broken["truncated_weights"], "--prompt", "hi")
    for finished in (
        cli_zygote.run(["--debug", *argv]),
        cli_zygote.run(argv, env={"VACPACK_DEBUG": "1"}),
    ):
        assert finished.status == ExitCode.CORRUPT_WEIGHTS
        assert "Traceback" in finished.stderr and "SafetensorError" in finished.stderr
        assert finished.stderr.rstrip().splitlines()[-1].startswith("vacpack generate: error:")


def test_a_good_command_runs_after_the_bad_ones(cli_zygote: Zygote, workspace: Workspace) -> None:
    output = workspace.root / "good.jsonl"
    finished = cli_zygote.run(_run_batch(workspace.model, workspace.batch_input, output))
    assert finished.status == 0, finished.stderr
    (record,) = read_records(output)
    assert record["custom_id"] == "a" and record["response"]["status_code"] == 200


@pytest.mark.parametrize("command", ["run-batch", "generate", "embed"])
def test_input_from_a_pipe_is_refused_not_answered_as_empty(
    workspace: Workspace, tmp_path: Path, command: str
) -> None:
    """Each command reads its input more than once (to count it, check an earlier output, run
    it); a pipe yields its lines once, so a later reading would find none and answer nothing."""
    output = tmp_path / "out.jsonl"
    argv = {
        "run-batch": _run_batch(workspace.model, Path("/dev/stdin"), output),
        "generate": _generate(workspace.model, "--input", "/dev/stdin", "--output", str(output)),
        "embed": ["embed", "--model", str(workspace.model), *ENGINE_FLAGS, "--input",
                  "/dev/stdin", "--output", str(output)],
    }[command]  # fmt: skip
    finished = subprocess.run(
        [sys.executable, "-m", "vacpack", *argv],
        input=workspace.batch_input.read_text(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == ExitCode.IO_ERROR, finished.stderr
    (error_line,) = [line for line in finished.stderr.splitlines() if "error:" in line]
    assert "cannot read input file '/dev/stdin': not a regular file" in error_line
    assert not output.exists()


# ---------------------------------------------------------------- Python API


@pytest.fixture(scope="module")
def llm(workspace: Workspace) -> LLM:
    return LLM(
        str(workspace.model), dtype="float32", max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=4 << 20, max_num_seqs=8,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference_text(llm: LLM) -> str:
    return llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].text


def _call_with(case: str, w: Workspace, llm: LLM) -> Any:
    calls: dict[str, Callable[[], Any]] = {
        "missing model": lambda: LLM(str(w.root / "no-model")),
        "truncated weights": lambda: LLM(str(w.broken["truncated_weights"])),
        "shapes disagree": lambda: LLM(str(w.broken["wrong_hidden_size"])),
        "invalid config": lambda: LLM(str(w.broken["invalid_config_json"])),
        "no tokenizer": lambda: LLM(str(w.broken["no_tokenizer"])),
        "unknown engine argument": lambda: LLM(str(w.model), max_seqs=3),
        "empty prompt": lambda: llm.generate([""], GREEDY, use_tqdm=False),
        "prompt over the context": lambda: llm.generate([[5] * 300], GREEDY, use_tqdm=False),
        "token id out of vocab": lambda: llm.generate([[10**7]], GREEDY, use_tqdm=False),
        "negative temperature": lambda: SamplingParams(temperature=-1),
        "params for the wrong count": lambda: llm.generate(["a", "b"], [GREEDY] * 3),
        "contexts without continuations": lambda: llm.loglikelihood(["a", "b"], ["c"]),
        "truncate_prompt_tokens above the context": lambda: llm.generate(
            ["hello"], GREEDY.clone(truncate_prompt_tokens=MAX_MODEL_LEN + 1), use_tqdm=False
        ),
        "engine request truncating above the context": lambda: llm.engine.add_request(
            "over", "hello", GREEDY.clone(truncate_prompt_tokens=MAX_MODEL_LEN + 1)
        ),
    }
    return calls[case]()


# (case, exception type, words in its message)
API_CASES: list[tuple[str, type[Exception], str]] = [
    ("missing model", ModelNotFoundError, "no-model"),
    ("truncated weights", CorruptWeightsError, "not valid safetensors"),
    ("shapes disagree", WeightsMismatchError, "has shape [2048, 64]"),
    ("invalid config", InvalidConfigError, "config.json"),
    ("no tokenizer", TokenizerLoadError, "no tokenizer files"),
    ("unknown engine argument", TypeError, "max_seqs"),
    ("empty prompt", ValueError, "prompt 0: the prompt is empty"),
    ("prompt over the context", ValueError, "prompt 0"),
    ("token id out of vocab", ValueError, "token ids"),
    ("negative temperature", ValueError, "temperature must be"),
    ("params for the wrong count", ValueError, "got 3 SamplingParams for 2 prompts"),
    ("contexts without continuations", ValueError, "one continuation per context"),
    # vLLM refuses a k above max_model_len, however short the prompt.
    ("truncate_prompt_tokens above the context", ValueError, TRUNCATION_OVER_CONTEXT),
    ("engine request truncating above the context", ValueError, TRUNCATION_OVER_CONTEXT),
]


@pytest.mark.parametrize(
    ("case", "error_type", "words"), API_CASES, ids=[case[0] for case in API_CASES]
)
def test_api_bad_input_raises_and_the_engine_goes_on(
    workspace: Workspace, llm: LLM, reference_text: str, case: str, error_type, words: str
) -> None:
    with pytest.raises(error_type) as raised:
        _call_with(case, workspace, llm)
    assert words in str(raised.value)
    assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].text == reference_text


# ---------------------------------------------------------------- batch and prompt files

NESTED = "[" * 100_000 + "]" * 100_000
WIZARD = [{"role": "wizard", "content": "hi"}]
CHAT = "/v1/chat/completions"
LONE_SURROGATE = "hi \ud800"  # valid JSON ("\\ud800"), but not Unicode: no pair follows
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def _earlier_call(function: Any) -> list[dict[str, Any]]:
    """A conversation in which the assistant called a tool as `function` says."""
    call = {"id": "c", "type": "function", "function": function}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "4"},
    ]


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# (id, the bad line, status code (None: a line error record), words in the message)
BATCH_CASES: list[tuple[str, str, int | None, str]] = [
    ("not JSON", "{this is not json", None, "is not valid JSON"),
    ("nested 100,000 deep", NESTED, None, "nests JSON too deeply"),
    ("not an object", "[1, 2]", None, "not a JSON object"),
    ("no custom_id", json.dumps({"url": "/v1/completions", "body": {}}), None, "no custom_id"),
    ("unknown url", batch_line("u", url="/v1/images"), None, "url must be one of"),
    ("GET", json.dumps({"custom_id": "g", "method": "GET", "url": CHAT, "body": {}}), None,
     "method must be POST"),
    ("negative temperature", completion_line("t", temperature=-1), 400, "temperature"),
    ("max_tokens a string", batch_line("m", prompt="hi", max_tokens="abc"), 400, "max_tokens"),
    ("empty prompt", batch_line("e", prompt=""), 400, "empty"),
    ("prompt over the context", batch_line("c", prompt=[5] * 300), 400, "maximum context"),
    ("n = 0", completion_line("n", n=0), 400, "n must be"),
    ("unknown role", batch_line("w", url=CHAT, messages=WIZARD), 400, "messages.0.role"),
    ("user message without content", batch_line("nc", url=CHAT, messages=[{"role": "user"}]),
     400, "messages.0.content is required"),
    ("tool message without tool_call_id",
     batch_line("tc", url=CHAT, messages=[{"role": "tool", "content": "4"}]), 400,
     "tool_call_id is required"),
    ("structured_outputs.choice a number", completion_line("sc", structured_outputs={"choice": 5}),
     400, "structured_outputs.choice must be a list of strings"),
    ("structured_outputs.json text nested 100,000 deep",
     completion_line("sj", structured_outputs={"json": NESTED}), 400, "nests JSON"),
    ("x-guidance a number",
     completion_line("xg", response_format=_schema_format({"type": "object", "x-guidance": 5})),
     400, '"x-guidance" must be an object'),
    ("earlier tool call's function a string",
     batch_line("fs", url=CHAT, messages=_earlier_call("get_weather")), 400,
     "messages.1.tool_calls.0.function must be an object"),
    ("earlier tool call's function a number",
     batch_line("fn", url=CHAT, messages=_earlier_call(5)), 400,
     "messages.1.tool_calls.0.function must be an object"),
    ("earlier tool call's arguments nested 100,000 deep",
     batch_line("fa", url=CHAT, messages=_earlier_call({"name": "f", "arguments": NESTED})), 400,
     "function.arguments nests JSON"),
    ("tool_choice.function a string",
     batch_line("tf", url=CHAT, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                tool_choice={"type": "function", "function": "get_weather"}), 400,
     "tool_choice.function must be an object"),
    ("lone surrogate in the prompt", completion_line("sp", prompt=LONE_SURROGATE), 400,
     "prompt is not valid Unicode"),
    ("lone surrogate in chat content",
     batch_line("sm", url=CHAT, messages=[{"role": "user", "content": LONE_SURROGATE}]), 400,
     "messages.0.content is not valid Unicode"),
    ("lone surrogate in an embedding input",
     batch_line("se", url="/v1/embeddings", input=["fine", LONE_SURROGATE]), 400,
     "input.1 is not valid Unicode"),
    ("lone surrogate in the custom_id", completion_line(LONE_SURROGATE), None,
     "custom_id is not valid Unicode"),
    ("n above --max-n", completion_line("nm", n=129), 400, "n must be at most 128"),
    ("unknown model", completion_line("um", model="gpt-9"), 404, "does not exist"),
    ("truncate_prompt_tokens above the context",
     completion_line("tp", truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400, TRUNCATION_OVER_CONTEXT),
    ("chat truncate_prompt_tokens above the context",
     batch_line("tpc", url=CHAT, messages=[{"role": "user", "content": "hi"}],
                truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400, TRUNCATION_OVER_CONTEXT),
]  # fmt: skip


@pytest.mark.parametrize(
    ("bad_line", "status", "words"),
    [case[1:] for case in BATCH_CASES],
    ids=[case[0] for case in BATCH_CASES],
)
def test_batch_bad_line_gets_its_record_and_the_rest_are_answered(
    llm: LLM, tmp_path: Path, bad_line: str, status: int | None, words: str
) -> None:
    input_path = write_lines(tmp_path / "in.jsonl", [bad_line, completion_line("good")])
    options = BatchOptions(input_path, tmp_path / "out.jsonl", show_progress=False)
    summary = run_batch(llm, options)
    assert (summary.num_answered, summary.num_failed) == (2, 1)
    bad, good = sorted(read_records(options.output_path), key=lambda r: r["custom_id"] == "good")
    if status is None:
        assert bad["response"] is None and words in bad["error"]["message"]
        assert bad["error"]["line"] == 1
    else:
        assert bad["response"]["status_code"] == status
        assert words in bad["response"]["body"]["error"]["message"]
    assert good["response"]["status_code"] == 200


def test_batch_lines_over_the_context_name_the_request_field(
    llm: LLM, workspace: Workspace, tmp_path: Path
) -> None:
    """A batch line's knob is its request's field: an over-long pooling input's 400 names
    truncate_prompt_tokens, not Python's truncate=True or the command line's --truncate; and a
    truncate_prompt_tokens above the context is a 400 naming it, as vLLM refuses it."""
    long_ids = [5] * (MAX_MODEL_LEN + 1)
    long_text = "the river runs past the mill " * MAX_MODEL_LEN  # a token a word, at least
    lines = [
        batch_line("embed", url="/v1/embeddings", input=long_ids),
        batch_line("score", url="/v1/score", text_1="a", text_2=long_text),
        batch_line("rerank", url="/v1/rerank", query="a", documents=["b", long_text]),
        completion_line("cut", truncate_prompt_tokens=MAX_MODEL_LEN + 1),
    ]
    classifier = LLM(str(workspace.classifier), dtype="float32", max_model_len=MAX_MODEL_LEN)
    errors = {
        **_batch_errors(llm, tmp_path / "decoder", lines),
        **_batch_errors(
            classifier,
            tmp_path / "classifier",
            [batch_line("classify", url="/classify", input=long_ids)],
        ),
    }
    assert {name: error["param"] for name, error in errors.items()} == {
        "embed": "input",
        "score": "text_2",
        "rerank": "documents",
        "cut": "truncate_prompt_tokens",
        "classify": "input",
    }
    for name in ("embed", "score", "rerank", "classify"):
        message = errors[name]["message"]
        assert "set the request's truncate_prompt_tokens" in message, message
        assert "truncate=True" not in message and "--truncate" not in message, message
    assert TRUNCATION_OVER_CONTEXT in errors["cut"]["message"]


def _batch_errors(llm: LLM, directory: Path, lines: list[str]) -> dict[str, dict[str, Any]]:
    """Each line's 400 error body, by custom_id, from a run-batch over `lines`."""
    directory.mkdir()
    input_path = write_lines(directory / "in.jsonl", lines)
    options = BatchOptions(input_path, directory / "out.jsonl", show_progress=False)
    run_batch(llm, options)
    responses = {r["custom_id"]: r["response"] for r in read_records(options.output_path)}
    assert {response["status_code"] for response in responses.values()} == {400}, responses
    return {name: response["body"]["error"] for name, response in responses.items()}


def _raise_on_boom(prepare: Callable[..., Any]) -> Callable[..., Any]:
    """`prepare`, but raising an error no check expects (a stand-in for a bug) for the prompt
    "boom"."""

    def prepare_or_raise(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.prompt == "boom":
            raise RuntimeError("boom")
        return prepare(request, *args, **kwargs)

    return prepare_or_raise


def test_batch_lines_around_bad_ones_all_get_their_records(
    llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vacpack.batch.line_requests as line_requests

    monkeypatch.setattr(
        line_requests, "prepare_generation", _raise_on_boom(line_requests.prepare_generation)
    )
    lines = [
        completion_line("before"),
        completion_line("bad", structured_outputs={"choice": 5}),
        completion_line("bug", prompt="boom"),
        completion_line("after"),
    ]
    input_path = write_lines(tmp_path / "in.jsonl", lines)
    options = BatchOptions(input_path, tmp_path / "out.jsonl", show_progress=False)
    summary = run_batch(llm, options)
    assert (summary.num_answered, summary.num_failed) == (4, 2)
    records = read_records(options.output_path)
    order = [record["custom_id"] for record in records]
    # "before" was in the engine while the bad lines were answered, and still got its record.
    assert order.index("bad") < order.index("before")
    statuses = {r["custom_id"]: r["response"]["status_code"] for r in records}
    assert statuses == {"before": 200, "bad": 400, "bug": 500, "after": 200}
    bug = next(r for r in records if r["custom_id"] == "bug")["response"]["body"]["error"]
    assert bug["message"] == "internal error: RuntimeError: boom"
    assert bug["type"] == "server_error"


def test_batch_embedding_that_fails_unexpectedly_fails_alone(
    llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    embed = llm.embed

    def embed_or_raise(inputs: list[Any], **kwargs: Any) -> Any:
        if "boom" in inputs:
            raise RuntimeError("boom")
        return embed(inputs, **kwargs)

    monkeypatch.setattr(llm, "embed", embed_or_raise)
    lines = [
        batch_line(custom_id, url="/v1/embeddings", input=text)
        for custom_id, text in (("before", "hello"), ("bug", "boom"), ("after", "world"))
    ]
    input_path = write_lines(tmp_path / "in.jsonl", lines)
    options = BatchOptions(input_path, tmp_path / "out.jsonl", show_progress=False)
    summary = run_batch(llm, options)
    assert (summary.num_answered, summary.num_failed) == (3, 1)
    records = {r["custom_id"]: r["response"] for r in read_records(options.output_path)}
    assert {name: r["status_code"] for name, r in records.items()} == {
        "before": 200,
        "bug": 500,
        "after": 200,
    }
    assert "RuntimeError: boom" in records["bug"]["body"]["error"]["message"]
    assert len(records["after"]["body"]["data"][0]["embedding"]) == 64


# (id, the bad prompt line, words in its error record)
PROMPT_CASES: list[tuple[str, str, str]] = [
    ("not JSON", "{nope", "line 1 is not valid JSON"),
    ("nested 100,000 deep", NESTED, "line 1 is not valid JSON"),
    ("no prompt", json.dumps({"temperature": 1}), 'line 1 has no "prompt"'),
    ("negative temperature", json.dumps({"prompt": "x", "temperature": -5}), "temperature"),
    ("max_tokens a string", json.dumps({"prompt": "x", "max_tokens": "abc"}), "max_tokens"),
    ("top_p above 1", json.dumps({"prompt": "x", "top_p": 7}), "top_p must be in (0, 1]"),
    ("two prompts on a line", json.dumps({"prompt": ["a", "b"]}), "one prompt per line"),
    ("prompt over the context", json.dumps({"prompt": [5] * 300}), "maximum context length"),
    ("structured_outputs.choice a number",
     json.dumps({"prompt": "x", "structured_outputs": {"choice": 5}}),
     "line 1: structured_outputs.choice must be a list of strings"),
    ("structured_outputs.json text nested 100,000 deep",
     json.dumps({"prompt": "x", "structured_outputs": {"json": NESTED}}),
     "line 1: structured_outputs.json nests JSON"),
    ("lone surrogate in the prompt", json.dumps({"prompt": LONE_SURROGATE}),
     "line 1: prompt is not valid Unicode"),
    ("n above --max-n", json.dumps({"prompt": "x", "n": 129}), "line 1: n must be at most 128"),
    ("truncate_prompt_tokens above the context",
     json.dumps({"prompt": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}),
     f"line 1: {TRUNCATION_OVER_CONTEXT}"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("bad_line", "words"), [case[1:] for case in PROMPT_CASES], ids=[c[0] for c in PROMPT_CASES]
)
def test_prompt_file_bad_line_gets_its_record_and_the_rest_are_answered(
    llm: LLM, reference_text: str, tmp_path: Path, bad_line: str, words: str
) -> None:
    good = json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0})
    source = PromptSource(write_lines(tmp_path / "in.jsonl", [bad_line, good]))
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    summary = run_generate_file(llm, source, {"temperature": 1.0, "max_tokens": 8}, options)
    assert (summary.num_answered, summary.num_failed) == (2, 1)
    records = {r["index"]: r for r in read_records(tmp_path / "out.jsonl")}
    assert records[0]["line"] == 1 and words in records[0]["error"]
    assert records[1]["outputs"][0]["text"] == reference_text


def test_prompt_file_line_that_fails_unexpectedly_fails_alone(
    llm: LLM, reference_text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vacpack.batch.prompt_file as prompt_file

    prepare = _raise_on_boom(prompt_file.prepare_completion)
    monkeypatch.setattr(prompt_file, "prepare_completion", prepare)
    good = json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0})
    lines = [good, json.dumps({"prompt": "boom"}), good]
    source = PromptSource(write_lines(tmp_path / "in.jsonl", lines))
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    summary = run_generate_file(llm, source, {"max_tokens": 3}, options)
    assert (summary.num_answered, summary.num_failed) == (3, 1)
    records = {r["index"]: r for r in read_records(tmp_path / "out.jsonl")}
    assert records[1]["error"] == "line 2: internal error: RuntimeError: boom"
    assert records[0]["outputs"][0]["text"] == records[2]["outputs"][0]["text"] == reference_text
