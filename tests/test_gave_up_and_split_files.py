"""A worker that ends itself after a line saying why it gives up (`...; aborting`), and a data set's split saved
with torch.save and read back with torch.load (`pairs/market_2_val.pt`), or any missing file whose path has no word
of a checkpoint's (`lidar/velo_3_sweep2.pt`). Real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 265th-299th
batches and earlier ones, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import SAMPLES, edited_report, sample_report


@pytest.mark.parametrize("slug, rank, line", [
    # `rank 2: shard part-002.npz has 0 rows after the label filter; aborting`, then os._exit(3): an unlabelled line
    # whose text names the rank, and `failed (exitcode: 3) local_rank: 2` from the agent
    ("tabx_exit3_np3_r2_loglevel", 2, 44),
    # `rank 2: feature cache spec/.../shard-002.pt checksum 0x5e1f0c2a != manifest 0x5e1f0c3b; aborting`, the other
    # ranks' `Connection closed by peer` tracebacks printed before the agent's exit line
    ("mtr_exit3_np4_r2_loglevel", 2, 49),
    # behind torchrun's `[default1]:` label: `rank 1: scratch volume has only 0.4 GB free at step 3, stopping`
    ("shut_sysexitmsg_np2_r1_dbginfo", 1, None),
])
def test_the_line_a_rank_gave_up_on_is_the_root(slug, rank, line):
    rc = sample_report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.logged_error", "python_exception", rank)
    assert rc["line"] == line or line is None
    assert rc["text"].rstrip(".").endswith(("aborting", "stopping"))


@pytest.mark.parametrize("old, new", [
    # the giving-up word does not end the line: the line goes on with another thought
    ("label filter; aborting", "label filter; aborting shard 2 and retrying with shard 3"),
    # no reason before it: the rank's label and the word alone
    ("rank 2: shard part-002.npz has 0 rows after the label filter; aborting", "rank 2: aborting"),
    # the line names another rank than the one that exited
    ("rank 2: shard part-002.npz", "rank 1: shard part-002.npz"),
])
def test_without_a_reason_on_the_exiting_ranks_last_line_the_exit_code_stays_alone(old, new, tmp_path):
    text = (SAMPLES / "tabx_exit3_np3_r2_loglevel.log").read_text()
    assert old in text
    rc = edited_report("tabx_exit3_np3_r2_loglevel", old, new, tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.exit_nonzero", "unknown", 2)


def test_a_data_split_read_with_torch_load_is_a_missing_file_not_a_checkpoint():
    # `torch.load(f"{WORK}/pairs/{SCENES[r]}_{split}.pt")`: FileNotFoundError for `.../pairs/market_2_val.pt`
    rc = sample_report("oflw_archive_np4_r3_filter")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("data.file_not_found", "python_exception", 3)


@pytest.mark.parametrize("name", ["market_2_best_val.pt", "model_val.pt", "ckpt_test.pt"])
def test_a_split_name_with_a_checkpoints_word_stays_a_checkpoint(name, tmp_path):
    rc = edited_report("oflw_archive_np4_r3_filter", "market_2_val.pt", name, tmp_path)["root_cause"]
    assert rc["category"] == "checkpoint"


def test_a_giving_up_line_flushed_before_the_ranks_buffered_stdout_is_still_the_root():
    # --tee: `[default3]:rank 3: edge batch 1 has 3 payments timestamped in the future; aborting` (stderr, line 6),
    # then rank 3's buffered stdout (`rank 3/4 loaded ...`, `rank 3 step 0 ...`) flushed as it exits with 3
    rc = sample_report("edgc_exit3_np4_r3_tee")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.logged_error", "python_exception", 3, 6)


def test_a_scripts_error_record_behind_a_loops_own_rank_label_is_the_root():
    # a bash loop labels each rank's lines with sed: `[rank 2] rank 2: ERROR demand shard ... has 0 rows after the
    # promo filter`, then os._exit(8); the others' `Connection closed by peer` tracebacks follow
    rc = sample_report("tftl_exit8_np3_r2_ranklabel")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.logged_error", "python_exception", 2, 7)


@pytest.mark.parametrize("slug, rank", [
    # `rank 1 step 1 loss ... lesion 0.000rank 0 step 1 loss ...` (two unbuffered ranks of a bash loop glued on one
    # line), rank 2's step 1, then `rank 2: counting connected lesion components for the step-2 stats` and the end
    ("mseg_flood_np3_r2_bashloop", 2),
    ("chrt_viterbi_np3_r2_bashloop", 2),
])
def test_ranks_bare_lines_glued_on_one_line_are_read_apart_where_the_output_stops(slug, rank):
    report = sample_report(slug)
    rc = report["root_cause"]
    assert (report["verdict"], rc["category"], rc["rank"]) == ("hung", "hang", rank)


def test_a_data_folder_named_for_keypoints_holds_data():
    # `torch.load(f"{WORK}/keypoints_v2/{ds}_2d.pt")`: FileNotFoundError for `.../keypoints_v2/h36m_2d.pt`
    rc = sample_report("hpe_noarchive_np3_r2_wrapper")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("data.file_not_found", "python_exception", 2)


def test_a_ranks_own_error_line_says_why_before_the_launchers_signal_says_how():
    # `rank 2: ERROR overlap user table is stale (...); refusing to continue`, then `terminate called without an
    # active exception` (sys.exit with a live thread) and the agent's `failed (exitcode: -6) local_rank: 2`
    rc = sample_report("cdr_exit3_np3_r2_pymodule")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.logged_error", "python_exception", 2, 26)


@pytest.mark.parametrize("slug, rank", [
    # `torch.load(os.path.join(WORK, cfg["archive"], "archive.pt"))`: `.../signs_v2/archive.pt`
    ("tsr_noarchive_np3_r1_legacy", 1),
    # `torch.load(f"{WORK}/{store_dir}/store.pt")` under Open MPI's `--tag-output`: `.../tables_v2/store.pt`
    ("qae_nostore_np3_r2_mpitag", 2),
])
def test_a_file_named_for_a_store_of_data_is_data(slug, rank):
    rc = sample_report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("data.file_not_found", "python_exception", rank)


@pytest.mark.parametrize("slug, rank", [
    # a bash loop, each rank's lines labelled by sed: `./loop.sh: line 19:   490 Killed   $PY fault294.py ...`
    ("rgnn_sigkill_np4_r3_ranklabel", 3),
    # the same under Open MPI's label: gloo's `Connection closed by peer` on the others says the job is a CPU one
    ("tcna_kill_np3_r1_mpitag", 1),
])
def test_a_shells_killed_on_a_cpu_job_is_the_signal_not_the_oom_killer(slug, rank):
    rc = sample_report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.sigkill", "crash_signal", rank)


def test_a_shells_killed_with_no_sign_of_a_cpu_or_a_gpu_job_is_a_kill_of_either_kind(tmp_path):
    # (stop 63: the GPU nodes' OOM killer only where the log shows a GPU, tests/test_more_than_one_thing.py)
    report = edited_report("rgnn_sigkill_np4_r3_ranklabel", "gloo", "nccl", tmp_path)
    assert report["root_cause"]["rule_id"] == "signal.sigkill"


@pytest.mark.parametrize("slug, rank, path", [
    # `torch.load(f"{WORK}/lidar/velo_{rank}_sweep2.pt")` and `specs/shard_{rank}_v2.pt`: nothing in the path a
    # checkpoint's or a model's would hold (cpu_adhoc 296th and 299th batches)
    ("dcmp_noscan_np5_r3_loglevel", 3, "lidar/velo_3_sweep2.pt"),
    ("bsnd_nodata_np5_r3_loglevel", 3, "specs/shard_3_v2.pt"),
])
def test_a_missing_file_whose_path_has_no_word_of_a_checkpoint_is_data(slug, rank, path):
    rc = sample_report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("data.file_not_found", "python_exception", rank)
    assert path in rc["text"]


@pytest.mark.parametrize("name", ["velo_3_step2.pt", "velo_3_latest.pt", "weights_3.pt", "rank3.pt"])
def test_a_missing_file_with_a_checkpoints_word_in_its_path_stays_a_checkpoint(name, tmp_path):
    rc = edited_report("dcmp_noscan_np5_r3_loglevel", "velo_3_sweep2.pt", name, tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.not_found", "checkpoint", 3)
