"""When each candidate for the root began, and which of a rank's signs came first: the error a rank
logged before its traceback was printed, a non-finite loss before the grad norm that followed it,
a rank's own error before the launcher's report of the signal it died of."""

from __future__ import annotations

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import earliest
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKind

LOGGED_RULE = "python.logged_error"


def from_first_logged_sign(roots: list[Finding], live: list[Finding]) -> tuple[list[Finding], dict[int, Finding]]:
    """A rank's failure starts at the error it logged first (`[rank 3] ERROR step 2 failed (KeyError);
    writing an emergency checkpoint before exiting`, or its own `loss is nan, stopping`), not where
    its traceback was printed after a slow cleanup, or never, the launcher stopping it first.
    Returns the candidates, with a rank's
    logged error among them where it came before every candidate and its rank has none of its own,
    and for each candidate (by id) the earlier logged error of its rank that dates it."""
    signs: dict[int, Finding] = {}
    for f in live:
        said = f.rule.id == LOGGED_RULE or (f.category is Category.NUMERICAL and f.role is Role.EITHER)
        if said and f.rank is not None and f.attributed_by != "launcher" and (
                f.rank not in signs or earliest([f, signs[f.rank]]) is f):
            signs[f.rank] = f
    if not signs or not roots:
        return roots, {}
    onset = {id(r): signs[r.rank] for r in roots
             if r.rank in signs and signs[r.rank] is not r and earliest([signs[r.rank], r]) is signs[r.rank]}
    first = earliest([onset.get(id(r), r) for r in roots])
    own = {r.rank for r in roots}
    # a rank whose own later error is a consequence (its logged `step failed` announced a lost peer) is no sign
    consequence = {f.rank for f in live if f.role is Role.CASCADE_CANDIDATE and f.rank in signs
                   and earliest([signs[f.rank], f]) is signs[f.rank]}
    early = [sign for rank, sign in signs.items()
             if rank not in own and rank not in consequence and earliest([sign, first]) is sign]
    return roots + early, onset


def numerical_signs_first(roots: list[Finding], live: list[Finding]) -> list[Finding]:
    """A NaN reading logged (a non-finite grad norm) after its stream already printed a non-finite
    loss reports that loss's consequence: the loss's line, the first sign, stands in for it (a loss
    that diverged to inf, then the gradients did). A check that raised (`clip_grad_norm_`'s
    error_if_nonfinite) stays the root: it is what ended the rank."""
    out: list[Finding] = []
    for root in roots:
        if root.category is Category.NUMERICAL and not root.exception_type:
            signs = [f for f in live if f.role is Role.EITHER and f.category is Category.NUMERICAL
                     and f.stream == root.stream and f.seq < root.seq]
            root = min(signs, key=lambda f: f.seq) if signs else root
        if all(root is not f for f in out):
            out.append(root)
    return out


def reports_death_after_own_error(finding: Finding, live: list[Finding]) -> bool:
    """A launcher's or scheduler's report that a rank died of a signal (srun's `task 4: Segmentation
    fault`, mpirun's `process rank 4 ... exited on signal 11`) after that rank printed an error of
    its own: the report confirms how the rank ended, the rank's own error says why."""
    if finding.category is not Category.CRASH_SIGNAL or finding.rank is None \
            or finding.attributed_by not in ("capture", "launcher") or finding.stream.kind is StreamKind.RANK:
        return False
    return any(other.rank == finding.rank and other.stream.kind is StreamKind.RANK and other.seq < finding.seq
               and other.category is not Category.CRASH_SIGNAL for other in live)
