"""Second readings of a root in the process group's store: a store timeout after the group
formed is a peer late to a barrier, a collective or the program's own handshake (its culprit the
rank missing from the waits, or the one that addressed a rank outside the world); a lost store
while fetching NCCL's unique id points at the rank that hosted it; a port clash in the program's
own server, once the group runs, is the host's, not the rendezvous'."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RankFacts, RootCause, read_as
from logtriage.analysis.signal_readings import exit_rule
from logtriage.analysis.timeouts import STORE_WAIT_RULE, missing_rank_root
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category


UNIQUE_ID_STORE_RULE = "nccl.unique_id_store"
# the store's connection went away (not a wait that timed out: that rank was late, not gone)
_STORE_LOST = ("Connection reset by peer", "Broken pipe", "Failed to recv", "failed to recv")


def unique_id_host_left(root: RootCause, catalog: Catalog) -> RootCause:
    """Only consequences, the first a rank losing the store while fetching NCCL's unique id from
    rank 0 (`store->get('0') got error: Connection reset by peer`): rank 0, which publishes the id
    and here hosts the store, went away before its peers read it, without a message in this log."""
    f = root.finding
    if root.rule.id != UNIQUE_ID_STORE_RULE or f is None or not f.captures.get("peer", "").isdigit() \
            or not any(s in f.captures.get("reason", "") for s in _STORE_LOST):
        return root
    peer = int(f.captures["peer"])
    return RootCause(exit_rule(catalog), f, peer, (peer,), 0.35, (
        f"rank {f.rank if f.rank is not None else '?'} lost the store while fetching NCCL's unique id from rank "
        f"{peer} ({f.captures['reason']}): rank {peer} went away first, and its own error is not in this log",))


STORE_TIMEOUT_RULES = frozenset({STORE_WAIT_RULE, "dist.store_connect_timeout"})
STORE_WAIT_IN_COLLECTIVE = "dist.store_wait_in_collective"


# the store key of a rank's address that gloo's connectFullMesh waits for while the default group
# forms (`/default_pg/0//cpu//0/3`, inside init_process_group)
_DEFAULT_GROUP_MESH = re.compile(r"^/default_pg/0//(?:cpu|cuda)//\d+/(\d+)$")   # (the peer whose address it is)


# the elastic agents' own rendezvous keys (`/torch.rendezvous.none.1/MASTER_ADDR`): agents re-forming the job
# (a node joining or leaving), whatever progress the workers had printed, not a worker's collective
_AGENTS_RENDEZVOUS_KEY = re.compile(r"^/?torch\.rendezvous\.")


# the c10d functions that wait in the store while a group forms (a wait in any other, a send or
# a collective, comes after the group formed)
_FORMING = frozenset({"init_process_group", "_new_process_group_helper", "new_group", "new_subgroups",
                      "_store_based_barrier", "_init_process_group", "init_device_mesh", "split_group"})


# a subgroup's own key in the default group's store (`/default_pg/0//4//cpu//0/1`: group 4's mesh, as
# new_group connects it): the default group is up, and the ranks' new_group calls did not line up
_SUBGROUP_KEY = re.compile(r"^/default_pg/\d+//\d+//")


def _group_formed_wait(findings: list[Finding]) -> bool:
    """A store wait that can only come after the default group formed: in a c10d send or collective
    (gloo connecting lazily to its peer), for a subgroup's key, or the program's own key in the
    default group's store (`/default_pg/0//job/ready`: its `store.wait` or hand-made barrier, not
    gloo's address keys)."""
    for w in findings:
        if w.rule.id not in STORE_TIMEOUT_RULES:
            continue
        keys = w.captures.get("keys", "")
        if w.collective and w.collective not in _FORMING:
            return True
        if _SUBGROUP_KEY.match(keys):
            return True
        if not w.collective and keys.startswith("/default_pg/") and not any(
                _DEFAULT_GROUP_MESH.search(k.strip()) for k in keys.split(",") if k.strip()):
            return True
    return False


