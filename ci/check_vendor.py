#!/usr/bin/env python3
"""Vendor-test check (AST only: nothing is imported or executed).

DESIGN.md: `framework/` is vendor-free, and `models/` and `kernels/` get what a device
can do from the platform (its declared features, its hooks), never by asking which
device they run on. So in framework/, models/ and kernels/ this flags:

1. vendor device APIs: `torch.cuda`, `torch.xpu` (and torch's other per-vendor modules:
   mps, npu, hpu, mtia), `torch.version.cuda` / `.hip` / `.xpu`, `getattr(torch, "cuda")`,
   an import of one of them or of `torch_xla`, and any use of the name `torch_xla`;
2. device-type tests: a comparison (==, !=, in, not in, is) involving the `.type` of
   something named like a device (`x.device.type == ...`, `device.type in (...)`,
   `torch.device(d).type != ...`), and a tensor's `is_cuda` / `is_xpu` / ... flags;
3. platform-name tests: a comparison or membership test against a string literal that
   names a platform, device type, collective backend or graph runtime ("cuda", "rocm",
   "nccl", "cudagraphs", ...), `match` cases on one, `.startswith("cuda")`-style tests,
   and dict literals keyed by them (a table keyed by platform name is a switch on it).

Declaring names is fine (`platforms = frozenset({"tpu"})`, `device="cpu"`); only tests
on them are flagged. The one exception, `ASSERTS_ALLOWED_UNDER`: the conformance kit
(framework/testing/) asserts where a platform put tensors (a host copy is on the host,
outputs are on the platform's device); a comparison inside an `assert` statement there
checks the platform under test rather than branching on it.

Usage: python ci/check_vendor.py [REPO_ROOT]; exits 1 listing each violation as
path:line: message.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = ("framework", "models", "kernels")

#: Platform names, torch device types, collective backends and graph runtimes.
VENDOR_NAMES = frozenset({
    "cpu", "cuda", "rocm", "hip", "xpu", "tpu", "xla", "mps", "npu", "hpu", "mtia", "neuron",
    "nccl", "rccl", "gloo", "xccl", "ccl", "hccl", "mpi", "ucc",
    "cudagraphs", "openxla",
})
#: torch's per-vendor modules (`torch.<name>`) and `torch.version` fields.
TORCH_VENDOR_MODULES = frozenset({"cuda", "xpu", "mps", "npu", "hpu", "mtia"})
TORCH_VERSION_FIELDS = frozenset({"cuda", "hip", "xpu"})
TENSOR_DEVICE_FLAGS = frozenset({"is_cuda", "is_xpu", "is_mps", "is_xla", "is_hpu", "is_mtia", "is_cpu"})
VENDOR_SDK_NAMES = frozenset({"torch_xla"})

#: Folders (relative to the repository root) whose `assert` statements may compare
#: devices and platform names: the conformance kit checks placements, it never branches.
ASSERTS_ALLOWED_UNDER = ("framework/testing/",)


def _name_of(node: ast.AST) -> str | None:
    """The last name of an expression: `device` for `x.device`, `device` for `device`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name_of(node.func)
    return None


def _dotted(node: ast.AST) -> str | None:
    """`torch.version.cuda` for that attribute chain; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_device_type(node: ast.AST) -> bool:
    """`<something named like a device>.type`."""
    if not (isinstance(node, ast.Attribute) and node.attr == "type"):
        return False
    name = _name_of(node.value)
    return name is not None and "device" in name.lower()


def _vendor_literals(node: ast.AST) -> list[str]:
    """Vendor names among the string literals of `node` (a constant, or a tuple / list /
    set / dict literal of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in VENDOR_NAMES else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for elt in node.elts for v in _vendor_literals(elt)]
    if isinstance(node, ast.Dict):
        return [v for key in node.keys if key is not None for v in _vendor_literals(key)]
    if isinstance(node, ast.Call) and _name_of(node.func) in ("frozenset", "set", "tuple", "list") and node.args:
        return _vendor_literals(node.args[0])
    return []


