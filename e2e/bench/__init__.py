"""Benchmarks (SPEC 11): each is one command that prints a table, writes JSON to
`e2e/bench/results/` and keeps its section of `docs/benchmarks.md` current.

Every figure is a ratio against a baseline measured in the same run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any


def machine(packages: Iterable[str]) -> dict[str, Any]:
    """What a benchmark ran on: CPUs, CPU model, Python, platform, package versions."""
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as file:
        model = next(
            (line.split(":", 1)[1].strip() for line in file if line.startswith("model name")),
            model,
        )
    versions = {}
    for package in packages:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
    }



STOP_TIMEOUT_S = 30.0


def stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL to its process group if it has not exited in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def write_generated(path: Path, name: str, heading: str, generated: str) -> None:
    """Put a benchmark's generated part (between `<!-- NAME:generated:begin` and
    `<!-- NAME:generated:end -->`) into the doc in place of the last one, or add it under
    `heading` at the end; the rest of the doc is left as it is."""
    pattern = re.compile(
        rf"<!-- {re.escape(name)}:generated:begin.*?<!-- {re.escape(name)}:generated:end -->",
        re.S,
    )
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if pattern.search(text):
        text = pattern.sub(lambda _: generated, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{generated}\n"
    path.write_text(text, encoding="utf-8")
