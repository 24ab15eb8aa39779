"""Run fault-injection scenarios under real torchrun and capture their console logs.

    triage inject list                                   scenarios, variants, expected diagnosis
    triage inject run rank_exception --variant np4       one variant
    triage inject run rank_exception --nproc 3 --fault-rank 2
    triage inject run --all --out sample_logs/cpu        every variant this machine can run
    triage inject expect sample_logs/cpu                 rewrite the .expect.toml files of
                                                         captured logs from the declarations

Each run writes <name>.log (the launcher's stdout+stderr as one stream, byte for byte),
<name>.expect.toml (the diagnosis triage must give) and <name>.provenance.json beside it;
log-dir variants also keep the torchrun --log-dir tree as <name>/. Scripts run from a neutral
folder (--workdir, default /tmp/logtriage-inject) so logs hold no user paths. GPU scenarios
are skipped with a reason where CUDA is missing. Exit 1 when a run timed out or did not show
its declared exit code and key message.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from logtriage.errors import UsageError
from logtriage.inject import registry
from logtriage.inject.model import Backend
from logtriage.inject.runner import RunPlan, RunResult, RunStatus, execute
from logtriage.inject.sidecars import expect_toml, write_sidecars
from logtriage.inject.workspace import DEFAULT_ROOT, WorkspaceLock, prepare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="list scenarios, variants and expected diagnoses")
    listing.add_argument("--json", action="store_true", help="one JSON object per variant")
    run = actions.add_parser("run", help="run scenarios and capture their logs")
    run.add_argument("name", nargs="?", help="scenario name (all its variants unless --variant)")
    run.add_argument("--all", action="store_true", help="every declared scenario and variant")
    run.add_argument("--variant", help="one variant of NAME")
    run.add_argument("--nproc", type=int, help="override the number of ranks")
    run.add_argument("--fault-rank", type=int, help="override the rank the fault is injected on")
    run.add_argument("--backend", choices=[b.value for b in Backend])
    run.add_argument("--out", type=Path, default=Path("inject-logs"), help="output folder")
    run.add_argument("--workdir", type=Path, default=DEFAULT_ROOT,
                     help="neutral folder the scripts run from (default %(default)s)")
    run.add_argument("--timeout", type=float, help="safety timeout per run, seconds")
    expect = actions.add_parser("expect", help="rewrite expectation files from the declarations")
    expect.add_argument("folder", type=Path, help="a folder of captured logs with provenance")


def _plans(args: argparse.Namespace) -> list[RunPlan]:
    backend = Backend(args.backend) if args.backend else None
    if args.all:
        if args.name or args.variant:
            raise UsageError("give either NAME or --all")
        return registry.all_plans(backend)
    if not args.name:
        raise UsageError("name a scenario (see `triage inject list`) or pass --all")
    scenario = registry.get_scenario(args.name)
    if args.variant:
        variant = scenario.variant(args.variant)
        if variant is None:
            known = ", ".join(v.name for v in scenario.variants)
            raise UsageError(f"{scenario.name} has no variant {args.variant!r}; known: {known}")
        variants = [variant]
    else:
        variants = list(scenario.variants)
    return [registry.make_plan(scenario, v, backend, args.nproc, args.fault_rank)
            for v in variants]


def _describe(plan: RunPlan) -> dict[str, object]:
    return {"name": plan.name, "scenario": plan.scenario.name, "variant": plan.variant.name,
            "backend": plan.backend.value, "nproc": plan.nproc,
            "fault_rank": plan.fault_rank if plan.scenario.fault_on_rank else None,
            "requires_cuda": plan.scenario.requires_cuda, "exit_code": plan.exit_code,
            "code_bugs": [b.value for b in plan.scenario.code_bugs],
            "expect": plan.expectation.to_dict()}


def _list(args: argparse.Namespace) -> int:
    plans = registry.all_plans()
    if args.json:
        for plan in plans:
            print(json.dumps(_describe(plan), ensure_ascii=False))
        return 0
    for scenario in registry.all_scenarios():
        gpu = "  [CUDA]" if scenario.requires_cuda else ""
        print(f"{scenario.name}{gpu}: {scenario.description}")
        for plan in (p for p in plans if p.scenario is scenario):
            expect = plan.expectation
            rank = "-" if expect.rank is None else str(expect.rank)
            print(f"  {plan.variant.name:<32} np{plan.nproc}  {expect.verdict:<6} "
                  f"{expect.category or '-':<19} {expect.rule or '-':<28} rank {rank}")
    return 0


def _report(result: RunResult) -> str:
    plan = result.plan
    if result.status is RunStatus.SKIPPED:
        return f"SKIP {plan.name}: {result.reason}"
    problems = []
    if result.status is RunStatus.TIMED_OUT:
        problems.append(result.reason)
    if result.exit_code != plan.exit_code:
        problems.append(f"exit {result.exit_code}, declared {plan.exit_code}")
    if not result.evidence_found:
        problems.append(f"key message {plan.evidence!r} missing")
    mark = "ok  " if not problems else "BAD "
    detail = "; ".join(problems) or f"exit {result.exit_code}"
    return f"{mark}{plan.name}  {result.duration_s:.1f} s  {detail}"


def _run(args: argparse.Namespace) -> int:
    plans = _plans(args)
    machine = registry.Machine.detect()
    failures = 0
    with WorkspaceLock(args.workdir):
        workspace = prepare(args.workdir)
        if not workspace.neutral:
            print("triage inject: could not build the neutral venv; logs will contain the "
                  "interpreter's paths", file=sys.stderr)
        for plan in plans:
            if args.timeout:
                plan = replace(plan, timeout_s=args.timeout)
            reason = registry.skip_reason(plan, machine)
            if reason:
                print(_report(RunResult(plan, RunStatus.SKIPPED, reason=reason)), flush=True)
                continue
            result = execute(plan, workspace, args.out)
            write_sidecars(result)
            failures += not result.as_expected
            print(_report(result), flush=True)
    return 1 if failures else 0


def _expect(args: argparse.Namespace) -> int:
    """Re-derive each captured log's expectation (after a declaration or catalog change)."""
    records = sorted(args.folder.glob("*.provenance.json"))
    written = 0
    for path in records:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("source") != "triage inject":
            continue
        scenario = registry.get_scenario(record["scenario"])
        variant = scenario.variant(record["variant"])
        if variant is None:
            raise UsageError(f"{path}: {scenario.name} has no variant {record['variant']!r}")
        plan = registry.make_plan(scenario, variant, Backend(record["backend"]),
                                  record["world_size"], record.get("fault_rank"))
        stem = path.name[: -len(".provenance.json")]
        target = path.with_name(stem + ".expect.toml")
        target.write_text(expect_toml(plan.expectation, scenario.name), encoding="utf-8")
        written += 1
    print(f"{written} expectation files written in {args.folder}")
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {"list": _list, "run": _run, "expect": _expect}
    return actions[args.action](args)
