"""`--ray` on the command line: corpus jobs and generation over Ray Data, `serve` on Ray Serve.

    vacpack embed --ray --num-replicas 4 --model M --input corpus.jsonl --output out/
    vacpack serve --ray --num-replicas 4 --model M --port 8000

Ray is imported only when a command runs with --ray, so the rest of the CLI works without it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

RAY_COMMANDS = ("embed", "loglikelihood", "classify", "generate", "serve")
# Blocks per replica that a small input is split into, so that every replica gets work and
# a replica that dies loses little.
BLOCKS_PER_REPLICA = 4


def add_ray_args(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group(
        "ray (scale out over a Ray cluster; pip install vacpack[ray])"
    )
    group.add_argument(
        "--ray",
        action="store_true",
        help="run over Ray: Ray Data replicas for jobs, Ray Serve replicas for serve",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="the cluster to join (auto, or host:port); default: $RAY_ADDRESS, else a local Ray",
    )
    group.add_argument("--num-replicas", type=int, default=1, help="model replicas (actors)")
    group.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        help="CPUs each replica reserves; its torch threads on a CPU",
    )
    group.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="default: 1 where the cluster has GPUs and --device is not cpu, else 0",
    )
    if command == "serve":
        group.add_argument(
            "--max-ongoing-requests",
            type=int,
            default=256,
            help="requests Serve sends one replica at once (vacpack batches them)",
        )
        return
    group.add_argument("--batch-size", type=int, default=1024, help="rows per replica call")
    group.add_argument("--input-column", default=None, help="default: text, input or prompt")
    group.add_argument(
        "--output-format",
        choices=["jsonl", "parquet"],
        default=None,
        help="default: parquet when --output ends in .parquet, else jsonl",
    )


def run_ray_command(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Runs a parsed `--ray` command."""
    sampling_params = None
    if args.command == "generate":
        from vacpack.cli.generate import sampling_params_from_args

        sampling_params = sampling_params_from_args(args)
    _check_before_starting(args, sampling_params)
    if not (args.ray_address or os.environ.get("RAY_ADDRESS")):
        # A Ray started here runs its replicas on this machine: a model they cannot find is
        # reported now, as the single-process commands report it, not as replicas dying.
        from vacpack.models.hub import resolve_model_path

        resolve_model_path(args.model, engine_kwargs.get("revision"))
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'vacpack[ray]'") from None

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=args.ray_address)
    try:
        num_gpus = _gpus_per_replica(args, ray.cluster_resources())
        if args.command == "serve":
            return _serve(args, engine_kwargs, num_gpus)
        task_kwargs = (
            {"sampling_params": sampling_params}
            if args.command == "generate"
            else _corpus_task_kwargs(args)
        )
        return _run_job(args, engine_kwargs, task_kwargs, num_gpus)
    finally:
        if started_here:
            ray.shutdown()


def _check_before_starting(args: argparse.Namespace, sampling_params: Any) -> None:
    """What the flags alone say is wrong, before Ray starts (which takes seconds)."""
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if args.command == "serve":
        if getattr(args, "allow_runtime_lora_updating", False):
            # Serve's proxy sends a load or unload request to one replica: the others would
            # not have the adapter, and requests naming it would fail at random.
            raise ValueError(
                "--allow-runtime-lora-updating changes one replica only under --ray: name the "
                "adapters with --lora-modules"
            )
        return
    if not args.output:
        raise ValueError("--ray writes its results through Ray Data: give --output DIRECTORY")
    prompts = _generate_prompts(args)
    if prompts and args.input:
        raise ValueError("give --prompt or --input with --ray, not both")
    if not prompts and not args.input:
        raise ValueError("give --input FILE (or --prompt TEXT for generate)")
    if args.command == "generate":
        from vacpack.ray.actors import check_one_completion

        check_one_completion(sampling_params)


