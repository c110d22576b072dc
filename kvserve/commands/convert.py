"""`kvserve convert`: convert a GGUF model once into the cached safetensors directory."""

from __future__ import annotations

import argparse

from kvserve.config import defaults


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "convert",
        help="convert a model (default: the built-in SmolLM2) into kvserve's cache",
        description="Prepare a model directory. GGUF files are dequantized once into "
        f"${defaults.CACHE_DIR_ENV} (default ~/.cache/kvserve); later starts take seconds.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=defaults.DEFAULT_MODEL,
        help="the default model's name, an HF model directory, or a .gguf file",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.log_config import configure_logging

    configure_logging()
    print(ensure_model_dir(args.model))
    return 0
