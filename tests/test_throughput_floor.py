"""A trainer's own floor on the speed it measured (public round 144: an MLPerf BERT trainer under srun asserts
`training_perf >= args.min_throughput`, task 0 fails the assert, srun cancels the step). The assertion is the
benchmark's validity gate, not a bug in the training code: performance_validity, on the rank that checked."""

from __future__ import annotations

from pathlib import Path

from logtriage.api import triage
from sample_roots import text_root

PUBLIC = Path(__file__).resolve().parent.parent / "sample_logs" / "public144"


def test_the_min_throughput_assertion_is_the_runs_validity_gate():
    (log,) = PUBLIC.glob("aitestbeds_sambanova_bert_*.log")
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == \
        ("perf.throughput_floor", "performance_validity", 0, 39)
    assert rc["text"].startswith("AssertionError: Expected throughput to be at least 560000.0")


def _root(text: str, tmp_path: Path) -> tuple:
    rc = text_root(text, tmp_path)
    return rc["rule_id"], rc["category"]


TRACEBACK = """Traceback (most recent call last):
  File "train.py", line 40, in <module>
    check(cfg)
  File "train.py", line 12, in check
    assert {cond}, msg
AssertionError: {message}
"""


def test_a_raised_floor_on_tokens_per_second_is_the_same_gate(tmp_path):
    text = TRACEBACK.replace("AssertionError", "RuntimeError").format(
        cond="tps >= floor", message="expected training tokens/s to be at least 120000 (measured 81000)")
    assert _root(text, tmp_path) == ("perf.throughput_floor", "performance_validity")


def test_an_assertion_about_anything_else_stays_an_assertion(tmp_path):
    text = TRACEBACK.format(cond="bs >= 8", message="expected the batch size to be at least 8")
    assert _root(text, tmp_path) == ("python.assertion", "python_exception")
