"""One vLLM CPU run of a benchmark's workload, inside vLLM's own environment (bench/.venv-vllm).

Started by bench/vllm_cpu.py, never by hand: it reads a job file (the model, vLLM's engine
arguments, the inputs the orchestrating benchmark built, and what to do with them), runs an
untimed warm-up and then the timed call, and writes a JSON result. It imports only vLLM, numpy
and the standard library, so vacpack's packages never meet vLLM's.

Tasks:
- generate: greedy generation from token ids, EOS ignored (G1, the shared-prompt workload).
- score: each sequence's log-likelihood after its first token, from `prompt_logprobs=0` (P1).
- embed: `LLM(runner="pooling").embed(texts)` (E1); the embeddings go to an .npy file.
- lora: greedy generation with LoRA adapters assigned per prompt, several runs (the LoRA
  benchmark).
- structured: the same prompts twice, unconstrained and then constrained by a JSON schema through
  vLLM's structured outputs, each timed; sampled at temperature 1 from the engine's one seed
  (vLLM's CPU sampler refuses per-request seeds: "CPU Generator does not use offset"), EOS
  ignored (the structured-outputs benchmark).

vLLM's engine computes in child processes, so CPU time and peak memory are summed over this
process's whole tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from process_timing import timed_section


def log(message: str) -> None:
    print(f"[vllm-cpu] {message}", file=sys.stderr, flush=True)


def process_tree_cpu_s() -> float:
    """CPU seconds used by this process and every living descendant (vLLM's engine core and
    its worker do the computing)."""
    import psutil

    me = psutil.Process()
    total_s = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total_s += times.user + times.system
    return total_s


def process_tree_peak_rss_bytes() -> int:
    """The sum of every process's own peak resident memory (VmHWM) in this tree: an upper bound
    on the tree's peak, since the processes need not peak at the same moment."""
    import psutil

    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024  # in kB
    return total


def engine_fields(llm: Any) -> dict[str, Any]:
    """What vLLM resolved its settings to (the step budget, cache layout, dtype)."""
    config = llm.llm_engine.vllm_config
    return {
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "max_model_len": config.model_config.max_model_len,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "kv_cache_page_tokens": config.cache_config.block_size,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
    }


