"""The `portaserve` command. Each subcommand lives in its own module of this package,
which exposes `add_parser(subparsers)`; `main` only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module in this package
SUBCOMMANDS = {
    "serve": "serve",
    "platforms": "platforms",
    "make-checkpoint": "make_checkpoint",
    "chat": "client",
    "complete": "client",
    "bench": "bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portaserve",
        description="LLM inference and serving on any accelerator, through platform plugins.",
    )
    from portaserve import __version__

    parser.add_argument("--version", action="version", version=f"portaserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    added: set[str] = set()
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            module = importlib.import_module(f"{__name__}.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{module_name}":
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
        added.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as exc:
        from portaserve.framework.errors import PortaserveError

        if isinstance(exc, PortaserveError):
            print(f"portaserve: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
