"""ci/check_example_imports.py: the example plugins import only the public contract from
portaserve (hookspecs, interfaces, errors, the kit), and the check finds planted violations."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "ci" / "check_example_imports.py"), str(root)],
                          capture_output=True, text=True)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_the_repository_examples_pass():
    proc = _run(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no violations" in proc.stdout


def test_planted_violations_are_listed(tmp_path):
    _write(tmp_path, "examples/vendor-plugin/vendor/__init__.py", """
        from portaserve.framework.hookspecs import hookimpl
        from portaserve.framework.interfaces import Platform
        from portaserve.framework.interfaces.ops import OpImpl, OpSpec
        from portaserve.framework import errors, hookspecs
        import portaserve.framework.errors
        from . import attention

        @hookimpl
        def portaserve_attention_backends():
            return {"mine": "vendor.attention:Mine", "reused": "portaserve.platforms.cpu.attention:CpuPagedAttentionBackend"}
    """)
    _write(tmp_path, "examples/vendor-plugin/vendor/attention.py", """
        '''Docs may mention portaserve.framework.plan in prose.'''
        from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend
        from portaserve.framework import distributed, interfaces
        from portaserve import LLM
        import portaserve.models.llama as llama
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from portaserve.framework.layer_context import LayerContext

        def lazy():
            from portaserve.framework.plan import ExecutionPlan  # lazily is still a dependency
            import portaserve
    """)
    _write(tmp_path, "examples/vendor-plugin/tests/test_kit.py", """
        from portaserve.framework.testing.attention_checks import run_case
    """)
    # build output and packaging metadata are not source
    _write(tmp_path, "examples/vendor-plugin/build/lib/vendor/attention.py", "import portaserve.platforms.cpu\n")
    _write(tmp_path, "examples/vendor-plugin/vendor.egg-info/x.py", "import portaserve.platforms.cpu\n")
    proc = _run(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    expected = [
        "examples/vendor-plugin/vendor/__init__.py:11: names 'portaserve.platforms.cpu.attention:CpuPagedAttentionBackend'",
        "examples/vendor-plugin/vendor/attention.py:3: imports from 'portaserve.platforms.cpu.attention'",
        "examples/vendor-plugin/vendor/attention.py:4: imports 'portaserve.framework.distributed'",
        "examples/vendor-plugin/vendor/attention.py:5: imports 'portaserve.LLM'",
        "examples/vendor-plugin/vendor/attention.py:6: imports 'portaserve.models.llama'",
        "examples/vendor-plugin/vendor/attention.py:9: imports from 'portaserve.framework.layer_context'",
        "examples/vendor-plugin/vendor/attention.py:12: imports from 'portaserve.framework.plan'",
        "examples/vendor-plugin/vendor/attention.py:13: imports 'portaserve'",
    ]
    for line in expected:
        assert line in out, f"missing: {line}\n{out}"
    assert out.startswith(f"example-imports check: {len(expected)} violation(s)"), out
    # the allowed forms, prose, the example's own modules and the kit are not reported
    assert "vendor/__init__.py:2" not in out and "vendor/__init__.py:5" not in out
    assert "'portaserve.framework.interfaces'" not in out and "portaserve.framework.plan in prose" not in out
    assert "tests/test_kit.py" not in out and "build/" not in out and "egg-info" not in out
