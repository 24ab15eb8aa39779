"""Readings of stops and signals: a stop signal with a memory reason is that reason, and one that
follows Slurm's report of a failed task is its teardown; a bare SIGKILL on a GPU job is the OOM killer
unless the scheduler says it stopped the job; a SIGHUP the launcher forwards is its own; a SIGTERM the
launcher did not send is the worker's own end, a SIGKILL it sent is its teardown; the launcher's
teardown alone says a worker failed whose error the log does not hold."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import SRUN_TASK_NOTICE, Finding
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.roots import RootCause
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category, Rule


def exit_rule(catalog: Catalog) -> Rule:
    return catalog.get("signal.exit_nonzero") or fallback_rule(
        "signal.exit_nonzero", Category.UNKNOWN, "A worker exited with an error code and left no message")


def stop_for_memory(root: RootCause, findings: list[Finding]) -> RootCause:
    """A scheduler that stops a job for memory (Slurm's oom_kill event, an LSF/PBS memory limit,
    a Kubernetes eviction) sends the SIGTERM first and says why after it: the reason is the root."""
    memory = [f for f in findings if f.is_error and f.category is Category.HOST_OOM]
    if not memory:
        return root
    first = memory[0]
    return RootCause(first.rule, first, first.rank, (first.rank,) if first.rank is not None else (), 0.7, (
        f"the job was stopped ({root.rule.id}) because it ran out of host memory: {first.rule.id} "
        "says so after the stop signal",))


TASK_FAILURE_RULES = ("sched.srun_task_exit", "sched.step_failed")


def stop_after_task_failure(root: RootCause, findings: list[Finding]) -> RootCause:
    """torchrun got SIGTERM after Slurm said one of the step's tasks had failed (`srun: error: node:
    task N: Exited with exit code 1`, `*** STEP ... FAILED ***`): Slurm stopped the other tasks
    because of it (--kill-on-bad-exit), so the stop is teardown and the failed task the cause."""
    head = root.finding
    if root.rule.id != SIGNAL_EXCEPTION_RULE or head is None:
        return root
    before = [f for f in findings if f.rule.id in TASK_FAILURE_RULES and f.source == head.source and f.seq < head.seq
              and f.captures.get("exit_code", "1") != "0"]
    if not before:
        return root
    first = min(before, key=lambda f: (f.rule.id != TASK_FAILURE_RULES[0], f.seq))   # a task's own line first
    return RootCause(first.rule, first, first.rank, (first.rank,) if first.rank is not None else (), 0.55, (
        f"Slurm reported a failed task ({first.rule.id}) before torchrun received its stop signal: the stop "
        "is Slurm ending the step's other tasks",))


def sigkill_on_gpu_job(root: RootCause, findings: list[Finding], catalog: Catalog, gpu: bool) -> RootCause:
    """A worker killed by SIGKILL, with no message of its own, in a job whose log shows a GPU (an NCCL or
    CUDA line; not a CPU/gloo run): on GPU nodes the sender is, in practice, the kernel's OOM killer
    (host RAM exhausted by data loading, checkpoint loading to CPU, too many DataLoader workers), unless
    the scheduler says it stopped the job (`CANCELLED ... DUE to SIGNAL Killed`, a revoked allocation).
    A log that shows no device (`gpu` false) stays a kill of either kind (signal.sigkill says how to tell
    them apart), unless the scheduler says it stopped the job."""
    stop = next((f for f in findings if f.is_error and f.category is Category.EXTERNAL_STOP
                 and f.rule.id.startswith("sched.")), None)
    if stop is not None:
        return RootCause(stop.rule, stop, None, (), 0.6, root.reasons + (
            f"the scheduler's own line ({stop.rule.id}) says it stopped the job: it sent the SIGKILL",))
    rule = catalog.get("host.oom_killer")
    if rule is None or not gpu:
        return root
    reason = ("SIGKILL cannot be caught, so the rank printed nothing; on GPU jobs the sender is nearly "
              "always the kernel's OOM killer (host memory). `dmesg -T | grep -i oom` on the node confirms "
              "it; if it shows nothing, look for a scheduler limit or a manual kill")
    return replace(root, rule=rule, reasons=root.reasons + (reason,), confidence=min(root.confidence, 0.6))


SIGNAL_EXCEPTION_RULE = "launcher.signal_exception"
TEARDOWN_RULE = "launcher.sigterm_sent"


def hangup_forwarded(findings: list[Finding], catalog: Catalog) -> RootCause | None:
    """torchrun tears its workers down with SIGTERM after a failure; it forwards any other signal
    only when it received that signal itself. "Sending process N closing signal SIGHUP" with no
    error before it is the launcher's terminal going away (an SSH session closed, a `nohup`-less
    job): an outside stop, even when the launcher's own SignalException was cut from the paste."""
    sent = next((f for f in findings if f.rule.id == TEARDOWN_RULE and f.captures.get("signal") == "SIGHUP"), None)
    rule = catalog.get(SIGNAL_EXCEPTION_RULE)
    if sent is None or rule is None:
        return None
    return RootCause(rule, sent, None, (), 0.5, (
        "the launcher sent its workers SIGHUP, which it forwards only when it received SIGHUP itself: its "
        "terminal or SSH session went away, and no worker had failed before",))


SIGTERM_RULE = "signal.sigterm"
SIGTERM_UNSENT = "signal.sigterm_unsent"


def unsent_sigterms(findings: list[Finding], catalog: Catalog, stopped: frozenset[int] = frozenset()) -> list[Finding]:
    """A worker that died of SIGTERM the launcher did not send: torchrun names the pid of every
    worker it stops, so a -15 whose pid is not among them was signalled from elsewhere, before
    the teardown, and is that worker's own end (not teardown). Only where the log shows the
    launcher's SIGTERMs (or srun's notices, below): without them nothing tells the two apart.
    `stopped`: every pid the launcher's lines named as stopped while reading (the findings keep
    a rule's first lines per stream only: a thousand workers' SIGTERMs are more)."""
    rule = catalog.get(SIGTERM_UNSENT)
    if rule is None:
        return findings
    sent = {int(f.captures["pid"]) for f in findings if f.rule.id == TEARDOWN_RULE
            and f.captures.get("signal") == "SIGTERM" and f.captures.get("pid", "").isdigit()}
    if sent:   # the log shows the launcher's SIGTERMs: all it named count
        sent |= stopped
    unsent = {i for i, f in enumerate(findings) if sent and f.rule.id == SIGTERM_RULE
              and f.captures.get("pid", "").isdigit() and int(f.captures["pid"]) not in sent}
    if len({findings[i].captures["pid"] for i in unsent}) > max(1, len(sent)):
        unsent = set()   # more workers unnamed than named: the paste left most of the launcher's list out
    # srun reports each task's end; it terminates tasks itself only after one failed (or on a
    # cancel, all at once): a single task's "Terminated" before any other task's end was its own
    notices = sorted((i for i, f in enumerate(findings) if SRUN_TASK_NOTICE.match(f.text)),
                     key=lambda i: findings[i].seq)
    if len(notices) > 1 and findings[notices[0]].rule.id == SIGTERM_RULE \
            and findings[notices[1]].rule.id != SIGTERM_RULE:
        unsent.add(notices[0])
    # mp.spawn raises for the first child that died and only then terminates the others (by pid, `Terminating
    # process 27211 via signal SIGTERM`): the child its exception names (the pattern's `process`) was not stopped by it
    unsent |= {i for i, f in enumerate(findings) if f.rule.id == SIGTERM_RULE and "process" in f.captures}
    return [replace(f, rule=rule) if i in unsent else f for i, f in enumerate(findings)]


