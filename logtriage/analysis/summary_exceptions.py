"""What the launcher's ChildFailedError summary adds to a root that is an exception: a worker's
error file (`@record`) names the exception of a worker that printed nothing else, and error files
that hold the root's own exception on several ranks make it one cause on all of them."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.childfailed import ChildFailure
from logtriage.analysis.exception_names import exception_type_of, short_type
from logtriage.analysis.findings import Finding, mask_numbers
from logtriage.analysis.roots import RootCause
from logtriage.catalog.loader import Catalog
from logtriage.catalog.matcher import match_line
from logtriage.catalog.rule import Role
from logtriage.demux.streams import StreamKey, StreamKind


def error_file_exception(root: RootCause, failures: list[ChildFailure], catalog: Catalog) -> RootCause:
    """A worker that exited with a code and printed nothing the log holds, whose ChildFailedError
    entry shows its error file's traceback (`@record`): that exception is the worker's failure."""
    if root.rule.id != "signal.exit_nonzero":
        return root
    failure = next((f for f in failures if f.exception and f.exception_line is not None
                    and (root.rank is None or f.rank == root.rank)), None)
    if failure is None:
        return root
    # the exception as the catalog reads it (MemoryError is host memory), else by its type
    # (not as a launcher's exit notice: a CalledProcessError in a worker's own error file is the
    # worker's child process failing, whatever command it ran)
    hit = next((h for h in match_line(catalog, failure.exception)
                if h.rule.role in (Role.ROOT_CANDIDATE, Role.EITHER) and not h.rule.teardown
                and h.rule.id != "signal.exit_nonzero"), None)
    rule = hit.rule if hit is not None else catalog.get("python.exception")
    if rule is None:
        return root
    kind = exception_type_of(failure.exception) or "Exception"
    captures = {**(hit.captures if hit is not None else {}), "exception_type": kind}
    finding = Finding(rule, captures, failure.source, failure.exception_line, StreamKey(StreamKind.LAUNCHER),
                      failure.rank, failure.exception, -1, 0, None, "launcher", failure.exception)
    ranks = (failure.rank,) if failure.rank is not None else ()
    return RootCause(rule, finding, failure.rank, ranks, 0.6, (
        f"rank {failure.rank} exited with code {failure.exitcode}; the launcher's summary shows its error file: "
        f"{kind}",))


SHARED_MESSAGE_CHARS = 120   # how much of two exceptions' messages must agree (numbers masked)


def same_error_in_summary(root: RootCause, failures: list[ChildFailure], catalog: Catalog) -> RootCause:
    """The launcher's summary shows each failed worker's error file (`@record`). Workers whose
    error file holds the very exception the root reports, or an error the root's rule reads
    (every rank out of GPU memory, each at its own size), failed alike: one cause on several
    ranks, though the console (`--local-ranks-filter`, a cut paste) showed only one of them."""
    f = root.finding
    if f is None or not any(fl.exception for fl in failures):
        return root
    own = _exception_key(f.text) or _exception_key(f.block_exception)
    sharing = {fl.rank for fl in failures if fl.rank is not None and fl.exception and (
        (own is not None and _exception_key(fl.exception) == own)
        or any(h.rule.id == root.rule.id for line in (fl.exception, *fl.message.splitlines())
               for h in match_line(catalog, line)))}
    ranks = tuple(sorted(sharing | set(root.ranks) | ({root.rank} if root.rank is not None else set())))
    if len(sharing) < 2 or ranks == tuple(sorted(root.ranks)):
        return root
    return replace(root, ranks=ranks, rank=root.rank if root.rank is not None else ranks[0], reasons=root.reasons + (
        f"the launcher's summary shows the same exception in the error files of {len(sharing)} ranks",))


def _exception_key(text: str) -> tuple[str, str] | None:
    """An exception line's short type and the start of its message, numbers masked."""
    kind = short_type(exception_type_of(text or ""))
    if not kind:
        return None
    message = text.split(": ", 1)[1] if ": " in text else ""
    return kind, mask_numbers(message.strip())[:SHARED_MESSAGE_CHARS]
