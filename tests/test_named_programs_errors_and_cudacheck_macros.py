"""A script's error line with its program's name before the rank, a missing remote-sensing tile, and the
CUDACHECK/NCCLCHECK macros of NCCL's examples (stop 55's batches and public round 131):

- `ERROR kiln-ctl rank 5: zone 5 thermocouple (type S) reads open circuit, refusing to fire`, then `sys.exit(4)`
  (cpu_adhoc 480th batch), and `2026-12-06 18:40:06,874 [rank 3/4] ERROR subway: ...` (489th): the script's own
  logged error, on its rank, not a bare exit code or the peers' timeouts;
- `No such file or directory: '/tmp/job_work/tiles/srtm_dunes_rank1_reproj_utm.pt'` (481st) and
  `'/tmp/job_work/windows/hub_hours_rank1_peak_season.pt'` (485th): a file in a folder of tiles, or of a series cut into
  windows, is data, although its name holds `rank`;
- `Failed: Cuda error <file>:<line> '<error>'` and `Failed, NCCL error <file>:<line> '<error>'`, as vLLM's and
  sglang's custom all-reduce and nccl-tests print them (sgl-project/sglang#552)."""

from __future__ import annotations

from pathlib import Path

import pytest

from logtriage.api import triage
from sample_roots import edited_report, root_facts

PUBLIC131 = Path(__file__).resolve().parent.parent / "sample_logs" / "public131"
SGLANG = PUBLIC131 / "sglang552_tp2_t4_custom_allreduce_peer_access_unsupported.log"


@pytest.mark.parametrize("slug, rank, line", [
    ("kiln_exit4_np7_r5_wrapper", 5, 22),    # a job-script wrapper; torchrun's summary says exitcode 4
    ("kiln_exit4_np3_r2_restart", 2, 14),    # --max-restarts 1: the first attempt's line
    # a logging format with the rank and the world size (`2026-12-06 18:40:06,874 [rank 3/4] ERROR subway: ...`),
    # before the others' `training failed on rank N` records of their lost connections
    ("subw_exit4_np4_r3_logfmt", 3, 9),
])
def test_a_programs_named_error_line_is_its_logged_error(slug, rank, line):
    assert root_facts(slug)[:4] == ("python.logged_error", "python_exception", rank, line)


def test_the_same_line_at_info_level_leaves_the_bare_exit_code(tmp_path):
    report = edited_report("kiln_exit4_np7_r5_wrapper", "ERROR kiln-ctl rank 5:", "INFO kiln-ctl rank 5:", tmp_path)
    assert report["root_cause"]["rule_id"] == "signal.exit_nonzero"
    assert report["root_cause"]["rank"] == 5


@pytest.mark.parametrize("slug, rank, line", [
    ("dune_missing_shard_np3_r1_srunlabel", 1, 20),
    ("dune_missing_shard_np5_r3_legacy", 3, 37),
    ("parc_missing_shard_np5_r3_legacy", 3, 33),
])
def test_a_missing_tile_or_window_is_a_data_file(slug, rank, line):
    assert root_facts(slug)[:5] == ("data.file_not_found", "python_exception", rank, line, "FileNotFoundError")


def test_the_same_file_under_checkpoints_is_a_missing_checkpoint(tmp_path):
    report = edited_report("dune_missing_shard_np3_r1_srunlabel", "/tiles/", "/checkpoints/", tmp_path)
    assert report["root_cause"]["rule_id"] == "ckpt.not_found"
    assert report["root_cause"]["rank"] == 1


def test_custom_allreduce_without_peer_access_is_the_p2p_rule():
    rc = triage([str(SGLANG)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("nccl.p2p_unsupported", "environment", 3)


@pytest.mark.parametrize("error, rule, category", [
    ("Failed: Cuda error /home/runner/work/vllm/vllm/csrc/custom_all_reduce.cuh:307 'invalid argument'",
     "cuda.error", "cuda_runtime"),
    ("Failed, NCCL error /workspace/bench.cu:88 'unhandled system error (run with NCCL_DEBUG=INFO for details)'",
     "nccl.unhandled_system_error", "collective_error"),
    ("Failed, NCCL error /workspace/bench.cu:91 'invalid usage (run with NCCL_DEBUG=WARN for details)'",
     "nccl.invalid_usage", "collective_error"),
])
def test_the_check_macros_name_their_error(tmp_path, error, rule, category):
    text = SGLANG.read_text().replace(
        "Failed: Cuda error /home/runner/work/vllm/vllm/csrc/custom_all_reduce.cuh:307 "
        "'peer access is not supported between these two devices'", error)
    log = tmp_path / "macro.log"
    log.write_text(text)
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == (rule, category, 3)
