"""How long the fuzzers may run. CI uses the defaults (all fuzz tests together well under three
minutes on two cores); `LOGTRIAGE_FUZZ_SCALE=50 python -m pytest tests/test_fuzz*.py` digs deeper.
Every fuzz test counts the inputs it tried in TRIED; `report_tried` prints them per module."""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("LOGTRIAGE_FUZZ_SCALE", "1"))
TRIED: Counter[str] = Counter()


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def report_tried(request, prefix: str) -> None:
    """Write `fuzz: <test> tried N inputs` lines for this module's tests to the terminal."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    lines = [f"fuzz: {name} tried {count} inputs" for name, count in sorted(TRIED.items())
             if name.startswith(prefix)]
    if reporter is None or capture is None or not lines:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)
