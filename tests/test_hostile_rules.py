"""Rule safety: user rules run on RE2 (linear time), or, when they need look-around, on the
`regex` engine under a per-line time limit and a per-rule budget; a broken rule is named with
its file and line and the others still run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from logtriage.api import TriageOptions, get_catalog, run_triage
from logtriage.catalog.compiled import MAX_TIMEOUTS, REGEX_TIMEOUT_S
from logtriage.catalog.rule import Engine
from tests.fuzz.cli import assert_clean_exit, run_cli


def rules_dir(tmp_path: Path, **files: str) -> Path:
    folder = tmp_path / "rules"
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / f"{name}.toml").write_text(text)
    return folder


def minimal_rule(rule_id: str, pattern: str, category: str = "python_exception") -> str:
    """Only the five fields a user rule needs."""
    return (f'id = "{rule_id}"\ntitle = "{rule_id} title"\ncategory = "{category}"\n'
            f'role = "root_candidate"\npatterns = [\'{pattern}\']\n')


def _user(catalog, rule_id):
    return next(c for c in catalog.rules if c.rule.id == rule_id)


def test_nested_quantifier_rule_on_a_100kb_line_of_a_takes_seconds_not_forever(tmp_path):
    folder = rules_dir(tmp_path, nested=minimal_rule("user.nested", "(a+)+$"))
    log = tmp_path / "aaaa.log"
    log.write_text("[rank0]: step 1\n[rank1]: " + "a" * 100_000 + "\n")
    options = TriageOptions(patterns_dirs=(str(folder),))
    catalog = get_catalog(options.patterns_dirs)
    assert catalog.problems == ()
    assert _user(catalog, "user.nested").engine is Engine.RE2
    started = time.perf_counter()
    report = run_triage([str(log)], options).report
    elapsed = time.perf_counter() - started
    # RE2: linear, under a second here; a backtracking engine would not end. The bound only tells "ends" from
    # "never ends": a machine loaded by other work has taken 16 s for the whole run, start-up included
    assert elapsed < 120.0, elapsed
    hit = next(f for f in report.findings if f.rule_id == "user.nested")
    assert (hit.rank, hit.line) == (1, 2)


def test_a_rule_with_only_the_required_fields_loads_and_explains_a_failure(tmp_path):
    folder = rules_dir(tmp_path, mine=minimal_rule("user.bad_shard", r"shard (?P<rank>\d+) is empty"))
    log = tmp_path / "run.log"
    log.write_text("[rank0]: step 1\n[rank3]: ValueError: shard 3 is empty\n")
    run = run_triage([str(log)], TriageOptions(patterns_dirs=(str(folder),)))
    assert run.catalog.problems == ()
    assert run.report.root_cause.rule_id in ("user.bad_shard", "python.exception")
    assert run.report.root_cause.rule_id == "user.bad_shard"       # the user's rule explains it
    hit = next(f for f in run.report.findings if f.rule_id == "user.bad_shard")
    assert (hit.rank, hit.line, dict(hit.captures)) == (3, 2, {"rank": "3"})


def test_look_around_rule_runs_on_the_regex_engine(tmp_path):
    folder = rules_dir(tmp_path, look=minimal_rule("user.look", r"(?<=KeyError: )\Wtarget\W(?!\w)"))
    log = tmp_path / "run.log"
    log.write_text("[rank2]: Traceback (most recent call last):\n[rank2]: KeyError: 'target'\n")
    options = TriageOptions(patterns_dirs=(str(folder),))
    assert _user(get_catalog(options.patterns_dirs), "user.look").engine is Engine.REGEX
    report = run_triage([str(log)], options).report
    hit = next(f for f in report.findings if f.rule_id == "user.look")
    assert (hit.rank, hit.line) == (2, 2)


def test_catastrophic_look_around_rule_cannot_stall_a_triage(tmp_path):
    folder = rules_dir(tmp_path, bad=minimal_rule("user.catastrophic", r"^(a|a?)+(?=b)"))
    log = tmp_path / "run.log"
    with log.open("w") as out:
        for i in range(400):
            out.write(f"[rank{i % 4}]: " + "a" * 20_000 + "\n")
        out.write("[rank1]: Traceback (most recent call last):\n[rank1]: KeyError: 'k'\n")
    options = TriageOptions(patterns_dirs=(str(folder),))
    get_catalog(options.patterns_dirs)
    started = time.perf_counter()
    run = run_triage([str(log)], options)
    elapsed = time.perf_counter() - started
    # 400 lines x 50 ms would be 20 s; the budget stops the rule after MAX_TIMEOUTS lines
    assert elapsed < 5 + MAX_TIMEOUTS * REGEX_TIMEOUT_S * 4, elapsed
    assert run.report.root_cause.rank == 1
    note = next(p for p in run.report.problems if "user.catastrophic" in p)
    assert "switched off" in note and "bad.toml" in note


def test_broken_rule_names_file_and_line_and_the_rest_still_run(tmp_path):
    folder = rules_dir(
        tmp_path,
        a_broken=minimal_rule("user.broken", "(unclosed"),
        b_bad_toml='id = "user.toml"\ntitle = "t"\ncategory = "python_exception"\nrole = "root_candidate"\n'
                   'patterns = [\'x\'\n',
        c_bad_field=minimal_rule("user.field", "x", category="no_such_category"),
        d_good=minimal_rule("user.good", r"shard \d+ is empty"),
    )
    log = tmp_path / "run.log"
    log.write_text("[rank0]: ValueError: shard 0 is empty\n[rank1]: KeyError: 'k'\n")
    run = run_triage([str(log)], TriageOptions(patterns_dirs=(str(folder),)))
    problems = "\n".join(run.catalog.problems)
    assert f"{folder / 'a_broken.toml'}:5: user.broken: pattern 1 does not compile" in problems
    assert f"{folder / 'b_bad_toml.toml'}:" in problems and "invalid TOML" in problems
    assert f"{folder / 'c_bad_field.toml'}:3: 'category'" in problems
    assert any(f.rule_id == "user.good" for f in run.report.findings)
    assert any(f.rule_id == "python.exception" for f in run.report.findings)   # built-ins too

    out = run_cli(str(log), "--patterns", str(folder))
    assert_clean_exit(out)
    assert out.code == 0 and b"a_broken.toml:5" in out.stdout            # named in the report's notes
    strict = run_cli(str(log), "--patterns", str(folder), "--strict-catalog")
    assert_clean_exit(strict)
    assert strict.code == 4 and b"a_broken.toml:5" in strict.stderr and strict.stdout == b""


@pytest.mark.parametrize("pattern, loads", [
    (r"(?P<x>a)(?P<x>b)", True),      # RE2 refuses it, the time-limited `regex` engine takes it
    (r"a{100000}", True),
    (r"\p{NoSuchClass}", False),      # neither engine: a named problem, the run goes on
])
def test_odd_patterns_load_on_the_fallback_engine_or_are_named_problems(tmp_path, pattern, loads):
    folder = rules_dir(tmp_path, odd=minimal_rule("user.odd", pattern))
    log = tmp_path / "run.log"
    log.write_text("[rank0]: KeyError: 1\n")
    run = run_triage([str(log)], TriageOptions(patterns_dirs=(str(folder),)))
    assert run.report.root_cause.rank == 0
    loaded = any(c.rule.id == "user.odd" for c in run.catalog.rules)
    assert loaded or any("odd.toml" in p for p in run.catalog.problems)
    assert loaded is loads
    problems = [p for p in run.catalog.problems if "odd.toml" in p]
    assert problems == ([] if loads else [f"{folder / 'odd.toml'}:5: user.odd: pattern 1 does not compile: unknown property at position 15"])
