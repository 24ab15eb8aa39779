"""The viewer's model (no Textual): the line index agrees with the scan's, search agrees with
itself at any size, split rows pair steps, exports carry the names the user gave."""

from __future__ import annotations

import os

import numpy as np
import pytest

from logtriage.api import run_triage
from logtriage.demux.prefixes import Dialect
from logtriage.tui.model import search as search_module
from logtriage.tui.model.align import BLANK, Basis, split_rows
from logtriage.tui.model.export import renamed
from logtriage.tui.model.lines import LineStore, extend_index, line_starts, open_head
from logtriage.tui.model.search import Query, matching_gids
from logtriage.tui.model.session import resolve, open_store, full_index, Progress
from logtriage.tui.model.streams import build_triaged
from logtriage.tui.model.text import display_text
from logtriage.tui.model.views import View
from test_tui_support import NP4, ROOT

SAMPLES = sorted((ROOT / "sample_logs").glob("*/*.log"))


def _store(*paths: str) -> LineStore:
    store = open_store(resolve(list(paths)))
    for index, offsets, size in full_index(store.snapshot(), Progress()):
        store.update(index, offsets, size)
    return store


@pytest.mark.parametrize("path", SAMPLES[::4], ids=lambda p: p.name)
def test_line_index_is_the_scans(path):
    store = _store(str(path))
    run = run_triage([str(path)])
    assert np.array_equal(store.sources[0].offsets, np.frombuffer(run.scan.indexes[0].offsets, np.int64))


