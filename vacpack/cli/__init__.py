"""The `vacpack` command line: one subcommand per job, each in its own module here."""

from __future__ import annotations

import argparse
import sys

from vacpack import __version__
from vacpack.cli.bench import add_bench_command
from vacpack.cli.corpus import add_corpus_commands
from vacpack.cli.demo import add_demo_command
from vacpack.cli.engine_args import add_engine_args, engine_kwargs
from vacpack.cli.generate import add_generate_command
from vacpack.errors import DEBUG_ENV, debug_requested, run_reporting_errors


def cmd_serve(args: argparse.Namespace) -> int:
    from vacpack.server.launch import serve
    from vacpack.server.options import server_config_from_args

    return serve(args.model, engine_kwargs(args), server_config_from_args(args))


def cmd_run_batch(args: argparse.Namespace) -> int:
    from vacpack.batch.options import batch_options_from_args
    from vacpack.batch.runner import run_batch_command

    return run_batch_command(args.model, engine_kwargs(args), batch_options_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    from vacpack.batch.options import add_batch_args
    from vacpack.server.options import add_server_args

    parser = argparse.ArgumentParser(prog="vacpack", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vacpack {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback of an error, anywhere on the line (also {DEBUG_ENV}=1)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_command(commands)
    add_corpus_commands(commands)
    add_bench_command(commands)
    add_demo_command(commands)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve)

    run_batch = commands.add_parser("run-batch", help="answer an OpenAI batch file, resumably")
    add_engine_args(run_batch)
    add_batch_args(run_batch)
    run_batch.set_defaults(handler=cmd_run_batch)

    from vacpack.cli.ray import RAY_COMMANDS, add_ray_args

    for name in RAY_COMMANDS:
        add_ray_args(commands.choices[name], name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = debug_requested(argv)
    args = build_parser().parse_args([arg for arg in argv if arg != "--debug"])

    def run() -> int:
        if getattr(args, "ray", False):
            from vacpack.cli.ray import run_ray_command

            return run_ray_command(args, engine_kwargs(args))
        return int(args.handler(args))

    return run_reporting_errors(args.command, run, debug)


if __name__ == "__main__":
    sys.exit(main())
