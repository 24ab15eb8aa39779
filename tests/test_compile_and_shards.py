"""torch.compile's exceptions, sharded training's prefixes and an evaluation script's own checks, on real
CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 54th-56th batches, each labelled before triage ran;
the test names the run)."""

from __future__ import annotations

from logtriage.analysis.exception_names import exception_type_of

from sample_roots import root_facts as _root


def test_dynamos_exceptions_are_exceptions_whatever_their_names_end_with():
    assert exception_type_of("torch._dynamo.exc.Unsupported: Dynamo recompile limit exceeded") == \
        "torch._dynamo.exc.Unsupported"
    assert exception_type_of("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:") == \
        "torch._dynamo.exc.BackendCompilerFailed"
    assert exception_type_of("requests.exceptions.ConnectTimeout: timed out") == "requests.exceptions.ConnectTimeout"
    assert exception_type_of("torch.distributed.elastic.multiprocessing.errors: nothing") is None


def test_a_backend_failure_is_dynamos_wrapper_around_the_backends_own_error():
    # cc_backend_np4_r2_tee3: `BackendCompilerFailed: backend='compile_fn' raised:` then, on the next line,
    # the custom backend's RuntimeError (the line that says why)
    assert _root("cc_backend_np4_r2_tee3") == ("python.exception", "python_exception", 2, 56,
                                               "torch._dynamo.exc.BackendCompilerFailed")


def test_a_short_template_label_before_torchs_own_rank_prefix_is_learned_from_a_few_lines():
    # shard_hidden_np4_r1_template: `[r1] [rank1]: ...` on only 24 of 80 lines (a long summary after them);
    # the exception line is the event, not the `raise` line above it that quotes the same words
    assert _root("shard_hidden_np4_r1_template") == ("numerical.checked_nonfinite", "numerical", 1, 10, "FloatingPointError")


def test_an_evaluation_scripts_non_finite_check_is_numerical():
    # eval_nan_np4_r2_prefix: `FloatingPointError: non-finite logits in batch 1 on rank 2`, the script's own
    # check raised as FloatingPointError whatever the quantity
    assert _root("eval_nan_np4_r2_prefix") == ("numerical.checked_nonfinite", "numerical", 2, 12, "FloatingPointError")
