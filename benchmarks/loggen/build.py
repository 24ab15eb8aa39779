"""Put a whole log together: preamble, training, the injected failure, the cascade, the end.

Timeline of a failed run with R on node n (FORMATS.md §4, §5, §11; several nodes as under Slurm):

1. healthy steps until `fail_at` of the size;
2. the culprit's own output (traceback for oom/exception, nothing for sigkill); node n's agent
   SIGTERMs its other workers, logs `failed (exitcode: ...)` and prints its ChildFailedError;
3. the survivors (other nodes; everyone for `timeout`) sit in their all-reduce; their monitor
   threads keep logging heartbeats until the NCCL watchdog fires at the process-group timeout;
4. each survivor's watchdog timeout and SIGABRT, then each node's agent and ChildFailedError.

Sizes of the parts after the body are measured by rendering them once with a copy of the random
state, so the log ends within a few kB of the asked size and stays byte-identical per arguments.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import BinaryIO, Callable

from benchmarks.loggen import cascade
from benchmarks.loggen.clock import SimClock
from benchmarks.loggen.expect import build_expectation
from benchmarks.loggen.layout import Topology, Worker
from benchmarks.loggen.preamble import write_preamble
from benchmarks.loggen.spec import Expectation, FailureKind, GenSpec, Style
from benchmarks.loggen.tracebacks import destroy_warning, exception_traceback, oom_traceback
from benchmarks.loggen.training import Training
from benchmarks.loggen.writer import LogWriter

HEARTBEAT_BYTES = 150
_TIMEOUTS_S = (600, 1800, 3600, 7200, 14400, 28800)

Rendered = tuple[list[str], int, str]  # lines, index of the evidence line (-1: none), exception type
Renderer = Callable[[random.Random, SimClock], Rendered]


def choose_timeout_ms(filler_bytes: float, survivors: int) -> int:
    """The smallest usual process-group timeout that lets survivors log at most every 0.1 s."""
    rounds = filler_bytes / max(1, survivors * HEARTBEAT_BYTES)
    for seconds in _TIMEOUTS_S:
        if rounds * 0.1 <= seconds:
            return seconds * 1000
    return _TIMEOUTS_S[-1] * 1000


def _measure(render: Renderer, rng: random.Random, clock: SimClock) -> int:
    probe = random.Random()
    probe.setstate(rng.getstate())
    lines, _, _ = render(probe, clock.at(clock.now_us))
    return sum(len(line) + 1 for line in lines)


def _culprit_part(spec: GenSpec, topo: Topology, culprit: Worker) -> Renderer:
    def render(rng: random.Random, clock: SimClock) -> Rendered:
        lines: list[str] = []
        evidence, exc_type = -1, ""
        if spec.failure in (FailureKind.OOM, FailureKind.EXCEPTION):
            make = oom_traceback if spec.failure is FailureKind.OOM else exception_traceback
            trace, last, exc_type = make(culprit, rng)
            evidence = last
            lines += trace
            lines.append(destroy_warning(culprit, clock.cpp_glog("W", rng.getrandbits(20))))
        exitcode = -9 if spec.failure is FailureKind.SIGKILL else 1
        clock.advance(rng.randrange(100_000, 900_000))
        records = [cascade.ExitRecord(culprit, exitcode, clock.childfailed_time())]
        clock.advance(1_000_000)
        records += [cascade.ExitRecord(w, -15, clock.childfailed_time())
                    for w in topo.node_workers(culprit.node) if w is not culprit]
        agent_lines, failed_at = cascade.agent_failure(topo.agents[culprit.node], clock, records)
        if spec.failure is FailureKind.SIGKILL:
            evidence = len(lines) + failed_at
        lines += agent_lines
        if spec.style is Style.SRUN:
            lines.append(cascade.srun_exit(topo.agents[culprit.node], culprit.node))
        return lines, evidence, exc_type
    return render


def _watchdog_part(spec: GenSpec, topo: Topology, culprit: Worker, survivors: list[Worker],
                   seq: int, timeout_ms: int) -> Renderer:
    lagging = culprit.rank if spec.failure is FailureKind.TIMEOUT else None

    def render(rng: random.Random, clock: SimClock) -> Rendered:
        timed_out = [w for w in survivors if w is not culprit]
        rng.shuffle(timed_out)
        parts = [cascade.watchdog(w, clock, rng, seq, timeout_ms, lagging, topo.world) for w in timed_out]
        lines: list[str] = []
        depth = max(len(glog) for glog, _ in parts)
        for i in range(depth):  # messages of different processes interleave, each one write
            for glog, _ in parts:
                if i < len(glog):
                    lines += glog[i]
        evidence = 3 if lagging is not None else 0  # the first `[R] finished collective ...` line
        for _, native in parts:  # each abort message is one write
            lines += native
        clock.advance(rng.randrange(200_000, 800_000))
        for node in sorted({w.node for w in timed_out}, key=lambda _: rng.random()):
            local = topo.node_workers(node)
            aborted = [w for w in timed_out if w.node == node]
            root = aborted[0]
            records = [cascade.ExitRecord(root, -6, clock.childfailed_time())]
            clock.advance(1_000_000)
            for w in local:
                if w is not root:
                    code = -6 if (w in aborted and rng.random() < 0.5) else -15
                    records.append(cascade.ExitRecord(w, code, clock.childfailed_time()))
            agent_lines, _ = cascade.agent_failure(topo.agents[node], clock, records)
            lines += agent_lines
            if spec.style is Style.SRUN:
                lines.append(cascade.srun_exit(topo.agents[node], node))
        return lines, evidence, ""
    return render


def generate(spec: GenSpec, stream: BinaryIO) -> Expectation:
    """Write the log described by `spec` to `stream`; return what was injected and where."""
    rng = random.Random(spec.seed)
    fail_rank = spec.fail_rank if spec.fail_rank is not None else rng.randrange(spec.ranks)
    topo = Topology(spec, rng)
    culprit = topo.workers[fail_rank]
    clock = SimClock(datetime(2026, 11, 30, 0, 0, 0) + timedelta(seconds=rng.randrange(3600)))
    w = LogWriter(stream)
    kind = spec.failure
    if kind is FailureKind.TIMEOUT:
        survivors = list(topo.workers)
    elif kind is FailureKind.NONE:
        survivors = []
    else:
        survivors = [wk for wk in topo.workers if wk.node != culprit.node]
    timeout_ms = choose_timeout_ms(spec.size * (1.0 - spec.fail_at), len(survivors)) if survivors else 600_000
    write_preamble(w, topo, clock, rng, spec.banner, timeout_ms)
    training = Training(topo, clock, rng, w)

    if kind is FailureKind.NONE:
        while w.approx_bytes < spec.size - len(topo.workers) * 160:
            training.step()
        training.finish()
        return build_expectation(spec, topo, None, w.close(), w.lines, 0, "", "")

    culprit_part = _culprit_part(spec, topo, culprit)
    fail_point = spec.size * spec.fail_at if survivors else spec.size - _measure(culprit_part, rng, clock)
    while w.approx_bytes < fail_point:
        training.step()
    stuck_step, seq = training.step_no, training.seq
    first_line = w.next_line
    evidence_line, evidence_text, exc_type = 0, "", ""
    if kind is not FailureKind.TIMEOUT:
        lines, evidence, exc_type = culprit_part(rng, clock)
        evidence_line, evidence_text = first_line + evidence, lines[evidence]
        w.block(lines)
    if survivors:
        deadline = clock.now_us + timeout_ms * 1000
        tail = _watchdog_part(spec, topo, culprit, survivors, seq, timeout_ms)
        tail_chars = _measure(tail, rng, clock.at(deadline))
        ranks = [wk.rank for wk in survivors]
        while w.approx_bytes + tail_chars < spec.size and clock.now_us < deadline:
            remaining = spec.size - tail_chars - w.approx_bytes
            rounds = max(1.0, remaining / (len(ranks) * HEARTBEAT_BYTES))
            training.heartbeats(ranks, stuck_step, max(1, int((deadline - clock.now_us) * 0.98 / rounds)))
        tail_clock = clock.at(max(deadline, clock.now_us))
        start = w.next_line
        lines, evidence, _ = tail(rng, tail_clock)
        if kind is FailureKind.TIMEOUT:
            evidence_line, evidence_text = start + evidence, lines[evidence]
        w.block(lines)
    return build_expectation(spec, topo, culprit, w.close(), w.lines, evidence_line, evidence_text, exc_type)
