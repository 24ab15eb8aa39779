"""Coverage-guided fuzzing of the whole pipeline with atheris (libFuzzer), outside the default test
run. The same invariants as the property tests: no exception, lines conserved, JSON valid, text
and Markdown free of control characters.

    pip install -e ".[fuzz]"
    python tests/fuzz/atheris_triage.py -runs=20000 -max_len=4096 tests/data/hostile/
    python tests/fuzz/atheris_triage.py -max_total_time=300 -max_len=4096 /tmp/corpus tests/data/hostile/

A crash leaves `crash-<sha1>` in the working directory: reduce it, add it to tests/data/hostile/
(test_fuzz_pipeline.py replays every file there) and fix the bug."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["logtriage"]):
    from logtriage.api import TriageOptions
    from tests.fuzz.invariants import triage_bytes

WORKDIR = Path(tempfile.mkdtemp(prefix="logtriage-atheris-"))
OPTIONS = TriageOptions(engine="exact") if "engine" in TriageOptions.__dataclass_fields__ else TriageOptions()


def one_input(data: bytes) -> None:
    triage_bytes(data, WORKDIR, "atheris.log", OPTIONS)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
