"""A missing file in a shards folder with a qualifier (`shards_2025q4/`, `shards_retiled/`, `shards_resampled/`) is a
data shard, as one in a plain `shards/` folder is, even when its name carries a rank (`plots_rank5.pt`) that alone
would read as a per-rank checkpoint (cpu_adhoc 530th, 532nd and 536th batches). A per-rank shard of a checkpoint in a
folder of another name (`sw1/shard_rank4.pt`, `model_shards/rank3.pt`) stays a missing checkpoint. A file named a
shard first (`shard_r0_2025.json`) is data unless its name holds a checkpoint's word (`shard_rank4.pt`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sample_roots import text_root

LOAD = """[rank{r}]: Traceback (most recent call last):
[rank{r}]:   File "/tmp/job/train.py", line 131, in main
[rank{r}]:     shard = torch.load(path)
[rank{r}]:   File "/tmp/venv/lib/python3.11/site-packages/torch/serialization.py", line 1561, in load
[rank{r}]:     with _open_file_like(f, "rb") as opened_file:
[rank{r}]:   File "/tmp/venv/lib/python3.11/site-packages/torch/serialization.py", line 776, in __init__
[rank{r}]:     super().__init__(open(name, mode))  # noqa: SIM115
[rank{r}]: FileNotFoundError: [Errno 2] No such file or directory: '{path}'
"""


@pytest.mark.parametrize("path,rule,category", [
    ("/tmp/job_work/shards_2025q4/plots_rank5.pt", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/shards_retiled/tesserae_rank3.pt", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/shards_resampled/soundings_r4.csv", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/shards/gusts_rank4_2026w49.pt", "data.file_not_found", "python_exception"),
    # a file named a shard first, no checkpoint word in its name (cpu_adhoc 542nd, 543rd batches)
    ("/tmp/job_work/shard_r0_2025.json", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/shard_3_missing.json", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/sw1/shard_rank4.pt", "ckpt.not_found", "checkpoint"),
    ("/tmp/job_work/shard_rank4.pt", "ckpt.not_found", "checkpoint"),
    # a rank's shard named for what it holds is data; a checkpoint's shard is named by the rank alone
    # (cpu_adhoc 525th, 537th, 549th batches)
    ("/tmp/job_work/shard_rank3_tidal.pt", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/shard_rank3_thermal_2026w49.pt", "data.file_not_found", "python_exception"),
    ("/tmp/job_work/shard_rank2_of_3.pt", "ckpt.not_found", "checkpoint"),
    ("/tmp/job_work/shard_rank2_optim.pt", "ckpt.not_found", "checkpoint"),
    ("/tmp/job_work/shard_step3_optim.pt", "ckpt.not_found", "checkpoint"),
    ("/tmp/job_work/model_shards/rank3.pt", "ckpt.not_found", "checkpoint"),
    ("/tmp/job_work/shards_v2/ckpt_rank3.pt", "ckpt.not_found", "checkpoint"),
])
def test_a_missing_file_is_data_or_checkpoint_by_its_folder_and_name(path, rule, category, tmp_path: Path):
    rc = text_root(LOAD.format(r=5, path=path), tmp_path)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == (rule, category, 5, 8)
