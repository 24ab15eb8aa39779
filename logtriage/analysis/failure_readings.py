"""The failure the evidence points at first (`choose_root`), then read again in the light of the rest of
the log, reading by reading: a rank's silent death before it, a node's exit over its tasks', a peer that
left, a stop by the scheduler whose waits, stalls and progress say what was already wrong, the rank the
launcher or a size abort names, a numerical check of the program's own. Each reading keeps the root or
replaces it, with its reason."""

from __future__ import annotations

from logtriage.analysis.abort_rank import launcher_named_rank
from logtriage.analysis.diverged import different_collectives_at_one_seq
from logtriage.analysis.early_stop import stopped_early_peer
from logtriage.analysis.evidence import Evidence
from logtriage.analysis.exceptions import checkpoint_io, probe_json_without_banner
from logtriage.analysis.frame_readings import frame_reading
from logtriage.analysis.ext_build import own_source_compile_error
from logtriage.analysis.findings import Finding, srun_tasks_are_nodes
from logtriage.analysis.gave_up import gave_up_before_its_peers
from logtriage.analysis.hangs import finished_then_stopped
from logtriage.analysis.interrupted_work import stopped_mid_work, waits_the_stop_ended
from logtriage.analysis.invalid_values import finite_invalid_values, own_loss_check
from logtriage.analysis.loader_ipc import loader_worker_reset
from logtriage.analysis.lone_notice import notice_ended_hang
from logtriage.analysis.loss_outlier import loss_outlier_rank, shared_nan_then_one_check
from logtriage.analysis.odd_dtype import size_abort_sender, sized_by_mismatch
from logtriage.analysis.rank_facts import first_progress
from logtriage.analysis.refine import (PEER_LEFT_RULES, abort_after_dump_signal, oom_device_rank, peer_that_left,
                                      peers_over_node_exit)
from logtriage.analysis.roots import RootCause
from logtriage.analysis.rootcause import choose_root
from logtriage.analysis.rpc_origin import remote_origin
from logtriage.analysis.rule_readings import (bootstrap_layout_mismatch, dcp_named_ranks, group_destroyed,
                                              oom_on_shared_gpu, rank0_model_differs, spawn_report_yields,
                                              timer_reaped, unresolved_host, waited_for_a_crash)
from logtriage.analysis.signal_readings import sigkill_on_gpu_job, stop_after_task_failure, stop_for_memory
from logtriage.analysis.silent_first import silent_death_first
from logtriage.analysis.stack_dumps import dumps_then_timeouts
from logtriage.analysis.stalls import (came_late_to_the_collective, heartbeats_before_stop, late_rank_went_on,
                                       time_limit_ended_hang, watchdog_spared_rank)
from logtriage.analysis.stopped import stalled_before_stop
from logtriage.analysis.store_waits import own_server_port_taken, store_wait_after_progress, unique_id_host_left
from logtriage.analysis.validity import refused_result_first
from logtriage.analysis.waiting_lines import (stopped_after_one_went_on, stopped_before_all_stepped,
                                             stopped_in_startup, stopped_in_stride, stopped_with_uneven_progress,
                                             waiting_before_stop)
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKind

__all__ = ["read_failure"]


def read_failure(ev: Evidence) -> RootCause | None:
    """The failure the log's errors point at, read again against the rest of the log; None when no error
    of the catalog's points at one."""
    root = choose_root(ev.findings, ev.facts)
    if root is None:
        return None
    scan, keys, findings, facts, catalog = ev.scan, ev.keys, ev.findings, ev.facts, ev.catalog
    root = silent_death_first(spawn_report_yields(root, findings), findings, facts)
    if srun_tasks_are_nodes(scan, ev.failures):
        root = peers_over_node_exit(root, findings)
    if root.rule.id in PEER_LEFT_RULES:
        root = stopped_early_peer(scan, keys, peer_that_left(root, findings, facts, catalog), facts)
        root = gave_up_before_its_peers(scan, keys, root, findings, catalog)
    if root.rule.role is Role.CASCADE_CANDIDATE:
        root = unique_id_host_left(root, catalog)
    root = remote_origin(sized_by_mismatch(root, findings), findings, facts)
    ray = scan.facts.ray_workers or any(".ray_" in f.rule.id for f in findings)   # Ray: a GPU per worker
    root = launcher_named_rank(root, findings)
    root = oom_device_rank(root, scan.multi_node or any(k.host for k in keys), ray)
    root = oom_on_shared_gpu(root, len(facts.known), catalog)
    if root.rule.category is Category.EXTERNAL_STOP:
        root = _read_stop(ev, root)
    root = timer_reaped(waited_for_a_crash(refused_result_first(root, findings), findings), findings)
    if root.rule.id == "signal.sigkill" and not scan.cpu_backend:
        root = sigkill_on_gpu_job(root, findings, catalog, _gpu_job(findings))
    root = own_source_compile_error(scan, unresolved_host(root, findings), catalog)
    if root.rule.id == "nccl.invalid_rank":
        root = bootstrap_layout_mismatch(root, catalog)
    root = abort_after_dump_signal(checkpoint_io(frame_reading(root, catalog), catalog), findings)
    root = loader_worker_reset(scan, root, catalog)
    root = dcp_named_ranks(root, findings, scan.block_exceptions)
    root = probe_json_without_banner(root, bool(scan.banner_lines), catalog)
    root = size_abort_sender(different_collectives_at_one_seq(root, findings, catalog), scan, keys, findings,
                             facts.known, facts.last_step)
    root = loss_outlier_rank(scan, keys, shared_nan_then_one_check(scan, keys, root, findings))
    root = own_loss_check(finite_invalid_values(scan, root, catalog), findings, catalog)
    root = dumps_then_timeouts(scan, root, findings, facts)
    root = watchdog_spared_rank(late_rank_went_on(scan, keys, root, findings), findings, facts)
    root = came_late_to_the_collective(scan, keys, root, findings, facts.last_step)
    root = store_wait_after_progress(root, findings, facts, first_progress(ev.stream_stats), catalog)
    root = own_server_port_taken(root, findings, catalog)
    root = rank0_model_differs(root, findings, facts.known)
    stepped = {k.rank for k, s in ev.stream_stats.items() if k.kind is StreamKind.RANK and s.last_step is not None}
    return group_destroyed(root, stepped, catalog)


def _read_stop(ev: Evidence, root: RootCause) -> RootCause:
    """The scheduler or a person stopped the job: what the log says was already wrong when the stop came
    (a task that failed first, memory, a stall, waits, uneven progress, a hang the time limit ended)."""
    scan, keys, findings, facts, catalog = ev.scan, ev.keys, ev.findings, ev.facts, ev.catalog
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
    root = notice_ended_hang(scan, root, findings, ev.notices, facts, catalog)
    return waits_the_stop_ended(stopped_mid_work(scan, keys, root, catalog), findings, facts.known, catalog)


def _gpu_job(findings: list[Finding]) -> bool:
    """Whether anything in the log is a GPU's: a finding of NCCL or CUDA, or of a GPU's memory or runtime."""
    return any(f.rule.id.startswith(("nccl.", "cuda.")) or f.category in (Category.GPU_OOM, Category.CUDA_RUNTIME)
               for f in findings)
