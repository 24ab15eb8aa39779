"""Processes that share one console without prefixes (Lightning's own launcher starts ranks 1.. as subprocesses of
rank 0) glue one rank's progress line onto another's: `rank 3 step 5 loss 0.7425 rmse 0.8617rank 2 step 5 loss
0.7425 rmse 0.8617`. The whole physical line goes to the rank it starts with, so the glued rank's later steps are
missing from its own stream; read from the glued pieces, that rank was not behind (a real CPU run, torch 2.13,
Lightning 2.6.6, sample_logs/cpu_adhoc, labelled before triage ran)."""

from __future__ import annotations

from logtriage.api import triage
from sample_roots import SAMPLES

SLUG = "drgr_none_np4_rnone_plown"
STEP_5 = "rank 3 step 5 loss 0.7425 rmse 0.8617rank 2 step 5 loss 0.7425 rmse 0.8617\n"
STEP_6 = "rank 0 step 6 loss 0.5625 rmse 0.7500rank 2 step 6 loss 0.5625 rmse 0.7500\n"


def test_a_rank_whose_last_steps_were_glued_onto_others_lines_was_not_behind():
    # the clean control: 6 steps on 4 ranks, rank 2's steps 5 and 6 glued onto ranks 3's and 0's lines, then
    # `Trainer.fit stopped: max_steps=6 reached.` and rank 0's save; exit 0
    report = triage([str(SAMPLES / f"{SLUG}.log")]).to_dict()
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


def test_without_those_glued_steps_the_rank_is_behind(tmp_path):
    # the same log with rank 2's glued steps cut off: it stopped at step 4 while the others reached 6
    text = (SAMPLES / f"{SLUG}.log").read_text()
    assert STEP_5 in text and STEP_6 in text
    log = tmp_path / "edited.log"
    log.write_text(text.replace(STEP_5, STEP_5.split("rank 2")[0] + "\n").replace(STEP_6, STEP_6.split("rank 2")[0] + "\n"))
    report = triage([str(log)]).to_dict()
    assert (report["verdict"], report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == (
        "hung", "hang.no_progress", 2)

