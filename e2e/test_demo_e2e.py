"""`tether demo` runs the whole story and exits 0 (with fewer sessions, for CI time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_demo_passes_every_step_and_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from tether.coordinator.cli import main; main()", "demo",
         "--sessions", "200"],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("tether, 4 workers", "200/200", "SIGKILL, restore onto 2", "rescale to 3",
                "episodes, restore onto 3", "20/20"):
        assert row in result.stdout
