"""ci/check_vendor.py: every kind of vendor test planted in a tree is listed, what is only a
declaration passes, and the repository itself passes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "ci" / "check_vendor.py"), str(root)], capture_output=True, text=True)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))


def test_the_repository_passes():
    proc = _run(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_planted_violations_are_listed(tmp_path):
    _write(tmp_path, "framework/bad.py", """
        import torch
        from torch import cuda

        def f(x, device, name, other):
            torch.cuda.synchronize()
            props = torch.xpu.get_device_properties(device)
            import torch_xla.core.xla_model as xm
            if x.device.type == "cpu":
                pass
            if device.type in ("cuda", "xpu"):
                pass
            if name == "nccl":
                pass
            if name in {"rocm", "hip"}:
                pass
            if torch.version.cuda is not None:
                pass
            backend = getattr(torch, "xpu", None)
            if x.is_cuda:
                pass
            match name:
                case "tpu":
                    pass
            if name.startswith("cuda"):
                pass
            if x.device.type != other.device.type:
                pass
            assert device.type == "cpu"  # outside the kit an assert is no excuse
            if "cudagraphs" == name:
                pass

        RESOURCES = {"cuda": "GPU", "rocm": "GPU"}
    """)
    _write(tmp_path, "framework/testing/kit.py", """
        def check(saved, device):
            assert saved.device.type == "cpu", "the kit may assert placements"
            if device.type == "cuda":  # but not branch on them
                pass
    """)
    _write(tmp_path, "models/m.py", """
        def pick(dev):
            return 1 if str(dev) == "xpu" else 0
    """)
    _write(tmp_path, "kernels/k.py", """
        import torch

        def units(d):
            return torch.cuda.get_device_properties(d).multi_processor_count
    """)
    proc = _run(tmp_path)
    assert proc.returncode == 1
    out = proc.stdout
    expected = [
        "framework/bad.py:2: imports torch.cuda",
        "framework/bad.py:5: uses torch.cuda",
        "framework/bad.py:6: uses torch.xpu",
        "framework/bad.py:7: imports torch_xla.core.xla_model",
        "framework/bad.py:8: compares a device's .type",
        "framework/bad.py:8: tests against platform name(s) ['cpu']",
        "framework/bad.py:10: compares a device's .type",
        "framework/bad.py:10: tests against platform name(s) ['cuda', 'xpu']",
        "framework/bad.py:12: tests against platform name(s) ['nccl']",
        "framework/bad.py:14: tests against platform name(s) ['hip', 'rocm']",
        "framework/bad.py:16: reads torch.version.cuda",
        "framework/bad.py:18: reaches torch.xpu through getattr()",
        "framework/bad.py:19: tests .is_cuda",
        "framework/bad.py:22: matches platform name(s) ['tpu']",
        "framework/bad.py:24: tests a name against ['cuda'] with .startswith()",
        "framework/bad.py:26: compares a device's .type",
        "framework/bad.py:28: compares a device's .type",
        "framework/bad.py:29: tests against platform name(s) ['cudagraphs']",
        "framework/bad.py:32: a table keyed by platform name(s) ['cuda', 'rocm']",
        "framework/testing/kit.py:3: compares a device's .type",
        "models/m.py:2: tests against platform name(s) ['xpu']",
        "kernels/k.py:4: uses torch.cuda",
    ]
    for line in expected:
        assert line in out, f"missing: {line}\n{out}"
    assert "framework/testing/kit.py:2" not in out
    # nothing else: the expected lines plus the kit's name test and bad.py:28's literal
    assert "vendor-test check: 24 violation(s)" in out, out


def test_declarations_and_other_layers_pass(tmp_path):
    _write(tmp_path, "framework/ok.py", """
        import torch

        class Backend:
            platforms = frozenset({"tpu"})  # declaring where it runs is not a test

        def f(x, bundle, part):
            host = x.to("cpu")
            dev = torch.device("cpu")
            reserves_cpu = "CPU" in bundle  # a Ray resource name, not a platform
            is_text = part.type == "text"  # not a device's type
            return host, dev, reserves_cpu, is_text
    """)
    _write(tmp_path, "platforms/x/platform.py", """
        import torch

        def f(device):
            return torch.cuda.is_available() and device.type == "cuda"  # platforms are vendor code
    """)
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