STOP_NOTICE = "signal.stop_notice"


def notices_in_teardown(findings: list[Finding]) -> list[Finding]:
    """A worker's own handler saying it got SIGTERM (`[rank: 3] Received SIGTERM: 15`) after the launcher
    began stopping the workers ("Sending process N closing signal SIGTERM") is that teardown reaching
    it, not a stop from outside, and says nothing the launcher's lines do not: left out."""
    began = min((f.seq for f in findings if f.rule.id == TEARDOWN_RULE), default=None)
    if began is None:
        return findings
    return [f for f in findings if not (f.rule.id == STOP_NOTICE and f.seq > began)]


SIGKILL_RULE = "signal.sigkill"


def agent_sigkills(findings: list[Finding], catalog: Catalog) -> list[Finding]:
    """A worker torchrun killed itself: it sends SIGKILL to a worker that outlived its SIGTERM
    ("Unable to shutdown process N via 15, forcefully exiting via 9": a stopped or hung process),
    so that worker's -9 is the teardown's, not a crash or the OOM killer."""
    rule = catalog.get(TEARDOWN_RULE)
    killed = {int(f.captures["pid"]) for f in findings if f.rule.id == TEARDOWN_RULE
              and f.captures.get("kill_signum") == "9" and f.captures.get("pid", "").isdigit()}
    if rule is None or not killed:
        return findings
    return [replace(f, rule=rule) if f.rule.id == SIGKILL_RULE and f.captures.get("pid", "").isdigit()
            and int(f.captures["pid"]) in killed else f for f in findings]


def teardown_only(findings: list[Finding]) -> RootCause | None:
    """The launcher stopping its workers (torchrun's SIGTERMs, the legacy and DeepSpeed launchers'
    `Killing subprocess N`) with no error anywhere: it does that after a worker failed, so the run
    failed, and the failure itself is not in this log (a cut paste, a worker that printed nothing)."""
    sent = next((f for f in findings if f.rule.id == TEARDOWN_RULE
                 and f.captures.get("signal", "SIGTERM") in ("SIGTERM", "SIGKILL")), None)
    if sent is None:
        return None
    return RootCause(sent.rule, sent, None, (), 0.3, (
        "the launcher stopped its workers, which it does after one of them failed; no error of that worker "
        "is in this log",))
