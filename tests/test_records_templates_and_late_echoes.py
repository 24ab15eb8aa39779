"""A rank's own error record that denies going on (`refusing to continue`), a line-prefix template whose field
glues the role to the rank (`[default1|1]:`), and a start-up hang stopped from outside where the rank printing
last only echoed what the others had printed: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
175th-179th batches, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.analysis.same_event import _says_going_on
from logtriage.demux.dialect import Dialect
from logtriage.demux.prefixes import strip_prefixes
from logtriage.api import triage
from sample_roots import SAMPLES, edited_report, root_facts, verdict_and_root


def test_an_error_record_that_refuses_to_continue_is_the_ranks_failure():
    # `[trainer1]:ERROR rank 1: codebook collapse: ... refusing to continue, restart from a k-means init`, then
    # the agent's `failed (exitcode: 4) local_rank: 1`: the record says why rank 1 exited
    assert root_facts("vq_collapse_np4_r1_tee_trainer") == ("python.logged_error", "python_exception", 1, 22, None)


def test_a_record_that_says_it_goes_on_is_still_no_failure(tmp_path):
    # the same run, the record saying the program carried on: the bare exit code is all that is left
    report = edited_report("vq_collapse_np4_r1_tee_trainer", "refusing to continue", "continuing", tmp_path)
    assert report["root_cause"]["rule_id"] == "signal.exit_nonzero"


@pytest.mark.parametrize(("text", "going_on"), [
    ("ERROR rank 1: loader failed; continuing with the next shard", True),
    ("WARNING: upload failed, will retry", True),
    ("ERROR rank 2: refusing to continue, restart from a k-means init", False),
    ("ERROR: cannot continue without the vocabulary", False),
    ("ERROR: will not retry; the data is corrupt", False),
    ("ERROR: unable to continue: no codes; skipping the epoch", True),   # a denial, then a going-on word of its own
])
def test_a_going_on_word_the_record_denies_is_no_going_on(text, going_on):
    assert _says_going_on(text) is going_on


@pytest.mark.parametrize(("slug", "rank", "line"), [
    # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${role_name}${rank}|${local_rank}]:' with --tee 3:
    # `[default2]:ERROR rank 2: invalid mask in ...; refusing to resize labels`, then exit 3
    ("unet_invalidmask_np4_r2_prefix", 2, 5),
    # `[default1|1]:ERROR rank 1: corrupt shard: ...; aborting this worker`, then exit 7
    ("mlm_exit7_np4_r1_prefix", 1, 13),
])
def test_a_record_behind_a_role_and_rank_template_is_read(slug, rank, line):
    assert root_facts(slug) == ("python.logged_error", "python_exception", rank, line, None)


@pytest.mark.parametrize(("line", "rank", "local", "text"), [
    ("[default1|1]:ERROR rank 1: corrupt shard", 1, 1, "ERROR rank 1: corrupt shard"),
    ("[trainer5|1]:[rank5]: Traceback (most recent call last):", 5, 1, "Traceback (most recent call last):"),
    ("[default3|3] rank 3 step 0", 3, 3, "rank 3 step 0"),
])
def test_a_template_field_gluing_the_role_to_the_rank_names_the_rank(line, rank, local, text):
    got = strip_prefixes(line, Dialect())
    assert (got.rank, got.local_rank, got.text) == (rank, local, text)


@pytest.mark.parametrize("line", [
    "[INFO|trainer.py:1234] 2025-01-09 19:38:13,614 >> loading",   # transformers' level and place
    "[host1|gpu0] loading",                                         # two fields that could each be the rank
    "[default|第1卡] loading",                                       # a field the tool cannot read
])
def test_a_bracket_with_no_single_role_and_rank_field_stays_text(line):
    got = strip_prefixes(line, Dialect())
    assert (got.rank, got.text) == (None, line)


def test_in_a_stopped_start_up_the_rank_not_at_the_point_the_others_reached_is_the_one_they_waited_for():
    # rank 2: `codebook usage low in init, re-running k-means init on 256 points`; ranks 0, 1 and 3 then print
    # DDP's FutureWarning (rank 3 last, its two lines after the others'): they reached DDP and waited there
    assert verdict_and_root("vq_kmeans_np4_r2_tee") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_a_rank_still_printing_its_own_work_after_the_others_fell_silent_stays_the_one_at_work(tmp_path):
    # the same run, rank 3's two late lines its own (no other rank printed them): rank 3 was at work alone
    lines = (SAMPLES / "vq_kmeans_np4_r2_tee.log").read_text().splitlines(keepends=True)
    assert lines[9].startswith("[default3]:/tmp/job/fault178.py:144: FutureWarning") and lines[10].startswith(
        "[default3]:  net = DDP(")
    lines[9:11] = ["[default3]:rank 3 rebuilding the codebook index\n", "[default3]:rank 3 index 128/256 done\n"]
    log = tmp_path / "edited.log"
    log.write_text("".join(lines))
    assert triage([str(log)]).to_dict()["root_cause"]["rank"] == 3


# the 185th-189th batches: a hand-written scaler's floor check, a loader's dtype check of a checkpoint,
# DataLoader's timeout printed as given, and the rank that left the loop the others stayed in


def test_a_scalers_own_floor_check_is_the_loss_scale_reaching_its_minimum():
    # `RuntimeError: rank 2: loss scale 0 below minimum 1 at step 4` (bf16 autocast, a hand-written dynamic scaler)
    assert root_facts("amp_scaleunder_np4_r2_tee_trainer") == ("numerical.loss_scale_min", "numerical", 2, 23,
                                                               "RuntimeError")


def test_a_loaders_dtype_check_of_a_checkpoint_is_a_checkpoint_mismatch():
    # `TypeError: checkpoint tensor 'emb.weight' in .../amp_init_export_fp16.pt has dtype torch.float16, expected
    # torch.float32 (strict dtype check)`
    assert root_facts("amp_ckpthalf_np3_r2_tee") == ("ckpt.format_mismatch", "checkpoint", 2, 14, "TypeError")


def test_a_dataloader_timeout_given_as_a_float_is_the_loaders_timeout():
    # `RuntimeError: DataLoader timed out after 5.0 seconds` (timeout=5.0): the rank's workers stalled
    rc = root_facts("pin_dltimeout_np4_r2_filter")
    assert rc[:4] == ("data.loader_timeout", "hang", 2, 24)


def test_the_rank_that_left_the_loop_after_fewer_steps_is_the_one_the_others_waited_for():
    # ranks 0, 1 and 3 end on `rank N step 6 ...`; rank 2, after its step 5: `rank 2: approx KL 0.0000 > target
    # 0.0000 at epoch 0, stopping updates; running evaluation episodes`; then `timeout` stops the job
    assert verdict_and_root("ppo_klearly_np4_r2_tee") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_a_rank_whose_last_step_is_past_the_others_did_not_leave_their_loop(tmp_path):
    # the same run, rank 2's last progress line at step 7, past the others' step 6: nothing says it left first
    report = edited_report("ppo_klearly_np4_r2_tee", "[default2]:rank 2 step 5 loss", "[default2]:rank 2 step 7 loss",
                           tmp_path)
    assert report["root_cause"]["rank"] is None


def test_in_a_stopped_start_up_the_rank_whose_last_line_has_another_shape_is_the_one_they_waited_for():
    # ranks 0 and 1 end on `rank N: 24 examples -> 42 windows` (numbers their own); rank 2 on `rank 2: tokenizer
    # cache stale, re-tokenising the full split`; `timeout` stops the job (205th batch)
    assert verdict_and_root("qa_retok_np3_r2_plain") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_a_style_image_torch_load_misses_is_a_missing_file_not_a_checkpoint():
    # `FileNotFoundError: ... '/tmp/job_work/styles/style01.pt'` under torch.load (209th batch)
    assert root_facts("gan2_stylefile_np3_r1_tee_trainer")[:3] == ("data.file_not_found", "python_exception", 1)
