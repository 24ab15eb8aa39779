"""The benchmark log generator (benchmarks/generate.py) and the runner's catalog inputs.

Small logs only (about a megabyte); no timing assertions. What is checked: the same arguments
give the same bytes, the sidecar's `line` is where the injected failure really is, the log has the
ranks, prefixes and cascade asked for, and the synthetic rules of the 10x case load cleanly and
never match a generated line.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.generate import generate_file, main  # noqa: E402
from benchmarks.harness.catalog_inputs import write_synthetic_rules  # noqa: E402
from benchmarks.harness.verify import check_report  # noqa: E402
from benchmarks.loggen.expect import sidecar_path  # noqa: E402
from benchmarks.loggen.spec import FailureKind, GenSpec, SpecError, Style, parse_size  # noqa: E402

STEP = re.compile(rb"\[rank (\d+)\] step \d+ loss ")


def _make(tmp_path: Path, name: str = "run.log", **kw) -> tuple[Path, dict, list[bytes], GenSpec]:
    defaults = dict(ranks=16, size=800_000, seed=11, failure=FailureKind.OOM, fail_at=0.5)
    spec = GenSpec(**{**defaults, **kw})
    log = tmp_path / name
    generate_file(spec, log)
    expect = tomllib.loads(sidecar_path(log).read_text(encoding="utf-8"))
    return log, expect, log.read_bytes().split(b"\n"), spec


def test_same_arguments_give_the_same_bytes_and_another_seed_does_not(tmp_path):
    a, expect_a, _, _ = _make(tmp_path, "a.log")
    b, expect_b, _, _ = _make(tmp_path, "b.log")
    c, _, _, _ = _make(tmp_path, "c.log", seed=12)
    assert a.read_bytes() == b.read_bytes()
    assert expect_a == expect_b
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("size", [300_000, 1_200_000])
def test_log_ends_within_a_few_kilobytes_of_the_size_asked(tmp_path, size):
    log, _, _, _ = _make(tmp_path, size=size)
    assert abs(log.stat().st_size - size) < 8_000


def test_oom_sidecar_names_the_line_of_the_oom_on_the_culprit_rank(tmp_path):
    log, expect, lines, spec = _make(tmp_path, fail_rank=11)
    assert (expect["verdict"], expect["category"], expect["rule"], expect["rank"]) == ("failed", "gpu_oom", "cuda.oom", 11)
    assert expect["exception_type"] == "torch.OutOfMemoryError"
    target = lines[expect["line"] - 1]
    assert target.startswith(b"[rank11]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")
    assert not any(b"CUDA out of memory" in line for line in lines[: expect["line"] - 1])
    assert lines[expect["line"] - 16].startswith(b"[rank11]: Traceback (most recent call last):")
    offset = sum(len(line) + 1 for line in lines[: expect["line"] - 1])
    assert 0.45 < offset / log.stat().st_size < 0.55  # --fail-at 0.5 on two nodes


def test_oom_cascade_has_watchdog_timeouts_on_the_other_node_and_two_childfailed_blocks(tmp_path):
    _, expect, lines, _ = _make(tmp_path, fail_rank=3)
    after = lines[expect["line"]:]
    watchdog = [l for l in after if b"ProcessGroupNCCL.cpp:632] [Rank" in l]
    assert sorted({int(re.search(rb"\[rank(\d+)\]:\[E", l).group(1)) for l in watchdog}) == list(range(8, 16))
    assert len(watchdog) == 8
    assert all(b"Watchdog caught collective operation timeout: WorkNCCL(SeqNum=" in l for l in watchdog)
    assert all(b"Timeout(ms)=600000) ran for 6000" in l for l in watchdog)
    assert sum(l == b"terminate called after throwing an instance of 'c10::DistBackendError'" for l in after) == 8
    senders = [l for l in after if re.search(rb"\] Sending process \d+ closing signal SIGTERM$", l)]
    assert len(senders) >= 7
    assert any(re.search(rb"\] failed \(exitcode: 1\) local_rank: 3 \(pid: \d+\) of binary: ", l) for l in after)
    assert sum(l == b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: " for l in after) == 2
    assert "nccl.watchdog_timeout" in expect["required_findings"]


def test_childfailed_block_layout_follows_formats_section_4(tmp_path):
    _, expect, lines, _ = _make(tmp_path, failure=FailureKind.EXCEPTION, fail_rank=5)
    start = lines.index(b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    block = lines[start + 1:]
    assert block[0] == b"=" * 60 and block[1] == b"train.py FAILED" and block[2] == b"-" * 60
    root = block.index(b"Root Cause (first observed failure):")
    assert block[root + 1] == b"[0]:"
    assert block[root + 3] == b"  host      : node-000"
    assert block[root + 4] == b"  rank      : 5 (local_rank: 5)"
    assert re.fullmatch(rb"  exitcode  : 1 \(pid: \d+\) ", block[root + 5])
    assert block[root + 7] == b"  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert block[root + 8] == b"=" * 60
    sigterm = [l for l in block[:root] if l.startswith(b"  exitcode  : ")]
    assert len(sigterm) == 7 and all(re.fullmatch(rb"  exitcode  : -15 \(pid: \d+\)  \(SIGTERM\)", l) for l in sigterm)
    assert expect["exception_type"] in {"KeyError", "ValueError", "IndexError"}
    assert lines[expect["line"] - 1].startswith(f"[rank5]: {expect['exception_type']}: ".encode())


def test_sigkill_sidecar_points_at_the_agents_exitcode_line(tmp_path):
    _, expect, lines, _ = _make(tmp_path, failure=FailureKind.SIGKILL, fail_rank=9)
    assert (expect["category"], expect["rule"], expect["rank"]) == ("crash_signal", "signal.sigkill", 9)
    assert re.search(rb"\] failed \(exitcode: -9\) local_rank: 1 \(pid: \d+\) of binary: /usr/bin/python3$",
                     lines[expect["line"] - 1])
    assert not any(b"Traceback" in l for l in lines[: expect["line"]])
    root = lines.index(b"Root Cause (first observed failure):")
    assert lines[root + 4] == b"  rank      : 9 (local_rank: 1)"
    assert re.fullmatch(rb"  exitcode  : -9 \(pid: \d+\)  \(SIGKILL\)", lines[root + 5])


def test_timeout_sidecar_points_at_the_desync_report_naming_the_hung_rank(tmp_path):
    _, expect, lines, _ = _make(tmp_path, failure=FailureKind.TIMEOUT, fail_rank=6)
    assert (expect["category"], expect["rule"], expect["rank"]) == ("collective_timeout", "nccl.watchdog_timeout", 6)
    naming = [i for i, l in enumerate(lines) if l.startswith(b"\t   - [6] finished collective #")]
    assert len(naming) == 15 and expect["line"] == naming[0] + 1
    first_watchdog = next(i for i, l in enumerate(lines) if b"Watchdog caught collective operation timeout" in l)
    assert first_watchdog == naming[0] - 3  # the report is part of that rank's watchdog message
    timed_out = {int(m.group(1)) for l in lines if (m := re.search(rb"\] \[Rank (\d+)\] Watchdog caught", l))}
    assert timed_out == set(range(16)) - {6}
    assert "nccl.desync_report" in expect["required_findings"]


def test_healthy_run_has_no_failure_and_an_ok_sidecar(tmp_path):
    _, expect, lines, _ = _make(tmp_path, failure=FailureKind.NONE)
    assert expect["verdict"] == "ok" and "rank" not in expect and expect["line"] == 0
    assert not any(b"Traceback" in l or b"ChildFailedError" in l or b"Watchdog" in l for l in lines)
    finished = {int(m.group(1)) for l in lines if (m := re.match(rb"\[rank (\d+)\] training finished", l))}
    assert finished == set(range(16))


@pytest.mark.parametrize("style", list(Style))
def test_every_rank_prints_steps_with_the_prefix_of_its_style(tmp_path, style):
    _, expect, lines, spec = _make(tmp_path, ranks=24, style=style)
    seen: set[int] = set()
    for line in lines:
        m = STEP.search(line)
        if not m or b"] step" in line[m.end():]:  # skip the rare spliced pair
            continue
        rank = int(m.group(1))
        seen.add(rank)
        prefix = line[: m.start()]
        wanted = {Style.PLAIN: b"", Style.TEE: f"[default{rank % 8}]:".encode(),
                  Style.SRUN: f"{rank // 8}: ".encode()}[style]
        assert prefix == wanted, line
    assert seen == set(range(24))
    assert spec.nodes == 3
    if style is Style.SRUN:
        unlabelled = [l for l in lines if l and not re.match(rb"[0-2]: ", l)]
        assert unlabelled and all(l.startswith(b"srun: error: node-00") for l in unlabelled)
    if style is Style.TEE:
        assert lines[expect["line"] - 1].startswith(b"[default" + str(expect["rank"] % 8).encode() + b"]:[rank")


def test_cli_writes_the_log_and_sidecar_and_rejects_bad_arguments(tmp_path, capsys):
    out = tmp_path / "cli.log"
    assert main(["--ranks", "8", "--size", "200k", "--seed", "2", "--failure", "exception", "--out", str(out)]) == 0
    assert out.exists() and (tmp_path / "cli.expect.toml").exists()
    assert main(["--ranks", "8", "--size", "200k", "--fail-rank", "8", "--out", str(out)]) == 2
    assert "--fail-rank 8" in capsys.readouterr().err
    with pytest.raises(SpecError):
        parse_size("10X")
    assert parse_size("1G") == 10**9 and parse_size("300M") == 300 * 10**6


def test_synthetic_rules_load_cleanly_and_never_match_a_generated_line(tmp_path):
    pytest.importorskip("re2")
    from logtriage.catalog.check import check_catalog
    from logtriage.catalog.loader import load_catalog
    from logtriage.catalog.matcher import Matcher

    rules = tmp_path / "rules"
    write_synthetic_rules(rules, 30)
    catalog = load_catalog([rules], include_builtin=False)
    assert len(catalog.rules) == 30
    assert check_catalog(catalog) == []
    matcher = Matcher(catalog)
    _, _, lines, _ = _make(tmp_path, size=300_000)
    assert not [l for l in lines if matcher.match(l.decode("utf-8"))]


def test_ten_times_the_catalog_compiles_into_one_matcher(tmp_path):
    """docs/performance.md's 10x-rules case: at 1,730 rules RE2's default 8 MB budget failed to
    build the pattern set (a traceback, timed as a fast run); the budget is now raised."""
    pytest.importorskip("re2")
    from logtriage.catalog.loader import load_catalog
    from logtriage.catalog.matcher import Matcher

    base = len(load_catalog([]).rules)
    rules = tmp_path / "rules"
    write_synthetic_rules(rules, base * 9)
    catalog = load_catalog([rules])
    assert len(catalog.rules) == base * 10
    matcher = Matcher(catalog)
    hits = [h.rule.id for h in matcher.match("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")]
    assert hits[0] == "cuda.oom" and not [h for h in hits if h.startswith("bench.")]


def test_report_check_compares_rule_rank_and_line(tmp_path):
    report = tmp_path / "report.json"
    expect = {"verdict": "failed", "rule": "cuda.oom", "rank": 3, "line": 120}
    report.write_text('{"verdict": "failed", "root_cause": {"rule_id": "cuda.oom", "rank": 3, "line": 120}}')
    assert check_report(report, expect).startswith("✓ cuda.oom rank 3 line 120")
    report.write_text('{"verdict": "failed", "root_cause": {"rule_id": "python.exception", "rank": 5, "line": 120}}')
    assert check_report(report, expect) == "✗ rule python.exception ≠ cuda.oom, rank 5 ≠ 3"
