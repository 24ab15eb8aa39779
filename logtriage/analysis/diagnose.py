"""From a scan to a diagnosis: streams resolved, findings attributed, the root cause chosen,
ranks given a status. Pure data in, pure data out (no rendering, no I/O)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from logtriage.analysis.abort_rank import launcher_named_rank
from logtriage.analysis.childfailed import ChildFailure, parse_child_failures
from logtriage.analysis.diverged import different_collectives_at_one_seq
from logtriage.analysis.early_stop import stopped_early_peer
from logtriage.analysis.environment import Environment, collect_environment
from logtriage.analysis.exceptions import checkpoint_io, frame_reading, probe_json_without_banner
from logtriage.analysis.loader_ipc import loader_worker_reset
from logtriage.analysis.ext_build import own_source_compile_error
from logtriage.analysis.gave_up import gave_up_before_exit
from logtriage.analysis.fallback_roots import (cut_traceback, exit_one_output_elsewhere, exit_only_root,
                                              unrecognised_exception)
from logtriage.analysis.summary_exceptions import error_file_exception, same_error_in_summary
from logtriage.analysis.findings import Finding, resolve_findings, srun_tasks_are_nodes
from logtriage.analysis.hangs import (
    finished_then_stopped,
    hang_from_progress,
    stalled_in_nccl_init,
    waiting,
    world_incomplete,
)
from logtriage.analysis.nccl_ranks import attribute_by_nccl_pid, shared_gpu
from logtriage.analysis.interrupted_work import stopped_mid_work, waits_the_stop_ended
from logtriage.analysis.invalid_values import finite_invalid_values, own_loss_check
from logtriage.analysis.lone_notice import hang_answered_alone, notice_ended_hang, stop_notices
from logtriage.analysis.loss_outlier import loss_outlier_rank, shared_nan_then_one_check
from logtriage.analysis.odd_start import odd_start_rank
from logtriage.analysis.recovered import (GROUP_SUCCEEDED, caught_then_finished, relaunched_then_finished,
                                          restarted_then_finished)
from logtriage.analysis.rank_facts import first_progress, merge_stats, rank_facts
from logtriage.analysis.refine import (
    PEER_LEFT_RULES,
    STOPPED_WHILE_WAITING,
    abort_after_dump_signal,
    oom_device_rank,
    peer_that_left,
    peers_over_node_exit,
    stopped_while_waiting,
)
from logtriage.analysis.store_waits import own_server_port_taken, store_wait_after_progress, unique_id_host_left
from logtriage.analysis.live_errors import went_on_from_every_error
from logtriage.analysis.rpc_origin import remote_origin
from logtriage.analysis.signal_readings import (
    agent_sigkills,
    hangup_forwarded,
    notices_in_teardown,
    sigkill_on_gpu_job,
    stop_after_task_failure,
    stop_for_memory,
    teardown_only,
    unsent_sigterms,
)
from logtriage.analysis.rootcause import build_chain, choose_root, warning_root
from logtriage.analysis.odd_dtype import size_abort_sender, sized_by_mismatch
from logtriage.analysis.validity import refused_result_first
from logtriage.analysis.rule_readings import (bootstrap_layout_mismatch, dcp_named_ranks, group_destroyed,
                                              oom_on_shared_gpu, rank0_model_differs, spawn_report_yields, timer_reaped, unresolved_host,
                                              waited_for_a_crash, writer_behind_readers)
from logtriage.analysis.silent_first import silent_death_first
from logtriage.analysis.stalls import (behind_ranks_ended, came_late_to_the_collective, heartbeat_odd_one_out,
                                       heartbeats_before_stop, late_rank_went_on, time_limit_ended_hang,
                                       watchdog_spared_rank)
from logtriage.analysis.statuses import StreamSummary, stream_statuses
from logtriage.analysis.waiting_lines import (stopped_after_one_went_on, stopped_before_all_stepped, stopped_in_startup,
                                             stopped_in_stride,
                                             stopped_with_uneven_progress, waiting_before_stop)
from logtriage.analysis.stopped import (FINISHED_RULE, log_tail, output_stopped, stalled_before_stop,
                                        still_retrying, stuck_after_warning, unknown_error_line)
from logtriage.analysis.roots import ChainLink, RankFacts, RootCause, Verdict
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import ScanResult


@dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    root: RootCause | None
    chain: tuple[ChainLink, ...]
    findings: tuple[Finding, ...]
    streams: tuple[StreamSummary, ...]
    keys: tuple[StreamKey, ...]                 # slot -> stream
    failures: tuple[ChildFailure, ...]
    environment: Environment
    notes: tuple[str, ...]
    recovered: RootCause | None = None          # an earlier attempt's failure torchrun restarted from


def diagnose(scan: ScanResult, catalog: Catalog) -> Diagnosis:
    keys = scan.slots.resolve(scan.facts.pid_to_rank(), scan.facts.attempt_of_segment, scan.facts.host_rank,
                             scan.facts.console_rank)
    failures = parse_child_failures(scan.launcher_lines)
    findings = agent_sigkills(unsent_sigterms(attribute_by_nccl_pid(resolve_findings(scan, keys, failures)), catalog,
                                              frozenset(scan.facts.teardown_pids)), catalog)
    notices = stop_notices(findings)
    findings = notices_in_teardown(findings)
    stream_stats = merge_stats(scan, keys)
    facts = rank_facts(stream_stats, failures, findings, scan.world_size, frozenset(scan.facts.teardown_pids))
    root = choose_root(findings, facts)
    if root is not None:
        root = silent_death_first(spawn_report_yields(root, findings), findings, facts)
    if root is not None and srun_tasks_are_nodes(scan, failures):
        root = peers_over_node_exit(root, findings)
    if root is not None and root.rule.id in PEER_LEFT_RULES:
        root = stopped_early_peer(scan, keys, peer_that_left(root, findings, facts, catalog), facts)
    if root is not None and root.rule.role is Role.CASCADE_CANDIDATE:
        root = unique_id_host_left(root, catalog)
    if root is not None:
        root = remote_origin(sized_by_mismatch(root, findings), findings, facts)
        ray = scan.facts.ray_workers or any(".ray_" in f.rule.id for f in findings)   # Ray: a GPU per worker
        root = launcher_named_rank(root, findings)
        root = oom_device_rank(root, scan.multi_node or any(k.host for k in keys), ray)
        root = oom_on_shared_gpu(root, len(facts.known), catalog)
    if root is not None and root.rule.category is Category.EXTERNAL_STOP:
        root = finished_then_stopped(stop_after_task_failure(stop_for_memory(root, findings), findings),
                                     findings, catalog)
        root = stalled_before_stop(scan, root, findings, catalog)
        if root.rule.category is Category.EXTERNAL_STOP:
            root = heartbeats_before_stop(scan, keys, root, findings, catalog)
        root = stopped_in_startup(scan, keys, waiting_before_stop(scan, keys, root, findings, catalog), findings, facts,
                                  catalog)
        root = stopped_with_uneven_progress(scan, root, findings, facts, catalog)
        root = stopped_before_all_stepped(scan, root, findings, facts, catalog)
        root = stopped_after_one_went_on(scan, keys, root, findings, facts, catalog)
        root = time_limit_ended_hang(scan, keys, root, findings)
        root = stopped_in_stride(scan, keys, root, findings, facts, catalog)
        root = notice_ended_hang(scan, root, findings, notices, facts, catalog)
        root = waits_the_stop_ended(stopped_mid_work(scan, keys, root, catalog), findings, facts.known, catalog)
    if root is not None:
        root = timer_reaped(waited_for_a_crash(refused_result_first(root, findings), findings), findings)
    if root is not None and root.rule.id == "signal.sigkill" and not scan.cpu_backend:
        root = sigkill_on_gpu_job(root, findings, catalog)
    if root is not None:
        root = own_source_compile_error(scan, unresolved_host(root, findings), catalog)
    if root is not None and root.rule.id == "nccl.invalid_rank":
        root = bootstrap_layout_mismatch(root, catalog)
    if root is not None:
        root = abort_after_dump_signal(checkpoint_io(frame_reading(root, catalog), catalog), findings)
        root = loader_worker_reset(scan, root, catalog)
        root = dcp_named_ranks(root, findings, scan.block_exceptions)
        root = probe_json_without_banner(root, bool(scan.banner_lines), catalog)
        root = size_abort_sender(different_collectives_at_one_seq(root, findings, catalog), scan, keys, findings,
                                 facts.known)
        root = loss_outlier_rank(scan, keys, shared_nan_then_one_check(scan, keys, root, findings))
        root = own_loss_check(finite_invalid_values(scan, root, catalog), findings, catalog)
        root = watchdog_spared_rank(late_rank_went_on(scan, keys, root, findings), findings, facts)
        root = came_late_to_the_collective(scan, keys, root, findings, facts.last_step)
        root = store_wait_after_progress(root, findings, facts, first_progress(stream_stats), catalog)
        root = own_server_port_taken(root, findings, catalog)
        root = rank0_model_differs(root, findings, facts.known)
        root = group_destroyed(root, {k.rank for k, s in stream_stats.items()
                                      if k.kind is StreamKind.RANK and s.last_step is not None}, catalog)
    if root is None:
        root = hangup_forwarded(findings, catalog)
    if root is None:
        context_lines = {(f.source, f.line) for f in findings if f.rule.role is Role.CONTEXT}
        root = unrecognised_exception(scan, keys, catalog, context_lines)
    if root is None and (failures or "traceback" in scan.block_kinds.values()):
        root = warning_root(findings)
    if root is None and failures:
        root = exit_only_root(failures, catalog)
    if root is not None and failures:
        root = same_error_in_summary(checkpoint_io(error_file_exception(root, failures, catalog), catalog), failures,
                                     catalog)
    if root is not None:
        root = gave_up_before_exit(scan, keys, writer_behind_readers(root, findings), catalog)
    if root is not None:
        root = exit_one_output_elsewhere(root, scan, stream_stats, failures, catalog)
    if root is None:
        root = cut_traceback(scan, keys, catalog)
    if root is None:
        root = teardown_only(findings)
    root = shared_gpu(root, findings, catalog)
    if root is not None:
        root = odd_start_rank(scan, keys, stopped_while_waiting(root, findings, _interrupted_frames(scan), catalog),
                              facts)
    verdict = Verdict.FAILED if root is not None else Verdict.OK
    if root is not None and (root.rule.id == STOPPED_WHILE_WAITING or root.rule.stuck):
        verdict = Verdict.HUNG
    elif root is not None and still_retrying(scan, root, findings):
        verdict = Verdict.HUNG
        root = replace(root, reasons=root.reasons + (
            "the log ends on the store client's note that it will try again: it was still retrying when the "
            "output stops, so the run hangs there (the store's host is gone or unreachable)",))
    notes: list[str] = []
    if root is None or root.rule.category in (Category.EXTERNAL_STOP, Category.UNKNOWN) or root.rule.role in (
            Role.EITHER, Role.CASCADE_CANDIDATE):
        # processes that never formed the group explain a start-up hang, a job stopped during
        # one, or a failure whose own cause the log does not hold or is ambiguous (a wrapper's
        # announcement, a consequence with nothing before it, an exit code) when ranks were claimed twice
        stopped = root is not None and root.rule.category is Category.EXTERNAL_STOP
        incomplete = world_incomplete(findings, catalog, root if stopped else None)
        if incomplete is not None and (root is None or stopped or incomplete.ranks):
            verdict = Verdict.FAILED if root is not None else Verdict.HUNG
            root = incomplete
    if root is None:
        root = waiting(findings, facts)
        if root is None and not scan.unreadable:   # output that stops where the input broke off says nothing
            finished = any(f.rule.id == FINISHED_RULE for f in findings)   # its NCCL teardown is no stall
            # the launcher's own word that every worker exited 0: uneven progress lines are no hang
            all_done = any(f.rule.id == FINISHED_RULE and _LAUNCHER_SUCCESS.search(f.text) for f in findings)
            uneven = None if all_done else behind_ranks_ended(scan, keys, hang_from_progress(facts, catalog), facts)
            root = uneven or (
                None if finished else stalled_in_nccl_init(scan, findings, facts, catalog))
        if root is not None:
            verdict = Verdict.HUNG
    if root is None:   # the log's end: an error no rule knows fails the run, else the output just stops
        tail = log_tail(scan, findings, facts)
        root = unknown_error_line(scan, keys, tail, catalog, frozenset((f.source, f.line) for f in findings))
        verdict = Verdict.FAILED if root is not None else Verdict.OK
        if root is None:
            root = stuck_after_warning(tail, findings) or output_stopped(scan, keys, tail, facts, catalog)
            if root is not None:
                root = late_rank_went_on(scan, keys, heartbeat_odd_one_out(scan, keys, root), findings)
            verdict = Verdict.HUNG if root is not None else Verdict.OK
    if verdict is Verdict.HUNG and root is not None:
        root = hang_answered_alone(root, notices, facts)
    recovered = None
    if verdict is Verdict.FAILED and root is not None:
        # a NaN the script printed and went on from is no recovery while a rank's last progress line
        # (or the last one no rank claims) still shows a non-finite value, or where the NaN itself is
        # printed at the last step: the run finished, training a broken model
        diverged = root.rule.category is Category.NUMERICAL and (any(
            _NON_FINITE.search(s.last_step_text) for k, s in stream_stats.items()
            if k.kind in (StreamKind.RANK, StreamKind.UNATTRIBUTED)) or (
            root.finding is not None and _AT_THE_LAST_STEP.search(root.finding.text) is not None))
        finish = restarted_then_finished(root, findings, failures, {k.attempt for k in keys})
        if finish is not None:
            recovered, root, verdict = root, None, Verdict.OK
            notes.append(f"torchrun restarted the workers after the failure at line {recovered.finding.line} "
                         f"and the run then finished (line {finish.line}): the job succeeded; that failure is "
                         f"reported as recovered")
        again = None if recovered else relaunched_then_finished(root, findings, failures, stream_stats)
        if again is not None:
            start, finish = again
            recovered, root, verdict = root, None, Verdict.OK
            notes.append(f"torchrun was started again after the failure at line {recovered.finding.line} (its "
                         f"workers' lines from line {start}), and that run finished (line {finish.line}) with no "
                         f"error: the job succeeded; that failure is reported as recovered")
        finish = None if recovered or diverged else caught_then_finished(
            root, findings, failures, {k.rank for k in keys if k.kind is StreamKind.RANK and k.rank >= 0})
        if finish is not None:
            recovered, root, verdict = root, None, Verdict.OK
            who = ("the agent then said its worker group succeeded" if finish.stream.kind is StreamKind.LAUNCHER
                   else "every rank then said it finished")
            notes.append(f"the script caught the failure at line {recovered.finding.line} and went on: {who} "
                         f"(line {finish.line}) and no worker exited with an error; that failure is reported as "
                         f"recovered (check what the run skipped)")
        if recovered is None and root is not None and not failures and not diverged \
                and _finished_after_every_error(findings, facts):
            root, verdict = None, Verdict.OK
            notes.append("every error in the log is one the program went on from (it said it retried, skipped or "
                         "fell back, or every rank printed it and trained on), and the run then finished")
    if scan.unreadable:
        notes.append("the input ended early (damaged or truncated): errors after that point are not in this report")
    chain = build_chain(root or recovered, findings)
    notes += _child_failed_notes(failures, root)
    env = collect_environment(scan.probes, scan.banner_lines, [s.name for s in scan.sources])
    streams = stream_statuses(stream_stats, findings, root or recovered, chain, verdict, failures)
    return Diagnosis(verdict, root, chain, tuple(findings), streams, tuple(keys), tuple(failures), env, tuple(notes),
                     recovered)


# a value printed as not finite (`loss nan`, `grad_norm=inf`, `'loss': -inf`)
_NON_FINITE = re.compile(r"(?i)(?<![\w.])[-+]?(?:nan|inf)(?![\w.])")
# a counter at its end (`8/8`, a tqdm bar's `100%|...| 8/8`): the line is the run's last step
_AT_THE_LAST_STEP = re.compile(r"(?<![\d/])(\d{1,9})/\1(?![\d/])")
# the agent's word that its worker group succeeded, or DeepSpeed's launcher's for one process
_LAUNCHER_SUCCESS = re.compile(f"{GROUP_SUCCEEDED.pattern}|Process \\d+ exits successfully")


def _finished_after_every_error(findings: list[Finding], facts: RankFacts) -> bool:
    """The log says the run finished after its last error, nothing of the launcher's says a worker
    failed, and every error is one the program went on from."""
    errors = [f for f in findings if f.is_error and not f.is_teardown]
    finishes = [f for f in findings if f.rule.id == FINISHED_RULE]
    if not errors or not finishes or max(f.seq for f in finishes) < max(f.seq for f in errors):
        return False
    if any(f.stream.kind is StreamKind.LAUNCHER for f in errors):
        return False
    return went_on_from_every_error(findings, facts)


def _interrupted_frames(scan: ScanResult) -> list[str]:
    """Innermost functions of tracebacks that were interrupted (KeyboardInterrupt) or cut short."""
    return [scan.block_last_frames[b] for b, kind in scan.block_kinds.items()
            if kind == "traceback" and b in scan.block_last_frames
            and "KeyboardInterrupt" in (scan.block_exceptions.get(b) or "KeyboardInterrupt")]


def _child_failed_notes(failures: list[ChildFailure], root: RootCause | None) -> list[str]:
    named = [f for f in failures if f.is_root_cause]
    if not named or root is None:
        return []
    entry = named[-1]
    what = f"exit code {entry.exitcode}" + (f" ({entry.signal})" if entry.signal else "")
    if entry.rank is not None and entry.rank in root.ranks and len(root.ranks) > 1:
        return [f"torchelastic's summary names rank {entry.rank} ({what}), one of the {len(root.ranks)} ranks "
                f"that raised the same error"]
    if root.rank is not None and entry.rank is not None and entry.rank != root.rank:
        return [f"torchelastic's summary names rank {entry.rank} ({what}) as the root cause; the evidence "
                f"points at rank {root.rank}: its summary picks the earliest exit at 1-second resolution"]
    return [f"torchelastic's summary names rank {entry.rank} ({what}) as the root cause"]