def _corpus_task_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the corpus commands' flags, as the actors take them."""
    if args.command == "embed":
        return {
            "pooling": args.pooling,
            "normalize": args.normalize,
            "truncate": args.truncate,
            "truncate_prompt_tokens": args.truncate_prompt_tokens,
            "dimensions": args.dimensions,
            "prompt": args.prompt,
            "prompt_name": args.prompt_name,
        }
    if args.command == "loglikelihood":
        return {"return_token_logprobs": args.token_logprobs, "truncate": args.truncate}
    return {"truncate": args.truncate, "truncate_prompt_tokens": args.truncate_prompt_tokens}


def _gpus_per_replica(args: argparse.Namespace, cluster: dict[str, float]) -> float:
    device = args.device
    num_gpus = args.gpus_per_replica
    if num_gpus is None:
        num_gpus = 1.0 if cluster.get("GPU", 0) > 0 and device != "cpu" else 0.0
    if device.startswith("cuda") and num_gpus == 0:
        raise ValueError(
            f"--device {device} but no GPU per replica: the Ray cluster has "
            f"{cluster.get('GPU', 0):g} GPUs; give --gpus-per-replica"
        )
    return num_gpus


def _run_job(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    task_kwargs: dict[str, Any],
    num_gpus: float,
) -> int:
    import ray

    from vacpack.ray.files import output_format, write_dataset
    from vacpack.ray.processor import (
        ProcessorConfig,
        build_processor,
        cpu_shortage_message,
        leaves_a_cpu_free,
    )

    file_format = output_format(args.output, args.output_format)
    cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
    if not leaves_a_cpu_free(args.num_replicas, args.cpus_per_replica, cluster_cpus):
        raise ValueError(
            cpu_shortage_message(args.num_replicas, args.cpus_per_replica, cluster_cpus)
        )
    config = ProcessorConfig(
        model=args.model,
        task=args.command,
        engine_kwargs=engine_kwargs,
        task_kwargs=task_kwargs,
        input_column=args.input_column,
        concurrency=args.num_replicas,
        batch_size=args.batch_size,
        num_cpus=args.cpus_per_replica,
        num_gpus=num_gpus,
    )
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    start_s = time.perf_counter()
    dataset = _input_dataset(args, args.num_replicas * BLOCKS_PER_REPLICA)
    with build_processor(config) as processor:
        write_dataset(processor(dataset), args.output, file_format)
        figures = processor.figures(time.perf_counter() - start_s)
    print(figures.summary(), file=sys.stderr)
    print(f"results: {args.output} ({file_format}, files in input order)", file=sys.stderr)
    return 0


def _input_dataset(args: argparse.Namespace, min_num_blocks: int) -> Any:
    import ray

    from vacpack.ray.files import read_dataset

    prompts = _generate_prompts(args)
    if prompts:
        return ray.data.from_items([{"prompt": prompt} for prompt in prompts])
    return read_dataset(args.input, min_num_blocks)


def _generate_prompts(args: argparse.Namespace) -> list[str]:
    """generate's --prompt texts (embed's --prompt is an instruction, not an input)."""
    return list(args.prompt or []) if args.command == "generate" else []


def _serve(args: argparse.Namespace, engine_kwargs: dict[str, Any], num_gpus: float) -> int:
    from ray import serve

    from vacpack.ray.serve import build_serve_app
    from vacpack.server.options import server_config_from_args

    config = server_config_from_args(args)
    app = build_serve_app(
        args.model,
        engine_kwargs,
        config,
        num_replicas=args.num_replicas,
        num_cpus=args.cpus_per_replica,
        num_gpus=num_gpus,
        max_ongoing_requests=args.max_ongoing_requests,
    )
    serve.start(http_options={"host": config.host, "port": config.port})
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        serve.run(app, name="vacpack", route_prefix="/")
        print(
            f"serving {config.served_model_name} on http://{config.host}:{config.port} with "
            f"{args.num_replicas} replicas on Ray Serve (Ctrl-C or SIGTERM stops)",
            file=sys.stderr,
        )
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        serve.shutdown()
    return 0
