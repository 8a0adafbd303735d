#!/usr/bin/env python3
"""The example plugins use portaserve's public plugin contract only (AST check: nothing
is imported or executed).

Every Python file of every example under examples/ (build/, *.egg-info and __pycache__
left out) may reach into portaserve through these modules only:

- ``portaserve.framework.hookspecs``  (hookimpl, the hooks' documentation)
- ``portaserve.framework.interfaces`` and its submodules (the ABCs, OpSpec / OpImpl)
- ``portaserve.framework.errors``
- ``portaserve.framework.testing`` and its submodules (the conformance kit)

That is what a vendor's package can rely on; anything else (the CPU platform's classes,
``portaserve.framework.distributed``, the models' layers) is core code that may change
under it. Checked at every level (function bodies and ``if TYPE_CHECKING:`` blocks too:
a plugin should not depend on core code even lazily), and in ``"module:Class"`` strings,
which the loader imports like an import statement. Relative imports inside an example's
own package are its business.

Usage: python ci/check_example_imports.py [REPO_ROOT]; exits 1 listing each violation
as path:line: message.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = "portaserve"
ALLOWED = (
    "portaserve.framework.hookspecs",
    "portaserve.framework.interfaces",
    "portaserve.framework.errors",
    "portaserve.framework.testing",
)
#: folders inside an example that are build output, not source
SKIPPED_DIRS = ("build", "dist", "__pycache__")
#: a whole string constant naming a module ("pkg.mod") or a loader target ("pkg.mod:Attr")
_TARGET = re.compile(r"^(portaserve(?:\.\w+)*)(?::[\w.]+)?$")


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def allowed(name: str) -> bool:
    """Whether importing the module (or attribute) `name` stays within the public contract."""
    return any(_under(name, prefix) for prefix in ALLOWED)


def _is_portaserve(name: str) -> bool:
    return _under(name, PACKAGE)


def _is_ancestor_of_allowed(name: str) -> bool:
    # "portaserve", "portaserve.framework": a from-import out of them names what it takes
    return any(prefix.startswith(name + ".") for prefix in ALLOWED)


def _violations(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_portaserve(alias.name) and not allowed(alias.name):
                    found.append((node.lineno, f"imports {alias.name!r}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_portaserve(node.module):
            if allowed(node.module):
                continue
            if _is_ancestor_of_allowed(node.module):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if alias.name == "*" or not allowed(name):
                        found.append((node.lineno, f"imports {name!r}"))
            else:
                found.append((node.lineno, f"imports from {node.module!r}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _TARGET.match(node.value.strip())
            if match and not allowed(match.group(1)) and match.group(1) != PACKAGE:
                found.append((node.lineno, f"names {node.value.strip()!r} (a 'module:Class' string is an import)"))
    return found


def example_files(root: Path) -> list[Path]:
    files = []
    for example in sorted(p for p in (root / "examples").iterdir() if p.is_dir()):
        for path in sorted(example.rglob("*.py")):
            rel = path.relative_to(example).parts
            if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in rel[:-1]):
                continue
            files.append(path)
    return files


def check_file(path: Path, root: Path) -> list[str]:
    rel = path.relative_to(root)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        return [f"{rel}:{exc.lineno}: syntax error: {exc.msg}"]
    return [
        f"{rel}:{line}: {what}; an example plugin may use only {', '.join(ALLOWED)}"
        for line, what in sorted(set(_violations(tree)))
    ]


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    if not (root / "examples").is_dir():
        print(f"example-imports check: no examples/ folder under {root}")
        return 1
    files = example_files(root)
    problems = [p for path in files for p in check_file(path, root)]
    if problems:
        print(f"example-imports check: {len(problems)} violation(s)")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"example-imports check: {len(files)} files, no violations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
