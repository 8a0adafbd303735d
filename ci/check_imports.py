#!/usr/bin/env python3
"""Import-direction check (AST only: nothing is imported or executed).

Rules (DESIGN.md, "Layout"):
1. framework/ imports no vendor SDK at module level (inside a function is how a probe
   or a component reaches one) and nothing from portaserve.platforms or
   portaserve.models at any level; a lazy "module:Class" string is fine.
2. models/ and kernels/ never import portaserve.platforms, and no vendor SDK at module level.
3. platforms/ import no vendor SDK at module level (probes import them inside the probe).

Module level means executed on import: top level, class bodies, if/try blocks; not
function bodies, and not ``if TYPE_CHECKING:`` blocks.

Usage: python ci/check_imports.py [REPO_ROOT]; exits 1 listing each violation as
path:line: message.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

VENDOR_SDKS = frozenset({
    "torch_xla", "libtpu", "jax", "jaxlib",
    "intel_extension_for_pytorch", "oneccl_bindings_for_pytorch", "dpctl",
    "pynvml", "nvidia_smi", "cuda", "cupy", "pycuda", "tensorrt", "apex",
    "amdsmi", "pyrsmi", "hip",
    "torch_npu", "habana_frameworks", "neuronxcc", "torch_neuronx",
})
PACKAGE = "portaserve"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """(node, module name or None, names, module_level) for every import statement."""

    def visit(node: ast.AST, module_level: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), module_level)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            else:
                yield from visit(child, module_level)

    yield from visit(tree, True)


def _absolute(node: ast.ImportFrom | ast.Import, package: str) -> list[str]:
    """Absolute dotted names an import statement brings in."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        base = ".".join(parts + ([node.module] if node.module else []))
    # `from portaserve import platforms` imports the subpackage too
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def _package_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    else:
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def check_file(path: Path, root: Path) -> list[str]:
    layer = path.relative_to(root).parts[0]
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        return [f"{path.relative_to(root)}:{exc.lineno}: syntax error: {exc.msg}"]
    package = _package_of(path, root)
    problems = []
    for node, module_level in _imports(tree):
        for name in _absolute(node, package):
            top = name.split(".")[0]
            where = f"{path.relative_to(root)}:{node.lineno}"
            if top in VENDOR_SDKS and module_level:
                problems.append(f"{where}: {layer}/ imports vendor SDK {name!r} at module level (import it inside the function that needs it)")
            if layer == "framework":
                for banned in (f"{PACKAGE}.platforms", f"{PACKAGE}.models"):
                    if _under(name, banned):
                        problems.append(f"{where}: framework/ imports {name!r}; the core must not depend on {banned} (register through a hook, or use a 'module:Class' string)")
            if layer in ("models", "kernels") and _under(name, f"{PACKAGE}.platforms"):
                problems.append(f"{where}: {layer}/ imports {name!r}; get backends and ops from the LayerContext instead")
    return sorted(set(problems))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    problems = []
    files = 0
    for layer in ("framework", "platforms", "models", "kernels"):
        for path in sorted((root / layer).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files += 1
            problems += check_file(path, root)
    if problems:
        print(f"import-direction check: {len(problems)} violation(s)")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"import-direction check: {files} files, no violations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
