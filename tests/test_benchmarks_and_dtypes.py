"""A benchmark runner's validity gates (error manual E007-E010), a child process's failure inside a rank,
and one rank's dtype in a collective, on real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
63rd-65th batches, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import root_facts as _root
from sample_roots import sample_report as _report


@pytest.mark.parametrize("slug, expected", [
    # the runner's occupancy gate finds a CPU burner before trial 2, refuses, and every rank exits 3
    ("bench_gate_np4_rall_plain", ("perf.external_gpu_process", "performance_validity", None, 21, None)),
    # step times too uneven: `PERFORMANCE VALIDITY GATE FAILED: ... step time CV 1.146 > 0.25`
    ("bench_variance_np4_rall_plain", ("perf.result_invalid", "performance_validity", None, 34, None)),
    # the matrix cannot finish inside its exclusive window (E009)
    ("bench_window_np4_rall_plain", ("perf.no_exclusive_window", "performance_validity", None, 21, None)),
    # rank 0 raises the runner's own BenchmarkInvalidError after its gate line: the gate is the root
    ("bench_gateraise_np6_rall_tee3", ("perf.external_gpu_process", "performance_validity", 0, 41,
                                       "BenchmarkInvalidError")),
])
def test_a_refused_benchmark_result_is_performance_validity(slug, expected):
    assert _root(slug) == expected


def test_a_banner_before_the_probes_json_is_e007_even_with_a_blank_line_first():
    assert _root("bench_probe_np4_rnone_sub") == (
        "env.probe_json", "environment", None, 33, "json.decoder.JSONDecodeError")


@pytest.mark.parametrize("slug, expected", [
    # `tar czf .../ckpt_final.tgz` fails on rank 0 after training: a checkpoint's file operation
    ("sub_tarckpt_np4_r0_plain", ("ckpt.io_error", "checkpoint", 0, 47, "subprocess.CalledProcessError")),
    # the same under --redirects: only the launcher's summary holds the error file's traceback
    ("sub_tarckpt_np4_r0_redir", ("ckpt.io_error", "checkpoint", 0, 52, "subprocess.CalledProcessError")),
    # a child python process's failure, seen only through the error file: the rank's own exception,
    # not a launcher's exit notice (its command names a .py file)
    ("sub_childpy_np4_r1_redir", ("python.exception", "python_exception", 1, 98, "subprocess.CalledProcessError")),
])
def test_a_child_process_failing_inside_a_rank(slug, expected):
    assert _root(slug) == expected


@pytest.mark.parametrize("slug, rank", [
    ("prec_f64_np4_r2_plain", 2),      # float64 on rank 2: its neighbour rank 1 aborts on `216 vs 108`
    ("prec_deff64_np6_r5_srun", 5),    # torch.set_default_dtype(float64) on rank 5: rank 4 aborts
    ("prec_bf16_np4_r1_plain", 1),     # bfloat16 on rank 1: the narrower rank aborts itself
])
def test_gloo_size_mismatch_names_the_rank_whose_dtype_differs(slug, rank):
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.size_mismatch", "collective_mismatch", rank)


@pytest.mark.parametrize("slug", ["prec_none_np4_rnone_plain", "bench_probeok_np4_rnone_sub"])
def test_controls_that_say_they_finished_are_ok(slug):
    report = _report(slug)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
