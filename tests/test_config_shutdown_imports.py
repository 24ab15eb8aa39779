"""Configuration, shutdown code and imports, on real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
72nd-77th batches, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.analysis.exception_names import shadowing_file
from logtriage.api import triage
from logtriage.demux.line_marks import find_rank_marker

from sample_roots import SAMPLES


def _report(slug: str) -> dict:
    return triage([str(SAMPLES / f"{slug}.log")]).to_dict()


@pytest.mark.parametrize("slug, rule, rank", [
    # `timeout 40 torchrun`: rank 1 polls for a cache folder its config misspells, the others sit in DDP's
    # first collective; its last line says it waits, theirs say they read their config
    ("cfg_cachedirhang_np4_r1_timeout", "hang.stopped_while_waiting", 1),
    # every rank's module-level code waits on a stale lock file (no rank on the lines): stopped while waiting
    ("imp_lock_import_np4_rnone_timeout", "hang.stopped_while_waiting", None),
    # every rank finished training; rank 1's atexit hook waits for uploads an earlier dead thread never sent
    ("shut_atexithang_np4_r1_plain", "hang.exit_stalled", 1),
    ("shut_atexithang_np6_r4_tee3", "hang.exit_stalled", 4),
    # rank 3 waits on a lock another process holds; faulthandler's watchdog dumps every rank's stack before
    # `timeout` stops torchrun: the dumps say the wait went on, they are no failure since it began
    ("prof_lockhang_np4_r3_hang", "hang.stopped_while_waiting", 3),
])
def test_a_stop_that_ended_a_wait_is_a_hang_where_the_rank_waited(slug, rule, rank):
    report = _report(slug)
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"], rc["rank"]) == ("hung", rule, "hang", rank)


def test_a_threads_exception_its_ranks_finished_after_did_not_fail_the_run():
    # the uploader thread's TypeError (no rank prefix) comes before every rank's six steps and its
    # `training finished`: the work was done despite it
    report = _report("shut_atexithang_np4_r1_plain")
    thread_error = [(f["rule_id"], f["line"]) for f in report["findings"] if "TypeError" in f["text"]]
    assert thread_error == [("python.exception", 32)]     # found, and set aside
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["line"]) == ("hang.exit_stalled", 59)   # the stop that ended the hang at exit


@pytest.mark.parametrize("slug", ["imp_shadow_queue_np4_rall_plain", "imp_shadow_random_np5_rall_tee3"])
def test_a_job_file_named_like_a_standard_module_hides_it(slug):
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["exception_type"]) == (
        "python.module_shadowed", "python_exception", "ImportError")


def test_only_a_job_file_with_a_standard_modules_name_is_read_as_shadowing():
    assert shadowing_file("ImportError: cannot import name 'Queue' from 'queue' (/tmp/job/queue.py)") == "/tmp/job/queue.py"
    # the standard library's own file lacks the name: another Python version, not a shadow
    assert not shadowing_file("ImportError: cannot import name 'x' from 'queue' (/usr/lib/python3.11/queue.py)")
    # the job's own module without a name another node's copy has (imp_skew_np4_rnone_pdsh2): not a shadow
    assert not shadowing_file("ImportError: cannot import name 'build_model' from 'models' (/tmp/job/node1/models.py)")
    assert shadowing_file("ImportError: cannot import name 'deepcopy' from partially initialized module 'copy' "
                           "(most likely due to a circular import) (/work/copy/__init__.py)") == "/work/copy/__init__.py"


@pytest.mark.parametrize("slug, rank", [("imp_pickle_main_np4_r0_plain", 0), ("imp_pickle_main_np4_r3_detail", 3)])
def test_a_pickled_model_whose_class_lived_in_another_scripts_main_is_a_checkpoint_of_another_format(slug, rank):
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == (
        "ckpt.format_mismatch", "checkpoint", rank, "AttributeError")


def test_a_rank_with_its_world_size_starts_a_scripts_own_line():
    assert find_rank_marker("rank 1/4: reading config /tmp/job_work/conf/rank1.json") == 1
    assert find_rank_marker("rank 12 / 16 step 3 loss 0.4") == 12
    assert find_rank_marker("rank 1/4 and rank 2/4 disagree on the vocabulary") is None


def test_the_c_runtimes_abort_under_the_same_tee_prefix_does_not_continue_the_exceptions_message(tmp_path):
    # shut_atexitcoll_np6_r5_role: rank 5's KeyError, then its atexit all-reduce aborts in gloo; under
    # `--tee 3 --role trainer` both carry `[trainer5]:`, and the abort is not a line of the KeyError's message
    rc = _report("shut_atexitcoll_np6_r5_role")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == ("python.exception", 5, 34, "KeyError")


def test_a_wait_of_seconds_when_a_launcher_was_stopped_is_no_hang():
    # public2/primerl_trainer_received_sigterm_default0: `12:13:46 INFO Waiting for training batch to arrive`,
    # the agent's SIGTERM three seconds later (the RL launcher stopping the trainer after another part crashed)
    report = triage([str(SAMPLES.parent / "public2" / "primerl_trainer_received_sigterm_default0.log")]).to_dict()
    assert (report["verdict"], report["root_cause"]["category"]) == ("failed", "external_stop")


def test_a_rank_that_lost_its_peer_and_aborted_still_leaves_the_silent_rank_first():
    # cpu_matrix: rank 0 exits 3 with no message; rank 1's `Connection closed by peer` is followed, under
    # --tee, by `[default1]:terminate called without an active exception`, now a block of its own
    case = SAMPLES.parent / "cpu_matrix" / "rank_exit_code__np2-tee3_np3_r0_m90720.log"
    rc = triage([str(case)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.exit_nonzero", "unknown", 0)


@pytest.mark.parametrize("slug, rank", [("rsm_truncated_np4_rall_plain", 0), ("rsm_truncated_np6_r0_tee3", 0)])
def test_torch_loads_zip_reader_refusing_a_file_cut_short_is_a_truncated_checkpoint(slug, rank):
    # (75th batch) the previous run was killed mid-save; torch 2.13 says only `OSError: [Errno 22] Invalid
    # argument` from PyTorchFileReader in serialization's `__init__`
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == (
        "ckpt.corrupt_archive", "checkpoint", rank, "OSError")


@pytest.mark.parametrize("slug", ["hinit_world4_np8_rall_plain", "hinit_worldcpu_np4_rall_tee3"])
def test_a_rank_not_below_the_scripts_own_world_size_is_a_group_that_cannot_form(slug):
    # (77th batch) world_size=4 hard-coded under 8 processes, or os.cpu_count() (2) under 4: gloo's context
    # check `rank < size. 4 vs 4` on the ranks above it, the others waiting in init
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("gloo.rank_outside_world", "rendezvous")


def test_gzips_own_exception_class_ends_the_traceback_it_names():
    # (76th batch) a plain-text shard opened with gzip.open: `gzip.BadGzipFile: Not a gzipped file (b'f0')`
    rc = _report("dfile_gz_plain_np4_r1_wrapper")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 1, "gzip.BadGzipFile")
