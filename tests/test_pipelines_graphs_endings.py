"""Pipeline stages, graph partitions, fake-quant training, model averaging and the end of training, on real CPU
runs of torch 2.13 (sample_logs/cpu_adhoc, the 109th-113th batches, each labelled before triage ran; the test
names the run)."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from sample_roots import SAMPLES, root_facts, verdict_and_root


@pytest.mark.parametrize("slug, line", [
    # rank 0's torch.export.export of a model with data-dependent control flow, while the others wait in the
    # final barrier and time out (or lose rank 0): the exception's class ends in neither Error nor Exception
    ("final_exportdyn_np4_r0_plain", 275),
    ("final_exportdyn_np6_r0_tee_trainer", 309),
])
def test_torch_exports_data_dependent_guard_is_the_ranks_exception(slug, line):
    assert root_facts(slug) == ("python.exception", "python_exception", 0, line,
                                "torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode")


@pytest.mark.parametrize("slug", ["final_gate_np4_r0_plain", "final_gate_np4_r0_loglevel"])
def test_a_release_gate_on_the_final_accuracy_is_the_refused_result_of_the_one_rank_that_exited(slug):
    # `RELEASE GATE FAILED: eval accuracy 0.844 < min_acc 60 (...); artifacts in ... are not published`, no rank
    # prefix, then rank 0 alone exits 1: the gate is the root and rank 0 the rank
    assert verdict_and_root(slug) == ("failed", "perf.result_invalid", "performance_validity", 0)


def test_a_gate_that_every_rank_exited_on_names_no_rank():
    # three ranks exit 4 after the exclusive-window gate (an earlier batch): no one rank is named
    assert verdict_and_root("bench_window_np4_rall_plain") == (
        "failed", "perf.no_exclusive_window", "performance_validity", None)


@pytest.mark.parametrize("slug", ["avg_fp16_np4_rall_plain", "avg_zerocount_np4_r1_plain"])
def test_a_checked_model_with_non_finite_values_after_averaging_is_numerical(slug):
    # `FloatingPointError: round 0: global model has non-finite values after aggregation (...)`
    assert root_facts(slug)[:2] == ("numerical.checked_nonfinite", "numerical")


@pytest.mark.parametrize("slug, rank", [
    # rank N alone warns `WARNING rank N: batch 14 is not a multiple of micro-batch 4; dropping the last 2
    # samples (3 micro-batches)`, sends one micro-batch fewer, and its next stage times out waiting for it
    ("stage_shortmb_np4_r0_plain", 0),
    ("stage_shortmb_np6_r2_loglevel", 2),
])
def test_the_one_rank_that_warned_at_start_is_where_an_unnamed_timeout_began(slug, rank):
    assert verdict_and_root(slug) == ("failed", "gloo.timeout", "collective_timeout", rank)


def test_a_warning_every_rank_printed_names_no_rank(tmp_path):
    # the same run with rank 1 printing the same warning (its own number): no rank alone warned
    text = (SAMPLES / "stage_shortmb_np4_r0_plain.log").read_text()
    warning = "WARNING rank 0: batch 14 is not a multiple of micro-batch 4; dropping the last 2 samples (3 micro-batches)\n"
    assert warning in text
    log = tmp_path / "both_warned.log"
    log.write_text(text.replace(warning, warning + warning.replace("rank 0", "rank 1")))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.timeout", None)


def test_an_error_every_rank_raised_alike_that_names_one_rank_names_it():
    # every rank's resume check all-gathers the steps and raises `RuntimeError: ranks resumed from different
    # steps [6, 6, 6, 2]: rank 3 loaded an older checkpoint`: rank 3, not the first copy's rank
    assert root_facts("avg_stale_np4_r3_loglevel")[:3] == ("python.exception", "python_exception", 3)


def test_a_script_label_naming_each_copys_own_rank_names_no_one_rank():
    # `FloatingPointError: rank N: non-finite loss inf at epoch 2 micro-batch 4` on every rank (an earlier batch):
    # each copy names its own rank, so the shared error keeps all four and the first
    rc = triage([str(SAMPLES / "gacc_noscale_np4_rall_plain.log")]).to_dict()["root_cause"]
    assert (rc["category"], rc["rank"], rc["ranks"]) == ("numerical", 0, [0, 1, 2, 3])


@pytest.mark.parametrize("slug, rank", [
    # federated averaging weighted by sample count: rank N's start-up line says `samples 0` where the others say
    # 40000-58000; after the first round every rank's check raises the same FloatingPointError
    ("avg_zerocount_np4_r1_plain", 1),
    ("avg_zerocount_np5_r3_detail", 3),
])
def test_the_one_rank_that_started_with_nothing_owns_the_error_every_rank_met(slug, rank):
    rc = triage([str(SAMPLES / f"{slug}.log")]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("numerical.checked_nonfinite", rank)
    assert len(rc["ranks"]) > 2       # still the same error on every rank


def test_a_zero_on_two_ranks_names_neither(tmp_path):
    # the same run with rank 2 also starting with no samples: no one rank started with nothing
    text = (SAMPLES / "avg_zerocount_np4_r1_plain.log").read_text()
    line = "rank 2/4 avg fed period 2 warmup 2 lr 0.01 samples 52000 avg dtype float32"
    assert line in text
    log = tmp_path / "two_empty.log"
    log.write_text(text.replace(line, line.replace("52000", "0")))
    assert triage([str(log)]).to_dict()["root_cause"]["rank"] == 0
