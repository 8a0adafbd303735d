"""portaserve bench BENCHMARK: benchmarks.

Each benchmark is one `Benchmark` in `BENCHMARKS`: its name, one-line help, a function
adding its options, and the "module:function" that runs it, imported only when that
benchmark runs (so building the CLI imports no kernels, triton or vendor SDK). Adding
one (throughput, latency, serve) is one entry and one options function here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    #: "module:function" called with the parsed args; returns the exit code
    main: str


def _kernels_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="platform to time on: auto (what the engine would pick), a platform name, or NAME:LOCAL_RANK")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="activation and KV dtype (default bfloat16)"
    )
    p.add_argument("--iters", type=int, default=None, help="timed calls per kernel (default 100; 1 under the interpreter)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; 1 under the interpreter)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")


def _lazy_arguments(target: str) -> Callable[[argparse.ArgumentParser], None]:
    """Options defined next to the benchmark (imported when the CLI is built; cheap modules)."""

    def add(p: argparse.ArgumentParser) -> None:
        import importlib  # not plugins.import_object: that module loads torch, and `portaserve --help` needs none

        module, _, attr = target.partition(":")
        getattr(importlib.import_module(module), attr)(p)

    return add


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "throughput",
        "offline generation through the Python API: requests/s, output and total tokens/s",
        _lazy_arguments("portaserve.framework.bench.throughput:add_arguments"),
        "portaserve.framework.bench.throughput:main",
    ),
    Benchmark(
        "latency",
        "one batch end to end: prefill and per-step decode times, engine overhead share",
        _lazy_arguments("portaserve.framework.bench.latency:add_arguments"),
        "portaserve.framework.bench.latency:main",
    ),
    Benchmark(
        "serve",
        "load any OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency, throughput",
        _lazy_arguments("portaserve.framework.bench.serve:add_arguments"),
        "portaserve.framework.bench.serve:main",
    ),
    Benchmark(
        "kernels",
        "time each Triton kernel on the current device (GB/s and TFLOP/s against the measured copy and matmul rates); "
        "without a GPU, TRITON_INTERPRET=1 gives a smoke run on tiny shapes",
        _kernels_arguments,
        "portaserve.kernels.bench:main",
    ),
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (throughput, latency, serve, kernels)", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for bench in BENCHMARKS:
        bp = sub.add_parser(bench.name, help=bench.help, description=bench.help)
        bench.add_arguments(bp)
        bp.set_defaults(func=_runner(bench.main))

    def no_benchmark(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=no_benchmark)


def _runner(target: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from portaserve.framework.plugins import import_object

        return int(import_object(target)(args) or 0)

    return run
