"""Gloo's size check (`op.preamble.length <= op.nbytes. 130 vs 128`) aborts the rank that received more bytes than
it expected. That rank is the odd one when its tensor was the smaller; when the odd rank's tensor was the larger, its
ring neighbour aborts instead (the rank after it in an all_gather, the rank before it in an all_reduce). Real CPU
runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran) hold both cases and no line that tells them
apart, so the report keeps the aborting rank and names the one neighbour to compare with it."""

from __future__ import annotations

from sample_roots import root_cause

NOTE = "gloo's check aborts the rank that received more bytes than it expected"


def _note(rc: dict) -> str:
    return next(r for r in rc["reasons"] if r.startswith(NOTE))


def test_an_all_gather_abort_names_the_rank_before_it_as_the_other_suspect():
    # Lightning Fabric under torchrun, 4 ranks: rank 3 all_gathered 65 entries against 64, rank 0 aborted (`130 vs
    # 128`), the others' tracebacks end in all_gather
    rc = root_cause("vqae_codegather_np4_r3_plfabric")
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.size_mismatch", "collective_mismatch", 0)
    note = _note(rc)
    assert "rank 0 itself if its tensor was the smaller one" in note
    assert "rank 3, the rank before it in the all_gather's ring" in note


def test_an_all_reduce_abort_names_the_rank_after_it():
    # --tee 3, 3 ranks: rank 2 all_reduced its metrics as bfloat16 against float32 and aborted itself (`4 vs 2`):
    # the label is the aborting rank, which stays; the note names rank 0, the one after it in the ring
    rc = root_cause("amp_mixdtype_np3_r2_tee")
    assert (rc["rule_id"], rc["rank"]) == ("gloo.size_mismatch", 2)
    assert "rank 0, the rank after it in the all_reduce's ring" in _note(rc)


def test_no_note_where_the_ranks_own_lines_named_the_sender():
    # rank 2 alone printed torch.float64: the dtype reading names it, and no doubt is left to note
    rc = root_cause("prec_f64_np4_r2_plain")
    assert rc["rank"] == 2
    assert not any(r.startswith(NOTE) for r in rc["reasons"])


def test_no_note_with_two_ranks_where_both_neighbours_are_the_same_rank():
    rc = root_cause("rng_randbreak_np2_r1_plain")
    assert rc["rule_id"] == "gloo.size_mismatch"
    assert not any(r.startswith(NOTE) for r in rc["reasons"])
