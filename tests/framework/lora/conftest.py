"""The LoRA tests use the server tests' harness (tests/framework/server/server_harness.py)."""

import sys
from pathlib import Path

_SERVER_TESTS = str(Path(__file__).resolve().parents[1] / "server")
if _SERVER_TESTS not in sys.path:
    sys.path.append(_SERVER_TESTS)
