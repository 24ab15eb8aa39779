"""One rank's environment at start, DDP's own checks under a prefix template, and the labels scripts
put on their own lines, on real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 57th-59th batches,
each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.demux.prefixes import Dialect, strip_prefixes

from sample_roots import root_facts as _root
from sample_roots import sample_report as _report


@pytest.mark.parametrize("slug, expected", [
    # TMPDIR points at a folder never made: the FileNotFoundError is raised in tempfile's _mkstemp_inner
    ("envs_tmpdir_np6_r3_plain", ("env.tmpdir_missing", "environment", 3, 20, "FileNotFoundError")),
    # LC_ALL names a locale the system lacks, on rank 3 only
    ("envs_locale_np4_r3_plain", ("env.locale_unsupported", "environment", 3, 17, "locale.Error")),
    # a helper module's .pyc overwritten on rank 2 only: `bad magic number`
    ("envs_pyc_np6_r2_plain", ("env.stale_bytecode", "environment", 2, 8, "ImportError")),
])
def test_one_ranks_environment_at_start(slug, expected):
    assert _root(slug) == expected


@pytest.mark.parametrize("slug, rank, line", [
    ("mark_logerr_host_np4_r3_plain", 3, 17),     # `[host-a:3] ERROR step 3: ...`
    ("mark_logerr_json_np6_r4_plain", 4, 23),     # `{"rank": 4, "level": "error", "event": "..."}`
])
def test_a_scripts_own_error_record_behind_its_own_rank_label(slug, rank, line):
    assert _root(slug) == ("python.logged_error", "python_exception", rank, line, None)


@pytest.mark.parametrize("slug", ["mark_ok_angle_np4_rnone_plain", "mark_ok_pidmap_np4_rnone_tee3"])
def test_a_run_whose_ranks_say_done_in_their_own_style_is_ok(slug):
    # `<3> done`; a logging record `2026-12-03 09:09:04,595 21100 INFO train: done`
    assert _report(slug)["verdict"] == "ok"


def test_a_template_label_with_a_colon_before_torchs_own_prefix():
    # ddprule_unused_np8_r6_prefix: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${role_name}|rank=${rank}]:'
    stripped = strip_prefixes("[default|rank=6]:[rank6]: RuntimeError: Expected to have finished reduction", Dialect())
    assert (stripped.rank, stripped.text) == (6, "RuntimeError: Expected to have finished reduction")
    assert _root("ddprule_unused_np8_r6_prefix") == ("ddp.unused_parameters", "ddp_usage", 6, 32, "RuntimeError")