class _Visitor(ast.NodeVisitor):
    def __init__(self, asserts_allowed: bool = False) -> None:
        self.problems: list[tuple[int, str]] = []
        self.asserts_allowed = asserts_allowed
        self._in_assert = False

    def _flag(self, node: ast.AST, message: str) -> None:
        self.problems.append((node.lineno, message))

    # 1. vendor device APIs
    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted is not None:
            parts = dotted.split(".")
            if parts[0] == "torch" and len(parts) >= 2 and parts[1] in TORCH_VENDOR_MODULES:
                # report the chain once, at its `torch.<vendor>` root
                if len(parts) == 2:
                    self._flag(node, f"uses torch.{parts[1]} (a vendor's device API): ask the platform")
            elif parts[:2] == ["torch", "version"] and len(parts) == 3 and parts[2] in TORCH_VERSION_FIELDS:
                self._flag(node, f"reads {dotted} (which vendor's torch build): ask the platform")
        if node.attr in TENSOR_DEVICE_FLAGS:
            self._flag(node, f"tests .{node.attr} (a device-type test): use what the platform declares")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in VENDOR_SDK_NAMES:
            self._flag(node, f"uses {node.id} (a vendor SDK)")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        self._check_module(node, module)
        if module == "torch":
            for alias in node.names:
                if alias.name in TORCH_VENDOR_MODULES:
                    self._flag(node, f"imports torch.{alias.name} (a vendor's device API)")

    def _check_module(self, node: ast.AST, module: str) -> None:
        parts = module.split(".")
        if parts[0] in VENDOR_SDK_NAMES:
            self._flag(node, f"imports {module} (a vendor SDK)")
        elif parts[0] == "torch" and len(parts) >= 2 and parts[1] in TORCH_VENDOR_MODULES:
            self._flag(node, f"imports {module} (a vendor's device API)")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2
            and _name_of(node.args[0]) == "torch" and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in TORCH_VENDOR_MODULES
        ):
            self._flag(node, f"reaches torch.{node.args[1].value} through {func.id}() (a vendor's device API)")
        if isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith"):
            names = [v for arg in node.args for v in _vendor_literals(arg)]
            if names:
                self._flag(node, f"tests a name against {sorted(set(names))} with .{func.attr}(): use what the platform declares")
        self.generic_visit(node)

    # 2. and 3. comparisons
    def visit_Assert(self, node: ast.Assert) -> None:
        self._in_assert = self.asserts_allowed
        self.generic_visit(node)
        self._in_assert = False

    def visit_Compare(self, node: ast.Compare) -> None:
        if self._in_assert:
            self.generic_visit(node)
            return
        operands = [node.left, *node.comparators]
        if any(_is_device_type(o) for o in operands):
            self._flag(node, "compares a device's .type (a device-type test): use what the platform declares")
        names = sorted({v for o in operands for v in _vendor_literals(o)})
        if names:
            self._flag(node, f"tests against platform name(s) {names}: use what the platform declares")
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        names = sorted({v for key in node.keys if key is not None for v in _vendor_literals(key)})
        if names:
            self._flag(node, f"a table keyed by platform name(s) {names}: make it something the platform declares")
        self.generic_visit(node)

    def visit_MatchValue(self, node: ast.MatchValue) -> None:
        names = _vendor_literals(node.value)
        if names:
            self._flag(node, f"matches platform name(s) {sorted(set(names))}: use what the platform declares")
        self.generic_visit(node)


def check_file(path: Path, root: Path) -> list[str]:
    rel = path.relative_to(root).as_posix()
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        return [f"{rel}:{exc.lineno}: syntax error: {exc.msg}"]
    visitor = _Visitor(asserts_allowed=rel.startswith(ASSERTS_ALLOWED_UNDER))
    visitor.visit(tree)
    return [f"{rel}:{line}: {message}" for line, message in sorted(set(visitor.problems))]


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    problems = []
    files = 0
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files += 1
            problems += check_file(path, root)
    if problems:
        print(f"vendor-test check: {len(problems)} violation(s)")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"vendor-test check: {files} files, no violations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
