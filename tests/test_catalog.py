"""The catalog: every rule valid and documented, every example behaving; user rules load strictly."""

from __future__ import annotations

import textwrap

import pytest

from logtriage.catalog.check import check_catalog
from logtriage.catalog.loader import load_catalog
from logtriage.catalog.matcher import Matcher
from logtriage.catalog.rule import Category

REQUIRED_IDS = [
    # error manual E001-E011 (aliases) and the coverage list
    "E001", "E002", "E003", "E004", "E005", "E006", "E007", "E008", "E009", "E010", "E011",
    "nccl.watchdog_timeout", "gloo.timeout", "dist.monitored_barrier", "nccl.unhandled_system_error",
    "nccl.unhandled_cuda_error", "nccl.invalid_usage", "nccl.duplicate_gpu", "nccl.bootstrap",
    "dist.collective_mismatch", "cuda.oom", "host.cpu_alloc", "host.oom_killer", "numerical.loss_nan",
    "numerical.anomaly_nan", "numerical.clip_nonfinite", "numerical.loss_scale_min", "signal.sigsegv",
    "signal.sigabrt", "signal.sigbus", "signal.sigkill", "signal.sigterm", "dist.port_in_use",
    "dist.store_connect_timeout", "cuda.invalid_device_ordinal", "ddp.unused_parameters",
    "ckpt.missing_keys", "ckpt.size_mismatch", "ckpt.weights_only", "env.libcudart_missing",
    "env.libcupti_missing", "env.cuda_home_missing", "env.pep668", "launcher.unrecognized_local_rank",
    "launcher.script_not_found", "cuda.device_side_assert", "cuda.illegal_memory_access",
    "sched.slurm_time_limit", "python.exception", "context.cuda_async_advice", "launcher.traceback_advice",
]


def test_builtin_catalog_checks_clean():
    catalog = load_catalog()
    assert check_catalog(catalog) == []
    assert len(catalog.rules) >= 90


@pytest.mark.parametrize("name", REQUIRED_IDS)
def test_coverage(name):
    assert load_catalog().get(name) is not None


def test_every_rule_is_in_the_documented_id_table():
    from pathlib import Path
    table = (Path(__file__).parents[1] / "docs" / "catalog.md").read_text(encoding="utf-8")
    table = table[table.index("| family | ids |"):]
    missing = [r.rule.id for r in load_catalog().rules if f"`{r.rule.id}`" not in table]
    assert missing == []


def test_categories_are_the_documented_list():
    assert {c.value for c in Category} == {
        "collective_timeout", "collective_error", "collective_mismatch", "gpu_oom", "host_oom", "numerical",
        "crash_signal", "python_exception", "rendezvous", "device_assignment", "ddp_usage", "checkpoint",
        "environment", "launch_usage", "cuda_runtime", "external_stop", "performance_validity", "hang", "unknown"}


def test_advice_lines_are_context_never_a_cause():
    matcher = Matcher(load_catalog())
    for line in ("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
                 "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"):
        hits = matcher.match(line)
        assert hits and hits[0].rule.role.value == "context", line


def test_user_rule_with_only_required_fields(tmp_path):
    (tmp_path / "mine.toml").write_text(textwrap.dedent("""
        id = "team.flaky_nfs"
        title = "NFS went away"
        category = "environment"
        role = "root_candidate"
        patterns = ['lustre: client evicted']
    """))
    catalog = load_catalog([tmp_path])
    assert catalog.problems == ()
    hits = Matcher(catalog).match("LustreError: lustre: client evicted by the MDS")
    assert hits[0].rule.id == "team.flaky_nfs"


def test_broken_user_rule_names_file_and_line_and_the_rest_still_run(tmp_path):
    (tmp_path / "bad.toml").write_text('id = "team.bad"\ntitle = "x"\ncategory = "environment"\n'
                                       'role = "root_candidate"\npatterns = [\n  \'(unclosed\',\n]\n')
    (tmp_path / "worse.toml").write_text('id = "team.worse"\ntitle = "x"\ncategory = "no_such_category"\n'
                                         'role = "root_candidate"\npatterns = ["x"]\n')
    catalog = load_catalog([tmp_path])
    problems = "\n".join(catalog.problems)
    assert f"{tmp_path / 'bad.toml'}:6:" in problems
    assert f"{tmp_path / 'worse.toml'}:3:" in problems and "no_such_category" in problems
    assert catalog.get("gloo.timeout") is not None


def test_lookaround_user_rule_runs_on_the_time_limited_engine(tmp_path):
    (tmp_path / "look.toml").write_text('id = "team.look"\ntitle = "x"\ncategory = "unknown"\n'
                                        'role = "root_candidate"\npatterns = [\'error(?! ignored)\']\n')
    catalog = load_catalog([tmp_path])
    assert catalog.problems == ()
    matcher = Matcher(catalog)
    assert [h.rule.id for h in matcher.match("fatal error here") if h.rule.id == "team.look"]
    assert not [h.rule.id for h in matcher.match("error ignored") if h.rule.id == "team.look"]


def test_duplicate_ids_and_unknown_fields_are_reported(tmp_path):
    for name in ("a.toml", "b.toml"):
        (tmp_path / name).write_text('id = "team.same"\ntitle = "x"\ncategory = "unknown"\nrole = "either"\n'
                                     'patterns = ["x"]\n')
    (tmp_path / "c.toml").write_text('id = "team.c"\ntitle = "x"\ncategory = "unknown"\nrole = "either"\n'
                                     'patterns = ["x"]\npatern = "typo"\n')
    problems = "\n".join(load_catalog([tmp_path]).problems)
    assert "duplicate id 'team.same'" in problems
    assert "unknown field(s): patern" in problems
