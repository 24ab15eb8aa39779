"""Launch-script and job-template rules (shell, Slurm, Kubernetes/YAML): LNC401, LNC402.

A template is judged only when it launches distributed training (torchrun, torch.distributed.run or
launch, deepspeed, accelerate launch, colossalai run, srun/mpirun of python, a Kubeflow PyTorchJob),
and only when its environment is all in the file: one that sources an env file or uses `envFrom:`
may set the variables elsewhere, so it is not judged (precision over recall).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from logtriage.lint.model import FileKind, Hit, LintRule, RuleDocs, Severity

LAUNCH = re.compile(
    r"\btorchrun\b|torch\.distributed\.(?:run|launch)\b|\bdeepspeed\s+[\w./-]|\baccelerate\s+launch\b"
    r"|\bcolossalai\s+run\b|\b(?:srun|mpirun|mpiexec)\b.*\bpython[\d.]*\b|kind:\s*[\"']?PyTorchJob\b")
# torchrun (torch.distributed.run/launch, and accelerate launch / colossalai run on top of it) sets
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1 for its workers when it is unset (local_elastic_agent.py).
ELASTIC_LAUNCH = re.compile(r"\btorchrun\b|torch\.distributed\.(?:run|launch)\b|\baccelerate\s+launch\b"
                            r"|\bcolossalai\s+run\b")
ENV_ELSEWHERE = re.compile(r"^\s*(?:source|\.)\s+\S*env\S*|\benvFrom\s*:|--env-file\b|\benv_file\s*:", re.I)
ASYNC_VAR = re.compile(r"\b(?:TORCH_)?NCCL_ASYNC_ERROR_HANDLING\b")
ASYNC_ZERO = re.compile(r"\b(?:TORCH_)?NCCL_ASYNC_ERROR_HANDLING[\"']?\s*[=:]\s*[\"']?0\b")
YAML_VALUE_ZERO = re.compile(r"^\s*value\s*:\s*[\"']?0[\"']?\s*$")
FAULT = re.compile(r"\bPYTHONFAULTHANDLER\b|-X\s*faulthandler\b")


@dataclass(frozen=True)
class TemplateFile:
    path: str
    text: str

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def code_lines(self) -> Iterator[tuple[int, str]]:
        """(1-based number, text) of lines that are not comments (`#SBATCH` lines are comments too)."""
        for number, line in enumerate(self.lines, 1):
            if not line.lstrip().startswith("#"):
                yield number, line

    def launch(self) -> tuple[int, int] | None:
        """(line, column) of the first command that launches distributed training."""
        for number, line in self.code_lines():
            match = LAUNCH.search(line)
            if match:
                return number, match.start() + 1
        return None

    def elastic(self) -> bool:
        """Every launch goes through torchrun's elastic agent."""
        return any(ELASTIC_LAUNCH.search(line) for _, line in self.code_lines())

    def judged(self) -> bool:
        return not any(ENV_ELSEWHERE.search(line) for _, line in self.code_lines())


def _async_state(tf: TemplateFile) -> str:
    """"set", "disabled" or "missing"."""
    lines = list(tf.code_lines())
    found = False
    for index, (_, line) in enumerate(lines):
        if ASYNC_VAR.search(line):
            found = True
            if ASYNC_ZERO.search(line):
                return "disabled"
            following = [text for _, text in lines[index + 1:index + 3]]
            if "name" in line and any(YAML_VALUE_ZERO.match(text) for text in following):
                return "disabled"
    return "set" if found else "missing"


