"""LoRA adapters named on the command line (vLLM's `--lora-modules`), for the server and
run-batch: a request's `model` picks one by name."""

from __future__ import annotations

import argparse
import json

from vacpack.lora.request import LoRARequest


def parse_lora_module(text: str) -> tuple[str, str]:
    """(name, path) from `name=path` or vLLM's JSON form {"name": ..., "path": ...}; an
    argparse type."""
    if text.lstrip().startswith("{"):
        try:
            module = json.loads(text)
            return str(module["name"]), str(module["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'a LoRA module in JSON needs "name" and "path", got {text!r}'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is name=path, got {text!r}")
    return name, path


def add_lora_modules_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve (needs --enable-lora): name=path, or vLLM's JSON "
        '{"name": ..., "path": ...}; a request whose model is the name runs the adapter',
    )


def lora_requests(
    modules: tuple[tuple[str, str], ...], served_model_name: str
) -> dict[str, LoRARequest]:
    """The adapters by name, with ids 1, 2, ... in the order given; ValueError for a name
    given twice or the served model's own."""
    names = [served_model_name, *(name for name, _ in modules)]
    if len(set(names)) < len(names):
        raise ValueError(f"the served model and LoRA module names must differ, got {names}")
    return {
        name: LoRARequest(name, index, path) for index, (name, path) in enumerate(modules, start=1)
    }
