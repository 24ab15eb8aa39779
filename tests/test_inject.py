"""The fault-injection registry, run plans, sidecars and the committed corpus (fast: no runs)."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from logtriage.cli import main
from logtriage.errors import UsageError
from logtriage.inject import registry
from logtriage.inject.model import Backend, Launcher, RankRef, Verdict
from logtriage.inject.runner import RunResult, RunStatus
from logtriage.inject.sidecars import expect_toml, provenance
from logtriage.inject.workspace import Workspace
from tests.conftest import ROOT, SAMPLES

CORPUS = SAMPLES / "cpu"
CATALOG_DOC = (ROOT / "docs" / "catalog.md").read_text(encoding="utf-8")
SCENARIOS = registry.all_scenarios()
PLANS = registry.all_plans()
CPU_PLANS = [p for p in PLANS if not p.scenario.requires_cuda]


def _doc_categories() -> set[str]:
    block = CATALOG_DOC.split("## Categories", 1)[1].split("`", 2)[1]
    return {name.strip() for name in block.split(",")}


def _doc_rule_ids() -> set[str]:
    table = CATALOG_DOC.split("## Rule ids", 1)[1]
    return set(re.findall(r"`([a-z]+\.[a-z0-9_]+)`", table))


def test_registry_is_large_and_names_are_unique():
    names = [p.name for p in PLANS]
    assert len(names) == len(set(names))
    assert len(CPU_PLANS) >= 60
    assert {s.name for s in SCENARIOS} >= {
        "healthy", "rank_exception", "all_ranks_nameerror", "rank_sigkill", "rank_sigsegv",
        "skip_collective", "collective_mismatch", "nan_injection", "host_oom", "ckpt_load",
        "ckpt_no_barrier", "port_in_use", "ddp_unused_params", "rank0_collective",
        "watchdog_stuck_rank", "loader_worker_crash", "cuda_on_cpu", "max_restarts",
        "cuda_oom", "nccl_watchdog_timeout", "duplicate_gpu", "invalid_device_ordinal",
        "device_side_assert", "amp_nan"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenario_script_exists_and_compiles(scenario):
    path = registry.script_path(scenario)
    assert path.is_file(), path
    compile(path.read_text(encoding="utf-8"), str(path), "exec")
    assert scenario.description and scenario.variants


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_expectation_uses_catalog_categories_and_ids(plan):
    expect = plan.expectation
    if expect.verdict == Verdict.OK.value:
        assert not expect.category and not expect.rule and expect.rank is None
        return
    assert expect.category in _doc_categories()
    assert expect.rule in _doc_rule_ids(), f"{expect.rule} is not in docs/catalog.md"
    for rule_id in (*expect.required_findings, *expect.forbidden_findings):
        assert rule_id in _doc_rule_ids(), rule_id
    assert expect.note and "{" not in expect.note
    if expect.rank is not None:
        assert 0 <= expect.rank < plan.nproc
    assert plan.evidence, "every failing variant names the message its log must contain"


def test_fault_ranks_vary_and_stay_off_rank_zero_where_rank_specific():
    specific = [p for p in CPU_PLANS if p.scenario.fault_on_rank]
    assert {p.fault_rank for p in specific} >= {1, 2, 3}
    assert all(p.fault_rank != 0 for p in specific if p.nproc > 1)


def test_plan_resolves_ranks_from_the_run():
    exception = registry.get_scenario("rank_exception")
    plan = registry.make_plan(exception, exception.variant("np4"))
    assert (plan.nproc, plan.fault_rank, plan.expectation.rank) == (4, 2, 2)
    moved = registry.make_plan(exception, exception.variant("np2"), nproc=3, fault_rank=2)
    assert moved.expectation.rank == 2 and "rank 2 raises KeyError" in moved.expectation.note
    everyone = registry.get_scenario("all_ranks_nameerror")
    plan = registry.make_plan(everyone, everyone.variant("np4"))
    assert plan.expectation.rank == 0 and plan.expectation.ranks == (0, 1, 2, 3)
    port = registry.get_scenario("port_in_use")
    assert registry.make_plan(port, port.variants[0]).expectation.rank is None


def test_plan_rejects_bad_overrides():
    exception = registry.get_scenario("rank_exception")
    with pytest.raises(UsageError, match="outside"):
        registry.make_plan(exception, exception.variants[0], nproc=2, fault_rank=5)
    nan = registry.get_scenario("nan_injection")
    with pytest.raises(UsageError, match="does not run on nccl"):
        registry.make_plan(nan, nan.variants[0], backend=Backend.NCCL)
    with pytest.raises(UsageError, match="unknown scenario"):
        registry.get_scenario("no_such_fault")


def _workspace() -> Workspace:
    root = Path("/tmp/ws")
    return Workspace(root, root / ".venv/bin/python", root / ".venv/bin/torchrun", neutral=True)


def test_commands_per_launcher():
    ws = _workspace()
    exception = registry.get_scenario("rank_exception")
    torchrun = registry.make_plan(exception, exception.variant("tee3")).command(ws, 29999)
    assert ws.display(" ".join(torchrun)) == (
        "torchrun --nnodes 1 --nproc-per-node 2 --master-port 29999 --tee 3 "
        "scenarios/rank_exception.py --fault-rank 1")
    spawn = registry.make_plan(exception, exception.variant("mp_spawn")).command(ws, 29999)
    assert ws.display(" ".join(spawn)).endswith("scenarios/rank_exception.py --fault-rank 1 "
                                                 "--spawn 2")
    legacy = registry.make_plan(exception, exception.variant("legacy_launch")).command(ws, 1)
    assert legacy[1:3] == ["-m", "torch.distributed.launch"]
    logdir = registry.make_plan(exception, exception.variant("tee3_logdir_record"))
    assert "--log-dir" in logdir.command(ws, 1) and logdir.variant.log_dir
    mpirun = registry.make_plan(exception, exception.variant("mpirun_tag_output")).command(ws, 29999)
    assert os.path.basename(mpirun[0]) == "mpirun" and mpirun[1:5] == ["--tag-output", "--oversubscribe", "-np", "2"]
    assert "MASTER_PORT=29999" in mpirun and ws.display(" ".join(mpirun[mpirun.index("-x") + 4:])) == (
        "python scenarios/rank_exception.py --fault-rank 1")
    healthy = registry.get_scenario("healthy")
    standalone = registry.make_plan(healthy, healthy.variant("standalone")).command(ws, 1)
    assert "--master-port" not in standalone and "--standalone" in standalone
    assert "--fault-rank" not in standalone


def test_srun_and_pdsh_launches_start_one_process_per_task_or_node():
    from logtriage.inject.fanout import srun_label
    ws = _workspace()
    exception = registry.get_scenario("rank_exception")
    tasks = registry.make_plan(exception, exception.variant("srun_label_tasks")).tasks(ws, 29999)
    assert [t.label for t in tasks] == [b"0: ", b"1: ", b"2: ", b"3: "]
    assert dict(tasks[2].env)["SLURM_PROCID"] == "2" and dict(tasks[2].env)["SLURM_NTASKS"] == "4"
    assert ws.display(" ".join(tasks[2].argv)) == "python scenarios/rank_exception.py --fault-rank 2"
    nodes = registry.make_plan(exception, exception.variant("pdsh_nodes_tee3")).tasks(ws, 29999)
    assert [t.label for t in nodes] == [b"worker-0: ", b"worker-1: "]
    assert ws.display(" ".join(nodes[1].argv)) == (
        "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29999 "
        "--tee 3 scenarios/rank_exception.py --fault-rank 2")
    assert srun_label(3, 16) == b" 3: " and srun_label(12, 16) == b"12: "   # Slurm's `%*d: `
    # each launcher's notice of a failed task, in its wording (the sample logs' srun and pdsh lines)
    assert tasks[2].notice(1) == b"srun: error: node01: task 2: Exited with exit code 1\n"
    assert tasks[2].notice(-11) == b"srun: error: node01: task 2: Segmentation fault\n"
    assert nodes[1].notice(1) == b"pdsh@worker-0: worker-1: ssh exited with exit code 1\n"
    assert nodes[1].notice(-9) == b"pdsh@worker-0: worker-1: ssh exited with exit code 137\n"
    srun_nodes = registry.make_plan(exception, exception.variant("srun_label_nodes_tee3")).tasks(ws, 29999)
    assert srun_nodes[1].notice(1) == b"srun: error: node02: task 1: Exited with exit code 1\n"
    assert registry.make_plan(exception, exception.variant("tee3")).tasks(ws, 1) is None


def test_skip_reasons_for_gpu_and_missing_modules():
    oom = registry.get_scenario("cuda_oom")
    np2 = registry.make_plan(oom, oom.variant("np2"))
    assert "needs CUDA" in registry.skip_reason(np2, registry.Machine(0))
    assert registry.skip_reason(np2, registry.Machine(1)) == "needs 2 GPUs; 1 visible"
    assert registry.skip_reason(registry.make_plan(oom, oom.variant("np1")),
                                registry.Machine(1)) == ""
    duplicate = registry.get_scenario("duplicate_gpu")
    assert registry.skip_reason(registry.make_plan(duplicate, duplicate.variants[0]),
                                registry.Machine(1)) == ""
    nccl = registry.make_plan(registry.get_scenario("rank_exception"),
                              registry.get_scenario("rank_exception").variant("np2"),
                              backend=Backend.NCCL)
    assert "needs CUDA" in registry.skip_reason(nccl, registry.Machine(0))


def test_mpirun_variant_is_skipped_without_mpirun(monkeypatch):
    exception = registry.get_scenario("rank_exception")
    plan = registry.make_plan(exception, exception.variant("mpirun_tag_output"))
    monkeypatch.setattr(registry, "find_program", lambda name: None)
    assert "needs the program 'mpirun'" in registry.skip_reason(plan, registry.Machine(0))


def test_expect_toml_round_trips():
    everyone = registry.get_scenario("all_ranks_nameerror")
    plan = registry.make_plan(everyone, everyone.variant("np4"))
    text = expect_toml(plan.expectation, everyone.name)
    assert text.startswith("# Written by `triage inject`")
    assert tomllib.loads(text) == plan.expectation.to_dict()
    assert tomllib.loads(text)["ranks"] == [0, 1, 2, 3]


def test_provenance_has_no_machine_paths():
    ws = _workspace()
    exception = registry.get_scenario("rank_exception")
    plan = registry.make_plan(exception, exception.variant("loglevel_info"))
    argv = plan.command(ws, 29500)
    result = RunResult(plan, RunStatus.CAPTURED, ws.root / "x.log",
                       command="LOGLEVEL=INFO " + ws.display(" ".join(argv)),
                       exit_code=1, duration_s=5.0, evidence_found=True)
    record = provenance(result)
    assert record["command"].startswith("LOGLEVEL=INFO torchrun --nnodes 1")
    assert record["env"] == {"LOGLEVEL": "INFO"} and record["fault_rank"] == 1
    assert "/tmp/ws" not in json.dumps(record)


def test_list_cli_prints_every_variant(capsys):
    assert main(["inject", "list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["name"] for row in rows] == [p.name for p in PLANS]
    assert main(["inject", "run", "rank_exception", "--variant", "nope"]) == 2
    assert main(["inject", "run"]) == 2


# The committed corpus: every runnable variant captured, sidecars in sync with the declarations.

CAPTURED = sorted(CORPUS.glob("*.provenance.json"))


def test_every_cpu_variant_was_captured():
    captured = {p.name[: -len(".provenance.json")] for p in CAPTURED}
    assert {p.name for p in CPU_PLANS} <= captured
    assert captured <= {p.name for p in PLANS}, "a captured log whose variant was removed"


@pytest.mark.parametrize("path", CAPTURED, ids=lambda p: p.name[: -len(".provenance.json")])
def test_captured_log_matches_its_declaration(path):
    record = json.loads(path.read_text(encoding="utf-8"))
    stem = path.name[: -len(".provenance.json")]
    scenario = registry.get_scenario(record["scenario"])
    variant = scenario.variant(record["variant"])
    plan = registry.make_plan(scenario, variant, Backend(record["backend"]),
                              record["world_size"], record["fault_rank"])
    assert record["source"] == "triage inject" and plan.name == stem
    log = (CORPUS / f"{stem}.log").read_bytes()
    assert record["exit_code"] == plan.exit_code and not record["timed_out"]
    assert plan.evidence.encode() in log
    expect = (CORPUS / f"{stem}.expect.toml").read_text(encoding="utf-8")
    assert expect == expect_toml(plan.expectation, scenario.name), \
        "stale expectation: run `triage inject expect sample_logs/cpu`"
    for leak in (b"/home/", b"/root", b"/Users/", str(ROOT).encode()):
        assert leak not in log, leak
    assert "/" not in record["command"].split(" scenarios/")[0].replace("torch.distributed", "")
    if variant.launcher is Launcher.TORCHRUN and plan.exit_code == 1 and variant.master_port \
            and not variant.occupy_master_port:
        assert b"ChildFailedError" in log


def test_log_dir_variant_keeps_the_per_rank_tree():
    tree = CORPUS / "rank_exception__tee3_logdir_record"
    files = {p.relative_to(tree).parts[1:] for p in tree.rglob("*") if p.is_file()}
    assert ("attempt_0", "1", "error.json") in files
    assert ("attempt_0", "1", "stderr.log") in files
    error = next(tree.rglob("attempt_0/1/error.json")).read_text(encoding="utf-8")
    assert "KeyError" in error


def test_expectation_conventions():
    by_name = {p.name: p.expectation for p in PLANS}
    assert by_name["nan_injection__loss_nan_np3"].rank == 2
    assert by_name["nan_injection__loss_nan_np3"].verdict == "failed"
    assert by_name["skip_collective__np3"].rank == 2
    assert by_name["rank0_collective__others_exit_np2"].rank == 0
    assert by_name["rank_exception__local_ranks_filter0"].rule == "signal.exit_nonzero"
    assert by_name["rank_exception__local_ranks_filter0"].category == "unknown"
    assert by_name["rank_exception__tee3_local_ranks_filter0"].rule == "python.exit_one_output_elsewhere"
    assert by_name["loader_worker_crash__sigkill_np2"].category == "crash_signal"
    assert registry.get_scenario("rank0_collective").expect.rank is RankRef.LOWEST
