"""Second readings of a chosen root: the same evidence read in its context, across ranks and the
launcher. A peer's closed connection points at the rank that left; an OOM's GPU index is the local rank; an abort that follows the watchdog's dump signal is the collective timeout's teardown; a Ctrl-C whose
process sat in a wait is the hang someone stopped. Readings of one exception are in exceptions.py,
of stops and signals in signal_readings.py, of the store in store_waits.py."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.rank_evidence import PEER_LEFT_RULES, odd_one_out
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.signal_readings import exit_rule
from logtriage.analysis.roots import RankFacts, RootCause, earliest
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKind

# the C++ runtime's note as such a rank then aborts (`terminate called without an active exception`)
ABORT_NOTE_RULE = "signal.terminate_no_exception"


def peer_that_left(root: RootCause, findings: list[Finding], facts: RankFacts, catalog: Catalog) -> RootCause:
    """Only consequences were found, all of them a rank's peer closing or resetting the
    connection: when exactly one known rank reported no error at all, that rank left first,
    without a message (an exit in its own code, a process that ended early), and the failure
    started there. A silent peer that exited cleanly left one waiting rank alone in a collective
    the others never called: that rank's fault; but when it left two or more ranks waiting, it
    is the odd one out that stopped early (an early stop on one rank, a shorter data shard)."""
    live = [f for f in findings if f.is_error and not f.is_teardown and f.rank is not None]
    if root.rule.role is not Role.CASCADE_CANDIDATE or any(
            f.role is not Role.EITHER and f.rule.id not in PEER_LEFT_RULES | {ABORT_NOTE_RULE}
            and f.stream.kind is StreamKind.RANK for f in live):
        return root
    silent = facts.known - {f.rank for f in live}
    stopped_by_agent = {r for r in silent if facts.exit_codes.get(r) == -15}
    if stopped_by_agent and len(silent - stopped_by_agent) == 1:
        silent -= stopped_by_agent     # alive until the agent's SIGTERM: still waiting, not the one that left
    if len(silent) != 1:
        return _odd_one_out_in_progress(root, facts)
    peer = next(iter(silent))
    if silent <= facts.completed:
        left = sorted({f.rank for f in live if f.rule.id in PEER_LEFT_RULES})
        if len(left) < 2:
            return root     # a peer that finished cleanly left a rank alone in a collective: that rank's fault
        return replace(root, rank=peer, ranks=(peer,), confidence=min(root.confidence, 0.4), reasons=root.reasons + (
            f"rank {peer} exited cleanly while ranks {', '.join(map(str, left))} were still in a collective with "
            f"it: it stopped early (a stop condition or a data shard of its own), and they lost their peer",))
    rule = exit_rule(catalog)
    return RootCause(rule, None, peer, (peer,), 0.35, (
        f"rank {peer} printed no error, and every error found is another rank's peer connection "
        f"closing ({root.rule.id}): rank {peer} left first, without a message",))


NODE_EXIT_RULE = "sched.srun_task_exit"


def peers_over_node_exit(root: RootCause, findings: list[Finding]) -> RootCause:
    """srun's `task N: Exited with exit code 1` where each srun task is a node's torchrun agent says only
    that an agent failed; when the workers' own errors are all peers closing the connection, they are
    the evidence to read (as without srun), and the peer that left is found from them."""
    live = [f for f in findings if f.is_error and not f.is_teardown and f.stream.kind is StreamKind.RANK]
    peers = [f for f in live if f.rule.id in PEER_LEFT_RULES and f.rank is not None]
    if root.rule.id != NODE_EXIT_RULE or not peers or any(f.rule.id not in PEER_LEFT_RULES for f in live):
        return root
    first = earliest(peers)
    return RootCause(first.rule, first, first.rank, (first.rank,), min(root.confidence, 0.3), (
        "srun's task lines are the agents' exits (one torchrun per node); the workers' own errors are all a "
        "peer closing the connection",))


def at_the_odd_step(root: RootCause, facts: RankFacts, confidence: float, why: str) -> RootCause:
    """The root moved to the one rank whose progress lines stopped at another step than every
    other rank's (which all reached the same one): it went its own way. `why` is a reason with
    {rank}, {step} and {others} (that rank's last step, the others')."""
    steps = facts.last_step
    rank = odd_one_out(steps) if len(steps) >= len(facts.known) else None
    if rank is None:
        return root
    others = next(s for r, s in steps.items() if r != rank)
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, confidence),
                   reasons=root.reasons + (why.format(rank=rank, step=steps[rank], others=others),))


def _odd_one_out_in_progress(root: RootCause, facts: RankFacts) -> RootCause:
    """Several ranks printed no error, but their progress lines say which one went its own way:
    every rank but one reached the same step, and that one stopped earlier or ran ahead (a
    skipped collective, a step of its own): the peers lost their connection because of it."""
    return at_the_odd_step(root, facts, 0.3, (
        "every error found is a peer connection closing; rank {rank}'s last progress line is step {step}, every "
        "other rank's step {others}: it went its own way (it stopped early or ran a step ahead), and the others "
        "lost their peer"))


OOM_RULE = "cuda.oom"


def oom_device_rank(root: RootCause, multi_node: bool, own_gpus: bool) -> RootCause:
    """A CUDA OOM that no line ties to a rank, in a one-node job: torchrun, accelerate, DeepSpeed and
    Lightning put local rank k on `cuda:k`, so "GPU k" in the message names local rank k. Not where
    each worker has a GPU of its own (`own_gpus`: Ray's workers), whose device is always GPU 0."""
    f = root.finding
    if root.rule.id != OOM_RULE or root.rank is not None or root.ranks or f is None or multi_node \
            or not f.captures.get("device", "").isdigit():
        return root
    device = int(f.captures["device"])
    if own_gpus and device == 0:
        return root
    return replace(root, rank=device, ranks=(device,), confidence=min(root.confidence, 0.5), reasons=root.reasons + (
        f"no line names the rank; the message's GPU {device} is local rank {device}'s device where the launcher "
        f"sets each rank's device to its local rank (torchrun, accelerate, DeepSpeed, Lightning)",))


DUMP_SIGNAL_RULE = "nccl.flight_recorder"
ABORT_RULE = "nccl.async_abort"


def abort_after_dump_signal(root: RootCause, findings: list[Finding]) -> RootCause:
    """A rank's only error is its abort (SIGABRT, an exit code, NCCL's "failed or timed out" abort)
    after ProcessGroupNCCL's dump signal ("Received a dump signal due to a collective timeout from
    rank N", then "Terminating the process after attempting to dump debug info"): the watchdog killed it because a collective
    timed out somewhere. The failure is that timeout; the rank that detected it is named, and no
    rank is blamed, since the signal reaches the rank that hung too."""
    aborted = root.rule.id == ABORT_RULE          # "Some NCCL operations have failed or timed out"
    if not aborted and (root.rule.role is not Role.EITHER
                        or root.rule.category not in (Category.CRASH_SIGNAL, Category.UNKNOWN)):
        return root
    dumps = [f for f in findings if f.rule.id == DUMP_SIGNAL_RULE]
    if not dumps:
        return root
    first = dumps[0]
    peer = first.captures.get("peer")
    detected = f"rank {peer}" if peer and peer.isdigit() else "this rank's own watchdog"
    return RootCause(first.rule, first, None, (), 0.45, (
        f"a collective timed out ({detected} detected it) and ProcessGroupNCCL's watchdog then stopped the "
        f"process ({root.rule.id} is that teardown); the rank that never reached the collective is not in "
        "this log: look for the one whose last step or collective differs",))


# The innermost frame of a process that was only waiting: a child, a queue, a socket, a lock.
WAITING_FRAMES = frozenset({
    "wait", "_wait", "_try_wait", "waitpid", "poll", "_poll", "select", "join", "communicate",
    "get", "_get_data", "_try_get_data", "acquire", "_wait_for_tstate_lock", "wait_for", "recv",
    "recv_bytes", "_recv_bytes", "_recv", "accept", "barrier", "monitored_barrier", "_store_based_barrier"})
STOPPED_RULES = frozenset({"python.keyboard_interrupt", "python.traceback_cut"})
STOPPED_WHILE_WAITING = "hang.stopped_while_waiting"


def stopped_while_waiting_rule(catalog: Catalog):
    """The rule of a stop that ended a hang (the catalog's, or a stand-in when a user's catalog lacks it)."""
    return catalog.get(STOPPED_WHILE_WAITING) or fallback_rule(
        STOPPED_WHILE_WAITING, Category.HANG, "Stopped while waiting: the run had hung")


def stopped_while_waiting(root: RootCause, findings: list[Finding], interrupted_frames: list[str],
                          catalog: Catalog) -> RootCause:
    """A Ctrl-C (or a traceback the paste cut short) whose innermost frame is a wait (a launcher in
    `subprocess.wait`, `mp.spawn`'s join in `select`, a DataLoader's queue): the process had nothing
    to do but wait, so what was stopped was a hang, not work. The root may be the launcher's own
    report of the SIGINT; a worker's traceback (cut, or ending in KeyboardInterrupt:
    `interrupted_frames`, their innermost functions) then says where it was."""
    interrupted = root.rule.id in STOPPED_RULES or (
        root.rule.id == "launcher.signal_exception" and root.finding is not None
        and root.finding.captures.get("signal") == "2")
    if not interrupted:
        return root
    candidates = ([root.finding] if root.finding is not None else []) + [
        f for f in findings if f.rule.id in STOPPED_RULES]
    waiting = next((f for f in candidates if f.last_frame in WAITING_FRAMES), None)
    frame = waiting.last_frame if waiting is not None else next(
        (name for name in interrupted_frames if name in WAITING_FRAMES), None)   # a worker's, cut or interrupted
    if frame is None:
        return root
    rule = stopped_while_waiting_rule(catalog)
    return replace(root, rule=rule, confidence=min(root.confidence, 0.45), reasons=root.reasons + (
        f"the innermost frame of the interrupted traceback is `{frame}`: the "
        "process was waiting (for a child, a queue, a socket or a lock) when it was stopped, so the run had "
        "stalled before that",))
