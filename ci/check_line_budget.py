#!/usr/bin/env python3
"""Line-budget check: no Python file in the shipped code grows past BUDGET lines.

DESIGN.md: one job per file, so a newcomer reads a file whole. A file past the budget
usually holds two jobs; split it (see framework/executor/compile.py and decode_graphs.py,
weight_update.py and weight_transfer.py). Checked: every .py file under framework/,
models/, kernels/, platforms/ and examples/ (build outputs, egg-info and caches left out).

A file that is over and cannot be split now is listed in EXCEPTIONS with its own ceiling
(so it cannot keep growing) and the reason; an exception that is no longer needed (the
file is back under the budget, or gone) is reported too, so the list stays true.

Usage: python ci/check_line_budget.py [REPO_ROOT]; exits 1 listing each violation as
path: message.
"""

from __future__ import annotations

import sys
from pathlib import Path

BUDGET = 600
LAYERS = ("framework", "models", "kernels", "platforms", "examples")
SKIPPED_DIRS = frozenset({"build", "dist", "__pycache__", ".git", ".pytest_cache"})

#: path (relative to the repository root) -> (its ceiling, why it is not split yet)
EXCEPTIONS: dict[str, tuple[int, str]] = {}


def _python_files(root: Path):
    for layer in LAYERS:
        base = root / layer
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
                continue
            yield path


def _num_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def check(root: Path, exceptions: dict[str, tuple[int, str]] = EXCEPTIONS, budget: int = BUDGET) -> list[str]:
    problems = []
    seen = set()
    for path in _python_files(root):
        rel = path.relative_to(root).as_posix()
        n = _num_lines(path)
        if rel in exceptions:
            seen.add(rel)
            ceiling, _why = exceptions[rel]
            if n > ceiling:
                problems.append(f"{rel}: {n} lines, over its exception's ceiling of {ceiling}; split it")
            elif n <= budget:
                problems.append(f"{rel}: {n} lines, within the budget of {budget}: remove its exception")
        elif n > budget:
            problems.append(f"{rel}: {n} lines, over the budget of {budget}; split it by job (or list an exception)")
    for rel in sorted(set(exceptions) - seen):
        problems.append(f"{rel}: listed in EXCEPTIONS but not found: remove its exception")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    problems = check(root)
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} line-budget violation(s)", file=sys.stderr)
        return 1
    print(f"line-budget check: every file within {BUDGET} lines (or its listed exception)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