def run_generate(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    def params(max_tokens: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def requests(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": prompt} for prompt in prompts]

    if job.get("warmup_prompts"):
        log(f"warm-up, {len(job['warmup_prompts'])} other prompts (not timed)")
        llm.generate(
            requests(job["warmup_prompts"]), params(job["warmup_max_tokens"]), use_tqdm=False
        )
    log(f"generating for {len(job['prompts'])} prompts")
    with timed_section(process_tree_cpu_s) as section:
        outputs = llm.generate(requests(job["prompts"]), params(job["max_tokens"]), use_tqdm=False)
    return {
        "timed": section.fields(),
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        # Prompt tokens found in the prefix cache, per request: the rest were computed.
        "num_cached_prompt_tokens": [o.num_cached_tokens or 0 for o in outputs],
    }


def run_score(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Sums the log-probability vLLM reports for each prompt token after the first: with
    prompt_logprobs=0 each position holds the actual token's entry. One sampled token per
    request is the least vLLM generates."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def score(sequences: list[list[int]]) -> list[Any]:
        return llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)

    if job.get("warmup_prompts"):
        log(f"warm-up, {len(job['warmup_prompts'])} short sequences (not timed)")
        score(job["warmup_prompts"])
    log(f"scoring {len(job['prompts'])} sequences")
    with timed_section(process_tree_cpu_s) as section:
        outputs = score(job["prompts"])
    totals = []
    for sequence, output in zip(job["prompts"], outputs, strict=True):
        positions = list(output.prompt_logprobs)[1:]  # the first token has no prediction
        pairs = zip(sequence[1:], positions, strict=True)
        totals.append(sum(entries[token].logprob for token, entries in pairs))
    return {"timed": section.fields(), "document_logprobs": totals}


def run_embed(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    if job.get("warmup_texts"):
        log(f"warm-up, {len(job['warmup_texts'])} texts (not timed)")
        llm.embed(job["warmup_texts"], use_tqdm=False)
    log(f"embedding {len(job['texts'])} texts")
    with timed_section(process_tree_cpu_s) as section:
        outputs = llm.embed(job["texts"], use_tqdm=False)
    embeddings = np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
    np.save(job["embeddings_output"], embeddings)
    return {
        "timed": section.fields(),
        "num_real_tokens": sum(len(o.prompt_token_ids) for o in outputs),
    }


def run_structured(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Both batches on one engine: prefix caching must be off in the job's engine arguments, or
    the second batch reuses the first's prompt KV."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def params(schema: Any, count: int, max_tokens: int) -> list[Any]:
        return [
            SamplingParams(
                temperature=1.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                structured_outputs=None if schema is None else StructuredOutputsParams(json=schema),
            )
            for _ in range(count)
        ]

    def generate(prompts: list[list[int]], batch_params: list[Any]) -> list[Any]:
        requests = [{"prompt_token_ids": prompt} for prompt in prompts]
        return llm.generate(requests, batch_params, use_tqdm=False)

    batches = (("unconstrained", None), ("json_schema", job["schema"]))
    warmup_prompts = job["warmup_prompts"]
    log(f"warm-up, {len(warmup_prompts)} other prompts, both batches' kinds (not timed)")
    for _, schema in batches:
        count, max_tokens = len(warmup_prompts), job["warmup_max_tokens"]
        generate(warmup_prompts, params(schema, count, max_tokens))
    runs = {}
    for name, schema in batches:
        batch_params = params(schema, len(job["prompts"]), job["max_tokens"])
        log(f"{name}: {len(job['prompts'])} prompts x {job['max_tokens']} tokens")
        with timed_section(process_tree_cpu_s) as section:
            outputs = generate(job["prompts"], batch_params)
        runs[name] = {
            "timed": section.fields(),
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_prompt_tokens": [o.num_cached_tokens or 0 for o in outputs],
        }
    config = llm.llm_engine.vllm_config.structured_outputs_config
    return {"runs": runs, "structured_outputs_backend": config.backend}


def run_lora(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation, EOS ignored, per run: each prompt with its adapter (None: the base
    model) as `job["runs"]` assign them; each run timed on its own, in order, once warmed up."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    adapters = {
        adapter["id"]: LoRARequest(adapter["name"], adapter["id"], adapter["path"])
        for adapter in job["adapters"]
    }
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    requests = [{"prompt_token_ids": prompt} for prompt in job["prompts"]]

    def generate(adapter_ids: list[int | None]) -> Any:
        lora = [adapters[i] if i is not None else None for i in adapter_ids]
        return llm.generate(requests, params, use_tqdm=False, lora_request=lora)

    runs = {}
    for name, adapter_ids in job["runs"].items():
        log(f"{name}: warm-up (not timed)")
        generate(adapter_ids)
        log(f"{name}: {len(requests)} prompts x {job['max_tokens']} tokens")
        with timed_section(process_tree_cpu_s) as section:
            outputs = generate(adapter_ids)
        runs[name] = {
            "timed": section.fields(),
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        }
    return {"runs": runs}


TASKS = {
    "lora": run_lora,
    "generate": run_generate,
    "score": run_score,
    "embed": run_embed,
    "structured": run_structured,
}


def run(job: dict[str, Any]) -> dict[str, Any]:
    import vllm

    log(f"vLLM {vllm.__version__}: loading {job['model_dir']} (not timed)")
    load_start_s = time.perf_counter()
    llm = vllm.LLM(job["model_dir"], **job["engine_args"])
    load_s = time.perf_counter() - load_start_s
    result = TASKS[job["task"]](llm, job)
    result.update(
        {
            "vllm_version": vllm.__version__,
            "engine_args": job["engine_args"],
            "engine": engine_fields(llm),
            # Loading includes torch.compile's first compilation, cached for later runs.
            "load_s": load_s,
            "peak_rss_bytes": process_tree_peak_rss_bytes(),
            "peak_rss_note": "sum of the peak RSS of this process and vLLM's engine processes",
            "run_settings": {
                name: os.environ.get(name)
                for name in (
                    "LD_PRELOAD",
                    "VLLM_CPU_OMP_THREADS_BIND",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU",
                )
            },
        }
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--worker-output", type=Path, required=True)
    args = parser.parse_args()
    # vLLM logs to stdout, which the orchestrating benchmark keeps for its results table; the
    # engine processes inherit the redirection.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    job = json.loads(args.job.read_text())
    try:
        result = run(job)
    except Exception as error:  # the orchestrator reports it in the system's row
        result = {"error": f"{type(error).__name__}: {error}"}
    args.worker_output.write_text(json.dumps(result))
    return 0


# vLLM starts its engine processes with spawn, which re-imports this file: only here may work
# begin.
if __name__ == "__main__":
    sys.exit(main())
