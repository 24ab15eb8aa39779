"""Process-group setup rules: PG201."""

from __future__ import annotations

from typing import Iterator

from logtriage.lint.model import FileKind, Hit, LintRule, RuleDocs, Severity
from logtriage.lint.names import has_star_kwargs, kwarg
from logtriage.lint.pyfile import PyFile

INIT_CALLS = ("torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group",
              "deepspeed.init_distributed", "deepspeed.comm.init_distributed")


def check_init_without_timeout(pf: PyFile) -> Iterator[Hit]:
    if "init_" not in pf.text:
        return
    for site in pf.regions.calls:
        call = site.call
        qual = pf.qual(call)
        if qual not in INIT_CALLS:
            continue
        positional_timeout = 3 if qual.endswith("init_process_group") else 5
        if kwarg(call, "timeout") is not None or has_star_kwargs(call) or len(call.args) >= positional_timeout:
            continue
        yield Hit(call.lineno, pf.col(call),
                  f"`{pf.source_of(call.func)}(...)` has no timeout=: a rank that stops answering leaves the "
                  f"others blocked for the backend default (NCCL 10 min, gloo 30 min) instead of a deadline "
                  f"you chose; pass timeout=datetime.timedelta(...)")


RULES = (
    LintRule(
        id="PG201", name="init-without-timeout", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="init_process_group without an explicit timeout",
        prevents=("hang.no_progress",), helps_diagnose=("gloo.timeout", "nccl.watchdog_timeout"),
        fixture="PG201_init_without_timeout.py", check=check_init_without_timeout,
        references=("seed:ddp-rules (rule 3: explicit timeout and async error handling)",
                    "https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group"),
        docs=RuleDocs(
            what="`torch.distributed.init_process_group(...)` (or `deepspeed.init_distributed`) called "
                 "without `timeout=`. Calls that forward **kwargs are not judged.",
            why="The timeout bounds every collective and store wait of the group. Without it the job relies "
                "on the backend default (gloo 30 minutes, NCCL 10 minutes in current releases, effectively "
                "unbounded on old NCCL builds without async error handling): a dead or diverged rank leaves "
                "the others idle for that long, and the deadline is invisible in the code.",
            example="dist.init_process_group(backend='nccl')\n",
            fix="dist.init_process_group(backend='nccl', timeout=datetime.timedelta(minutes=30))\n"
                "Choose a deadline longer than your slowest legitimate step (checkpointing, evaluation).",
        ),
    ),
)
