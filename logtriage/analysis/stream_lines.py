"""One stream's lines in a span of an input, read back from the source with their launcher prefixes stripped (the
frames of a rank's traceback, a rank's progress after an error). No analysis module is imported here, so the
finding builders can use it too."""

from __future__ import annotations

from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.demux.streams import StreamKey
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult


def stream_messages(scan: ScanResult, keys: list[StreamKey], stream: StreamKey, source: int, first: int,
                    last: int) -> list[tuple[int, str]]:
    """(line number, message) of each line from `first` to `last` of `source` whose stream is `stream`."""
    index = scan.indexes[source]
    last = min(last, len(index.slots))
    numbers = [n for n in range(max(first, 1), last + 1) if keys[scan.slots.final(index.slots[n - 1])] == stream]
    texts = read_lines(scan.sources[source], index, numbers)
    return [(n, strip_prefixes(texts.get(n, ""), Dialect()).text.strip()) for n in numbers]
