from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_logs"


@pytest.fixture
def sample_dir() -> Path:
    return SAMPLES
