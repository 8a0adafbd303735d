#!/usr/bin/env python3
"""Every package folder (a folder with __init__.py) under framework/, platforms/,
models/ and kernels/ is listed in pyproject.toml's [tool.setuptools] packages, and every
listed package exists; otherwise a regular (non-editable) install silently lacks it.

Usage: python ci/check_packages.py [REPO_ROOT]; exits 1 listing the differences.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

LAYERS = ("framework", "platforms", "models", "kernels")


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {"portaserve"} if (root / "__init__.py").exists() else set()
    for layer in LAYERS:
        for init in (root / layer).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(root)
            found.add(".".join(["portaserve", *rel.parts]))
    missing = sorted(found - listed)
    stale = sorted(p for p in listed - found if p == "portaserve" or p.split(".")[1] in LAYERS)
    if missing or stale:
        for p in missing:
            print(f"pyproject.toml: package {p!r} exists but is not in [tool.setuptools] packages")
        for p in stale:
            print(f"pyproject.toml: package {p!r} is listed but has no __init__.py")
        return 1
    print(f"package check: {len(found)} packages, all listed in pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
