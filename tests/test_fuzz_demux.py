"""Property tests of the demuxer's pieces on log-like lines (tests/fuzz/strategies.py): decoding
and cleaning never fail and leave no control characters, prefix stripping only removes a
prefix, splitting glued lines never drops or duplicates text, and the assigner gives every
piece exactly one slot."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from logtriage.demux.assigner import Assigner
from logtriage.demux.line_marks import pieces_of
from logtriage.demux.clean import clean, decode
from logtriage.demux.launcher import LauncherFacts
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.demux.split import split_glued
from logtriage.demux.streams import SlotTable, StreamKind
from tests.fuzz.budget import TRIED, fuzz_settings, report_tried
from tests.fuzz.strategies import damaged_lines, log_bytes, physical_lines, prefixed_lines

CLEAN_LEFTOVERS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
TEXT_LINES = st.one_of(prefixed_lines(), damaged_lines().map(lambda raw: clean(decode(raw))),
                       st.text(max_size=200))
DIALECTS = (Dialect(), Dialect(srun=True, hosts=frozenset({"node-1", "gpu187", "h"})))


@pytest.fixture(scope="module", autouse=True)
def _tried(request):
    yield
    report_tried(request, "demux.")


@fuzz_settings(1000)
@example(b"\x9b\x1b[31mTraceback (most recent call last):")   # found: a stray C1 CSI hid the Traceback
@given(st.one_of(damaged_lines(), st.binary(max_size=300).map(lambda raw: raw.replace(b"\n", b""))))
def test_decode_and_clean_never_fail_and_leave_no_controls(raw):
    TRIED["demux.decode_clean"] += 1
    text = decode(raw)
    assert not re.search(r"[\ud800-\udfff]", text)          # no surrogates: JSON-safe
    assert len(text) <= len(raw)                            # no byte lost, none doubled
    cleaned = clean(text)
    assert CLEAN_LEFTOVERS.search(cleaned) is None, repr(cleaned)
    assert clean(cleaned) == cleaned                        # idempotent


@fuzz_settings(1500)
@given(TEXT_LINES)
def test_splitting_glued_lines_never_drops_or_duplicates_text(line):
    TRIED["demux.split_glued"] += 1
    parts = split_glued(line)
    assert "".join(parts) == line
    assert parts and all(parts) or parts == [line]


@fuzz_settings(1500)
@given(TEXT_LINES)
def test_prefix_stripping_only_removes_a_prefix(line):
    TRIED["demux.strip_prefixes"] += 1
    for dialect in DIALECTS:
        p = strip_prefixes(line, dialect)
        assert line.endswith(p.text)
        for value in (p.rank, p.local_rank):
            assert value is None or 0 <= value < 10**12


@fuzz_settings(400)
@given(log_bytes(), st.sampled_from([None, 0, 3]), st.sampled_from([None, 1]))
def test_assigner_gives_every_piece_one_slot(data, rank_hint, attempt_hint):
    TRIED["demux.assigner"] += 1
    slots = SlotTable()
    for kind in StreamKind:
        slots.fixed(kind)
    facts = LauncherFacts()
    lines = [clean(decode(raw)) for raw in physical_lines(data)]
    dialect = Dialect.detect(lines)
    assigner = Assigner(slots, facts, dialect, rank_hint, attempt_hint)
    for line in lines:
        parts = assigner.feed(line)
        pieces = pieces_of(line, dialect)
        assert len(parts) == len(pieces)
        for piece, part in zip(pieces, parts):
            assert piece.endswith(part.text)
            assert 0 <= part.slot < len(slots.keys)
    assigner.close()
    keys = slots.resolve(facts.pid_to_rank(), facts.attempt_of_segment)
    assert len(keys) == len(slots.keys)
    for slot in range(len(slots.keys)):
        assert 0 <= slots.final(slot) < len(slots.keys)