@pytest.mark.parametrize("data", [b"", b"a", b"a\n", b"a\nb", b"\n\n", b"a\r\nb\r\n", b"x" * 70000 + b"\ny"])
def test_line_starts_edge_cases(tmp_path, data):
    path = tmp_path / "x.log"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        expected, offset = [], 0
        for line in data.splitlines(keepends=True):
            expected.append(offset)
            offset += len(line)
        assert line_starts(fd, 0, len(data)).tolist() == expected
        for cut in range(0, len(data) + 1, max(1, len(data) // 7)):       # indexed in two steps
            joined = np.concatenate((line_starts(fd, 0, cut)[line_starts(fd, 0, cut) < cut],
                                     line_starts(fd, cut, len(data))))
            head = [s for s in expected if s < cut]
            assert joined.tolist()[:len(head)] == head
            assert joined.tolist() == expected            # the second step's lines too
    finally:
        os.close(fd)


def test_head_then_growth_then_truncation(tmp_path):
    path = tmp_path / "grow.log"
    path.write_bytes(b"[rank0]: one\n[rank0]: two\n[rank1]: thr")
    source = open_head("grow.log", str(path))
    assert source.offsets.tolist() == [0, 13, 26]
    with open(path, "ab") as out:
        out.write(b"ee\n[rank1]: four\n")
    offsets, size = extend_index(source)
    assert offsets.tolist() == [0, 13, 26, 41] and size == os.path.getsize(path)
    store = LineStore([source])
    store.update(0, offsets, size)
    assert [store.text(g) for g in range(store.total)] == ["one", "two", "three", "four"]
    path.write_bytes(b"new\n")
    offsets, size = extend_index(store.sources[0])
    assert offsets.tolist() == [0] and size == 4


def test_display_text_strips_prefixes_and_shows_controls():
    dialect = Dialect()
    assert display_text(b"[default0]:[rank3]: loss 1.0", dialect) == "loss 1.0"
    assert display_text(b"a\rb\rdone\r", dialect) == "done"
    assert display_text(b"\x1b[32mok\x1b[0m \x1b]0;t\x07 \x00", dialect) == "ok \\x1b]0;t\\x07 \\x00"
    assert display_text("tab\there".encode(), dialect) == "tab     here"
    assert display_text(b"\xff\xfe latin", dialect) == "\u00ff\u00fe latin"


def test_query_parse_smart_case_literals_and_bad_regex():
    assert Query.parse("error").matches("RuntimeError: x")
    assert not Query.parse("Error").matches("runtimeerror")
    assert Query.parse("a.c").matches("abc") and not Query.parse("a.c").literal
    bad = Query.parse("batch[")
    assert bad.literal and bad.matches('batch["target"]')
    assert Query.parse("loss").spans("loss Loss LOSS") == [(0, 4), (5, 9), (10, 14)]


@pytest.mark.parametrize("few", [0, 20_000], ids=["arrays", "find"])
@pytest.mark.parametrize("pattern", ["loss", "Traceback", "gloo.*closed", "rank2", "SIGTERM", "(?:step|iter) \\d",
                                     "STEP", "e"])
def test_search_by_raw_blocks_agrees_with_line_by_line(monkeypatch, pattern, few):
    store = _store(NP4)
    view = View.every_line("all", store.total)
    direct = matching_gids(store, view, Query.parse(pattern))
    monkeypatch.setattr(search_module, "DIRECT_LIMIT", 0)
    monkeypatch.setattr(search_module, "FEW_MATCHES", few)         # literals: by find, or by array comparison
    monkeypatch.setattr(search_module, "CHUNK", 1000)              # many blocks, lines cut at block ends
    by_blocks = matching_gids(store, view, Query.parse(pattern))
    expected = [g for g in range(store.total) if Query.parse(pattern).matches(store.text(g))]
    assert direct.tolist() == by_blocks.tolist() == expected


def test_views_subset_and_rows():
    every = View.every_line("all", 10)
    odd = every.subset("odd", np.array([1, 3, 5, 7, 9, 11]))
    assert odd.count == 5 and odd.row_of(7) == 3 and odd.row_of(4) is None
    assert odd.rows_of(np.array([3, 4, 9])).tolist() == [1, 4]
    shuffled = View.of("time", np.array([5, 1, 9, 3]), ordered=False)
    assert shuffled.row_of(9) == 2 and shuffled.rows_of(np.array([1, 3])).tolist() == [1, 3]
    assert shuffled.subset("x", np.array([3, 5])).all_gids().tolist() == [5, 3]


def test_split_rows_pair_lines_of_the_same_step():
    texts = {1: "step 1 loss", 2: "a", 3: "step 2 loss", 4: "boom",
             11: "step 1 loss", 12: "step 2 loss", 13: "b", 14: "c"}
    rows = split_rows(np.array([1, 2, 3, 4]), np.array([11, 12, 13, 14]), lambda g: texts[g].encode(),
                      texts.__getitem__)
    assert rows.basis is Basis.STEP
    assert list(zip(rows.left.tolist(), rows.right.tolist())) == [(1, 11), (2, BLANK), (3, 12), (4, 13), (BLANK, 14)]
    letters = {1: "a", 3: "b", 5: "c"}
    plain = split_rows(np.array([1, 5]), np.array([3]), lambda g: letters[g].encode(), letters.__getitem__)
    assert plain.basis is Basis.INPUT and plain.left.tolist() == [1, BLANK, 5] and plain.right.tolist() == [BLANK, 3, BLANK]


def test_triaged_streams_cover_every_line_and_mark_the_chain():
    store = _store(NP4)
    t = build_triaged(run_triage([NP4]), store)
    assert sum(r.lines for r in t.rows) == store.total == 117
    assert int((t.stream_of_line >= 0).sum()) == 117
    root = t.rows[t.root_stream]
    assert (root.label, store.line_number(t.root_gid)) == ("rank 2", 24)
    assert {m.value for m in t.marks.values()} >= {"initiating", "cascade", "teardown"}
    assert [f.rule.id for f in t.findings if f.in_chain][:2] == ["python.exception", "gloo.connection_closed"]


def test_renamed_report_names_stdin():
    report = run_triage([NP4]).report
    out = renamed(report, {NP4: "<stdin>"})
    assert out.root_cause.source == "<stdin>" and out.sources == ("<stdin>",)
    assert all(e.source == "<stdin>" for e in out.root_cause.evidence)
    assert all(c.source == "<stdin>" for c in out.chain)
