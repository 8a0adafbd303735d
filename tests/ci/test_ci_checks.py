"""ci/check_imports.py and ci/check_packages.py find the violations they exist for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "ci" / script), str(root)], capture_output=True, text=True)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_the_repository_passes_both_checks():
    for script in ("check_imports.py", "check_packages.py"):
        proc = _run(script, REPO)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_violations_are_listed(tmp_path):
    _write(tmp_path, "framework/__init__.py", "")
    _write(tmp_path, "framework/bad.py", """
        import torch_xla.core.xla_model as xm
        from portaserve.platforms.cpu import platform
        from ..models import llama
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import intel_extension_for_pytorch
        try:
            import pynvml
        except ImportError:
            pynvml = None

        def lazy():
            import jax  # fine: inside a function
            from portaserve.models import registry  # never fine in framework/
        SPEC = "portaserve.platforms.cpu.attention:CpuPagedAttentionBackend"  # a string: fine
    """)
    _write(tmp_path, "models/m.py", "from portaserve.platforms.cuda import kv_cache\n")
    _write(tmp_path, "kernels/k.py", "import triton\n\ndef f():\n    from portaserve.platforms import cpu\n")
    _write(tmp_path, "platforms/x/__init__.py", "import amdsmi\n\ndef probe():\n    import amdsmi\n")
    proc = _run("check_imports.py", tmp_path)
    assert proc.returncode == 1
    out = proc.stdout
    expected = [
        "framework/bad.py:2: framework/ imports vendor SDK 'torch_xla.core.xla_model' at module level",
        "framework/bad.py:3: framework/ imports 'portaserve.platforms.cpu'",
        "framework/bad.py:4: framework/ imports 'portaserve.models'",
        "framework/bad.py:9: framework/ imports vendor SDK 'pynvml' at module level",
        "framework/bad.py:15: framework/ imports 'portaserve.models'",
        "models/m.py:1: models/ imports 'portaserve.platforms.cuda'",
        "kernels/k.py:4: kernels/ imports 'portaserve.platforms'",
        "platforms/x/__init__.py:1: platforms/ imports vendor SDK 'amdsmi' at module level",
    ]
    for line in expected:
        assert line in out, f"missing: {line}\n{out}"
    assert "intel_extension_for_pytorch" not in out and "'jax'" not in out
    assert "platforms/x/__init__.py:4" not in out and "kernels/k.py:1" not in out


def test_unlisted_and_stale_packages(tmp_path):
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "framework/__init__.py", "")
    _write(tmp_path, "framework/newpkg/__init__.py", "")
    _write(tmp_path, "pyproject.toml", """
        [tool.setuptools]
        packages = ["portaserve", "portaserve.framework", "portaserve.models"]
    """)
    proc = _run("check_packages.py", tmp_path)
    assert proc.returncode == 1
    assert "package 'portaserve.framework.newpkg' exists but is not in [tool.setuptools] packages" in proc.stdout
    assert "package 'portaserve.models' is listed but has no __init__.py" in proc.stdout


def test_ci_installs_what_the_readme_install_command_installs():
    """Every `pip install` step of the README's install-and-run command is in .ci/run
    (with the test extras on top), so CI checks the install users run."""
    import re

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Install and run"):]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S).group(1)
    steps = [s.strip() for s in command.split("&&")]
    assert steps[-1] == "portaserve serve"
    ci = (REPO / ".ci" / "run").read_text()
    for step in steps[:-1]:
        assert step.startswith("pip install "), step
        args = step.removeprefix("pip install ").replace("-e .", ".")
        if args == ".":
            assert re.search(r'pip install -q "\.\[test', ci), step  # the project, with its test extras
        else:
            assert f"pip install -q {args}" in ci, step
