from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_logs"

# Parsed rule files are cached (logtriage/catalog/parse_cache.py); the tests, and the commands they start, keep
# theirs in a fresh directory instead of the user's cache.
os.environ.setdefault("LOGTRIAGE_CACHE_DIR", tempfile.mkdtemp(prefix="logtriage-test-cache-"))


@pytest.fixture
def sample_dir() -> Path:
    return SAMPLES
