"""A DataLoader worker that died while the main process fetched a batch it had put in shared memory: with the
default `file_descriptor` sharing strategy the main process asks the worker's resource sharer for the batch's file
descriptor (`rebuild_storage_fd` -> multiprocessing's `resource_sharer.py`), and a worker that is gone answers with
a reset connection: `ConnectionResetError: [Errno 104] Connection reset by peer` in multiprocessing's `connection.py`,
with no "DataLoader worker ... exited unexpectedly" line (the worker's SIGKILL, cpu_adhoc 500th and 508th batches).
The exception is the worker's death seen from the main process, not a network failure."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.exception_names import short_type
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.roots import RootCause
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult

WORKER_DIED_RULE = "data.loader_worker_died"
# the frames that make a reset connection the DataLoader's: its fetch, then the shared batch's file descriptor
_LOADER_FRAME = "torch/utils/data/dataloader.py"
_SHARER_FRAME = "multiprocessing/resource_sharer.py"
MAX_BLOCK_LINES = 400
_RESET = frozenset({"ConnectionResetError", "ConnectionRefusedError"})


def loader_worker_reset(scan: ScanResult, root: RootCause, catalog: Catalog) -> RootCause:
    f = root.finding
    if f is None or root.rule.category is not Category.PYTHON_EXCEPTION or short_type(f.exception_type) not in _RESET \
            or f.block_id not in scan.blocks:
        return root
    source, first, last = scan.blocks[f.block_id]
    if source >= len(scan.sources):
        return root
    numbers = range(first, min(last, first + MAX_BLOCK_LINES) + 1)
    text = "\n".join(read_lines(scan.sources[source], scan.indexes[source], list(numbers)).values())
    if _LOADER_FRAME not in text or _SHARER_FRAME not in text:
        return root
    rule = catalog.get(WORKER_DIED_RULE) or fallback_rule(
        WORKER_DIED_RULE, Category.CRASH_SIGNAL, "A DataLoader worker process died or was killed")
    return replace(root, rule=rule, reasons=(
        *root.reasons, f"the {short_type(f.exception_type)} is raised fetching a batch from a DataLoader worker "
        "(dataloader.py, then multiprocessing's resource_sharer.py asking the worker for the batch's shared "
        "memory): the worker was gone, killed or crashed, so its connection was reset"))
