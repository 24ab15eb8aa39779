"""A library's start-up advice that quotes an error in backticks is not that error: bitsandbytes 0.39 warns
"If you get `CUDA error: invalid device function` errors, the above might be the cause ..." on every rank, and the
run's real failure comes later (public round 145, opyate/dolly: both ranks' CUDA OOM while loading the model)."""

from __future__ import annotations

from pathlib import Path

from sample_roots import text_root

ADVICE = ("If you get `CUDA error: invalid device function` errors, the above might be the cause and the solution is "
          "to make sure only one ['libcudart.so', 'libcudart.so.11.0'] in the paths that we search based on your env.")
OOM = """Traceback (most recent call last):
  File "trainer.py", line 88, in load_model
    model.resize_token_embeddings(len(tokenizer))
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 984.00 MiB (GPU 0; 47.50 GiB total capacity; 22.15 GiB already allocated; 68.88 MiB free; 22.16 GiB reserved in total by PyTorch)
"""


def _root(text: str, tmp_path: Path) -> tuple:
    rc = text_root(text, tmp_path)
    return rc["rule_id"], rc["category"], rc["line"]


def test_the_quoted_error_in_setup_advice_is_not_the_root(tmp_path):
    assert _root(f"{ADVICE}\n  warn(msg)\n{OOM}", tmp_path) == ("cuda.oom", "gpu_oom", 6)


def test_the_error_itself_still_reads_as_no_kernel_image(tmp_path):
    text = OOM.replace("torch.cuda.OutOfMemoryError: CUDA out of memory.", "RuntimeError: CUDA error: invalid device function")
    assert _root(text, tmp_path)[:2] == ("cuda.no_kernel_image", "environment")