def check_async_error_handling(tf: TemplateFile) -> Iterator[Hit]:
    where = tf.launch()
    if where is None or not tf.judged():
        return
    state = _async_state(tf)
    if state == "disabled":
        yield Hit(*where, "this job sets NCCL async error handling to 0: a failed or timed-out NCCL collective "
                          "then leaves every rank waiting forever instead of tearing the job down")
    elif state == "missing" and not tf.elastic():
        yield Hit(*where, "this launch (not torchrun, which would set it) sets neither "
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING nor NCCL_ASYNC_ERROR_HANDLING: the behaviour on a "
                          "failed collective then depends on the image's torch version; export "
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (or 3)")


def check_faulthandler(tf: TemplateFile) -> Iterator[Hit]:
    where = tf.launch()
    if where is None or not tf.judged():
        return
    if not any(FAULT.search(line) for _, line in tf.code_lines()):
        yield Hit(*where, "this launch does not set PYTHONFAULTHANDLER: a rank killed by SIGSEGV/SIGABRT/"
                          "SIGBUS dies without a Python stack; export PYTHONFAULTHANDLER=1")


RULES = (
    LintRule(
        id="LNC401", name="nccl-async-error-handling-unset", severity=Severity.WARNING, kind=FileKind.TEMPLATE,
        title="Launch template leaves NCCL async error handling unset or disabled",
        prevents=("hang.no_progress", "hang.watchdog_heartbeat"), helps_diagnose=("nccl.watchdog_timeout",),
        fixture="LNC401_nccl_async_error_handling.sh", check=check_async_error_handling,
        references=("seed:ddp-rules (rule 3, CI template check)", "seed:colossalai-ch11 (NCCL hang)",
                    "https://pytorch.org/docs/stable/torch_nccl_environment_variables.html"),
        docs=RuleDocs(
            what="A shell/Slurm script or job template (YAML) that sets TORCH_NCCL_ASYNC_ERROR_HANDLING / "
                 "NCCL_ASYNC_ERROR_HANDLING to 0, or that launches distributed training without torchrun "
                 "(srun/mpirun of python, the deepspeed launcher, a PyTorchJob running python) and sets "
                 "neither variable.",
            why="With async error handling off, the NCCL watchdog notices a timed-out or failed collective "
                "but does not tear the process down: the job holds its GPUs and prints nothing. torch >= 2.2 "
                "defaults to 3 (tear down, skip comm abort) and torchrun sets 1 for its workers when unset, "
                "so an unset variable is only judged for other launchers, where the behaviour depends on the "
                "torch version in the image; an explicit 0 is always reported.",
            example="#!/bin/bash\n#SBATCH --nodes=2\nsrun python train.py\n",
            fix="export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   (and NCCL_ASYNC_ERROR_HANDLING=1 for torch < 2.2)\n"
                "In Kubernetes, add it to the container's env list.",
        ),
    ),
    LintRule(
        id="LNC402", name="faulthandler-unset", severity=Severity.WARNING, kind=FileKind.TEMPLATE,
        title="Launch template does not enable the Python fault handler",
        prevents=(), helps_diagnose=("signal.sigsegv", "signal.sigabrt", "signal.sigbus", "signal.native_terminate"),
        fixture="LNC402_faulthandler_unset.yaml", check=check_faulthandler,
        references=("seed:ddp-rules (CI template check)", "https://docs.python.org/3/library/faulthandler.html"),
        docs=RuleDocs(
            what="A launch script or job template for distributed training without PYTHONFAULTHANDLER "
                 "(or `python -X faulthandler`).",
            why="A rank that dies of a native crash (SIGSEGV in an extension, SIGABRT from a C++ check, "
                "SIGBUS on a shared-memory file) prints no traceback: the log only shows the launcher's "
                "`exitcode: -11`, and the peers' collective errors look like the cause. With the fault "
                "handler on, the dying rank writes `Fatal Python error: Segmentation fault` and its stack. "
                "This rule prevents no failure; it makes these failures diagnosable.",
            example="containers:\n- name: trainer\n  command: [torchrun, --nproc-per-node=8, train.py]\n",
            fix="export PYTHONFAULTHANDLER=1 in the script, or add it to the container's env list.",
        ),
    ),
)
