"""An extension build that failed (env.build_ext_failed) because the compiler found an error in the
extension's own source, not because a tool or a header is missing: the compiler's `file:line:col:
error:` lines, printed in the message of `RuntimeError: Error building extension '...'`, name a file
that is no system or library header. That is a bug in the job's code, not its environment."""

from __future__ import annotations

import re

from logtriage.analysis.roots import RootCause, read_as
from logtriage.analysis.stopped import message_of
from logtriage.catalog.loader import Catalog
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult

BUILD_RULE = "env.build_ext_failed"
OWN_SOURCE_RULE = "python.extension_compile_error"
MESSAGE_REACH = 60   # lines of compiler output read below the build's exception line
# gcc/clang/nvcc: `path/main.cpp:10:70: error: ...` (not `fatal error:`, a missing header or an option)
_COMPILE_ERROR = re.compile(
    r"(?P<file>\S+\.(?:c|cc|cpp|cxx|cu|cuh|h|hh|hpp))[:(](?P<line>\d+)(?::\d+|\))?: error: (?P<what>.*)")
# headers and sources the job did not write: the system's, an installed package's, the toolkit's
_NOT_OWN = re.compile(r"^/usr/|/include/|site-packages/|dist-packages/|/cuda[-\d.]*/|/(?:ana|mini)conda\d*/")


def own_source_compile_error(scan: ScanResult, root: RootCause, catalog: Catalog) -> RootCause:
    """An extension build failure whose first compiler error is in the extension's own source."""
    found = root.finding
    if root.rule.id != BUILD_RULE or found is None or "Error building extension" not in found.text \
            or found.source >= len(scan.sources):
        return root
    numbers = list(range(found.line, found.line + MESSAGE_REACH))
    texts = read_lines(scan.sources[found.source], scan.indexes[found.source], numbers)
    error = next((m for n in numbers if (m := _COMPILE_ERROR.search(message_of(texts.get(n, ""))))), None) \
        or _COMPILE_ERROR.search(found.text)
    if error is None or _NOT_OWN.search(error["file"]):
        return root
    return read_as(root, catalog, OWN_SOURCE_RULE, (
        f"the compiler stopped on an error in the extension's own source ({error['file'].rsplit('/', 1)[-1]} line "
        f"{error['line']}: {error['what'][:100]}): the toolchain ran, the code does not compile"))
