"""S1's workload: the systems and how each server starts, the decodable checkpoint, the prompts
and their seed. Shared by the orchestrator, the client and the report."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import checkpoints
import harness
import torch

SYSTEMS: tuple[str, ...] = ("vacpack", "transformers_serve")
CHECKPOINT_CACHE_DIR = checkpoints.QWEN2_5_0_5B_SHAPES_DIR.parent
PROMPT_SEED = 0
LOOPBACK = "127.0.0.1"
# vacpack's CPU step budget when none is given; transformers' continuous batching gets the same.
VACPACK_CPU_DEFAULT_BATCHED_TOKENS = 2048
# transformers' own default page size for continuous batching.
HF_CB_PAGE_SIZE_TOKENS = 256
# Modules `transformers serve` imports (transformers[serving]) before it can answer.
TRANSFORMERS_SERVE_MODULES = ("accelerate", "fastapi", "uvicorn", "pydantic", "openai", "rich")


def log(message: str) -> None:
    harness.log(message, "s1")


# ---------------------------------------------------------------------------- the checkpoint


def decodable_token_ids(model_dir: Path) -> list[int]:
    """Ids whose token decodes, alone, to text without a replacement character."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    ids = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        if token_id in special_ids:
            continue
        text = tokenizer.decode([token_id])
        if text and "\ufffd" not in text:
            ids.append(token_id)
    return ids


def ensure_decodable_checkpoint(source_dir: Path) -> Path:
    """`source_dir` with the embedding and LM-head rows of undecodable ids zeroed (built once)."""
    target_dir = CHECKPOINT_CACHE_DIR / f"s1-{source_dir.name}-decodable"
    marker = target_dir / "s1_source.json"
    source = {"source_dir": str(source_dir.resolve())}
    if marker.exists() and json.loads(marker.read_text()) == source:
        return target_dir
    from safetensors import safe_open
    from safetensors.torch import save_file

    log(f"building {target_dir}: {source_dir} with undecodable ids' embedding rows zeroed")
    vocab_size = int(json.loads((source_dir / "config.json").read_text())["vocab_size"])
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[decodable_token_ids(source_dir)] = True
    partial_dir = target_dir.with_name(f"{target_dir.name}.partial-{os.getpid()}")
    partial_dir.mkdir(parents=True)
    for path in source_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, partial_dir / path.name)
            continue
        with safe_open(path, framework="pt") as shard:
            metadata = shard.metadata()
            tensors = {name: shard.get_tensor(name) for name in shard.keys()}  # noqa: SIM118
        for tensor in tensors.values():
            if tensor.dim() == 2 and tensor.shape[0] == vocab_size:  # embed_tokens, lm_head
                tensor[~keep] = 0
        save_file(tensors, partial_dir / path.name, metadata=metadata)
    (partial_dir / marker.name).write_text(json.dumps(source))
    shutil.rmtree(target_dir, ignore_errors=True)
    partial_dir.rename(target_dir)
    return target_dir


# ---------------------------------------------------------------------------- the prompts


def make_prompts(
    model_dir: Path, num_prompts: int, min_prompt_len: int, max_prompt_len: int, seed: int
) -> list[str]:
    """Texts of random decodable tokens; re-encoded they are about their drawn length."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    token_ids = torch.tensor(decodable_token_ids(model_dir))
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(
        min_prompt_len, max_prompt_len + 1, (num_prompts,), generator=generator
    ).tolist()
    prompts = []
    for prompt_len in prompt_lens:
        drawn = token_ids[torch.randint(0, len(token_ids), (prompt_len,), generator=generator)]
        # Tokens joined into text merge into other tokens when encoded again: cut the
        # re-encoding to the drawn length, so the text is that long or close to it.
        text = tokenizer.decode(drawn.tolist())
        prompts.append(tokenizer.decode(tokenizer.encode(text).ids[:prompt_len]))
    return prompts


def num_prompt_tokens(model_dir: Path, prompts: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(prompts)]


# ---------------------------------------------------------------------------- the servers


@dataclass(frozen=True)
class ServerSpec:
    """How to start one system's server and what its request bodies add to the common ones."""

    name: str
    command: list[str]
    extra_body: dict[str, Any]
    settings: dict[str, Any]  # what the results record about how it ran


def vacpack_spec(
    args: argparse.Namespace, model_dir: Path, max_model_len: int, port: int
) -> ServerSpec:
    command = [
        sys.executable, "-m", "vacpack", "serve",
        "--model", str(model_dir), "--served-model-name", str(model_dir), "--dtype", args.dtype,
        "--host", LOOPBACK, "--port", str(port), "--max-model-len", str(max_model_len),
        "--log-level", "warning",
    ]  # fmt: skip
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return ServerSpec("vacpack", command, {"ignore_eos": True}, {"flags": command[4:]})


def transformers_serve_spec(
    args: argparse.Namespace, model_dir: Path, max_model_len: int, port: int
) -> ServerSpec:
    launch = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    flags = [
        "serve", str(model_dir), "--device", "cpu" if not torch.cuda.is_available() else "cuda",
        "--dtype", args.dtype, "--attn-implementation", "sdpa",
        "--host", LOOPBACK, "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    if args.transformers_mode == "continuous-batching":
        # Pages for every client's request at full length at once, as vacpack has room for.
        pages_per_request = math.ceil(max_model_len / HF_CB_PAGE_SIZE_TOKENS)
        flags += [
            "--continuous-batching",
            "--cb-block-size", str(HF_CB_PAGE_SIZE_TOKENS),
            "--cb-num-blocks", str(pages_per_request * max(args.concurrency)),
            "--cb-max-batch-tokens",
            str(args.max_num_batched_tokens or VACPACK_CPU_DEFAULT_BATCHED_TOKENS),
        ]  # fmt: skip
    # eos_token_id -1 leaves the request's EOS set empty: every request runs to max_tokens.
    extra_body = {"generation_config": json.dumps({"eos_token_id": -1})}
    settings = {"mode": args.transformers_mode, "flags": flags}
    return ServerSpec(
        "transformers_serve", [sys.executable, "-c", launch, *flags], extra_body, settings
    )


def transformers_serve_missing() -> str | None:
    """Why `transformers serve` cannot run here, or None if nothing it imports is missing."""
    missing = [m for m in TRANSFORMERS_SERVE_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"not run: transformers serve needs {', '.join(missing)}, not installed here "
        '(pip install -e ".[bench]" installs what it needs)'
    )
