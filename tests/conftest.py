"""Fixtures shared by unit and in-process tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A 0700 temp dir short enough for Unix socket paths (pytest's tmp_path often is not)."""
    path = Path(tempfile.mkdtemp(prefix="tt-", dir="/tmp"))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
