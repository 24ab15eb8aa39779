"""Lines that look like errors in runs that went on: they must not become the root, and a real
failure after them still must (gaps round 41; each case names the format it copies)."""

from __future__ import annotations

import pytest

from logtriage.api import triage

FINISHED = "".join(f"[rank{r}]:step 100 loss 1.234\n[rank{r}]:training finished\n" for r in range(4))
OOM = ("[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 2 has a total capacity "
       "of 79.15 GiB of which 1.02 GiB is free.\n")


@pytest.mark.parametrize("line", [
    # Megatron-Core's gpt_layer_specs.py, through Python logging's default format
    "[rank0]:WARNING:megatron.core.models.gpt.gpt_layer_specs:Apex is not installed. Falling back to Torch Norm\n",
    # huggingface_hub's http_backoff retry notice, then its wait
    "[rank0]:'(ReadTimeoutError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. "
    "(read timeout=10)\"), '(Request ID: 0b3c5e2a-7f1d-4a4e-9d2b-1f2e3d4c5b6a)')' thrown while requesting HEAD "
    "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json\n[rank0]:Retrying in 1s [Retry 1/5].\n",
])
def test_a_warning_the_run_went_on_from_is_not_the_root(tmp_path, line):
    log = tmp_path / "run.log"
    log.write_text(line + FINISHED)
    assert triage([str(log)]).to_dict()["verdict"] == "ok"
    log.write_text(line + OOM)
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("cuda.oom", "gpu_oom", 2)


def test_the_same_texts_raised_still_fail_the_run(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[rank0]: ModuleNotFoundError: No module named 'apex'\n")
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "env.fused_kernels_missing"
    log.write_text("[rank0]: requests.exceptions.ReadTimeout: (ReadTimeoutError(\"HTTPSConnectionPool(host="
                   "'huggingface.co', port=443): Read timed out. (read timeout=10)\"), '(Request ID: 0b6f1c2e-9d3a)')\n")
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "env.hub_unreachable"