def _addressed_outside_world(findings: list[Finding], facts: RankFacts) -> tuple[int, int] | None:
    """(waiter, peer) where one rank's store wait was for the address of a rank past the world's
    last (`/default_pg/0//cpu//0/4` in a 4-rank job): gloo connects lazily to a send's peer."""
    if not facts.known:
        return None
    world = max(facts.known) + 1
    found = {(w.rank, int(m.group(1))) for w in findings if w.rule.id in STORE_TIMEOUT_RULES and w.rank is not None
             for m in [_DEFAULT_GROUP_MESH.match(w.captures.get("keys", "").rstrip(","))] if m and int(m.group(1)) >= world}
    return found.pop() if len(found) == 1 else None


def store_wait_after_progress(root: RootCause, findings: list[Finding], facts: RankFacts,
                              first_progress: tuple[int, int] | None, catalog: Catalog) -> RootCause:
    """A store timeout after the run printed training progress, or in a wait that only a formed
    group makes: the group formed before, so the wait was for a peer in a barrier, a collective or
    the program's own store handshake (busy with rank-0-only work, gone, or never setting the key),
    a collective timeout whose culprit is the rank missing from the waits."""
    f = root.finding
    if f is None or root.rule.id not in STORE_TIMEOUT_RULES or any(
            _AGENTS_RENDEZVOUS_KEY.match(w.captures.get("keys", ""))
            for w in findings if w.rule.id in STORE_TIMEOUT_RULES):
        return root
    formed = _group_formed_wait(findings)
    if not formed and (first_progress is None or first_progress > (f.source, f.line)):
        return root
    if not formed and max(facts.last_step.values(), default=0) <= 0 and any(
            _DEFAULT_GROUP_MESH.search(w.captures.get("keys", "")) for w in findings if w.rule.id in STORE_TIMEOUT_RULES):
        return root     # the default group forming: a `step 0/6 init_process_group(...)` line is no training yet
    rule = catalog.get(STORE_WAIT_IN_COLLECTIVE)
    if rule is None:
        return root
    outside = _addressed_outside_world(findings, facts)
    if outside is not None:
        waiter, peer = outside
        return replace(root, rule=rule, rank=waiter, ranks=(waiter,), confidence=min(root.confidence, 0.6), reasons=(
            f"rank {waiter} waited in the store for the address of rank {peer}, which is not in this "
            f"{len(facts.known)}-rank job: it sent to (or received from) a rank outside the world, and its "
            "peers timed out waiting for what it never sent",))
    live = [w for w in findings if w.is_error and not w.is_teardown]
    # the others' collective timeouts are waits too (a rank in the store waiting for a peer of its
    # send, the rest in their all-reduce waiting for it)
    waits = [w for w in findings if w.rule.id in STORE_TIMEOUT_RULES
             or (w.is_error and not w.is_teardown and w.category is Category.COLLECTIVE_TIMEOUT
                 and w.rank is not None)]
    missing = missing_rank_root(waits, live, facts, findings)
    why = ("the store wait was in a send, a collective or the program's own keys, which only a formed group "
           "makes" if formed else "the store timed out after the run had printed training progress")
    return replace(missing, rule=rule, finding=f, reasons=(
        f"{why}: the process group had formed, so this was a wait for a peer in a barrier, a collective or a "
        "handshake of the program's own, not a start-up failure",) + missing.reasons)


PORT_IN_USE_RULE = "dist.port_in_use"
OWN_PORT_RULE = "host.port_taken"


def own_server_port_taken(root: RootCause, findings: list[Finding], catalog: Catalog) -> RootCause:
    """`EADDRINUSE` raised in a worker's own code (its innermost frame is not torch's) while its
    peers wait in a collective that only a formed group runs (a barrier, an all-reduce): the
    program's own server (a TCPStore of its own, a metrics endpoint) met a port another process
    holds. Not the launcher's master port, whose clash comes before any group exists."""
    f = root.finding
    if root.rule.id != PORT_IN_USE_RULE or f is None or f.rank is None or not f.last_frame \
            or "/torch/" in f.last_file or "site-packages/" in f.last_file:
        return root
    if not any(w.collective and w.collective not in _FORMING for w in findings if w.rank != f.rank):
        return root
    return read_as(root, catalog, OWN_PORT_RULE, (
        f"the port clash is raised in the job's own `{f.last_frame}` ({f.last_file}), not in torch's rendezvous, "
        "while the other ranks were already in a collective: the process group had formed, and the port that "
        "another process holds is one the program's own server binds"))
