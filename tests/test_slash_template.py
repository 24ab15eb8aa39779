"""A line-prefix template whose fields are joined by `-` and `/` (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=
'[${role_name}-r${rank}/l${local_rank}]:'` renders `[default-r0/l0]:`) is stripped like the `|` and `=` forms, so
the traceback after it is read as one: its exception line gives the root its type (cpu_adhoc 548th batch)."""

from __future__ import annotations

import pytest

from logtriage.demux.prefixes import Dialect, strip_prefixes
from sample_roots import root_facts


@pytest.mark.parametrize("line,text,rank,local", [
    ("[default-r0/l0]:[rank0]: RuntimeError: Error(s) in loading state_dict", "RuntimeError: Error(s) in loading "
     "state_dict", 0, 0),
    ("[default-r3/l1]:[rank3]: \tsize mismatch for 0.weight", "\tsize mismatch for 0.weight", 3, 1),
    ("[trainer-r5/l1]:rank 5 step 1 loss 0.25", "rank 5 step 1 loss 0.25", 5, 1),
    ("[rank=1,local=1] hello", "hello", 1, 1),
])
def test_the_template_is_stripped_with_its_ranks(line, text, rank, local):
    p = strip_prefixes(line, Dialect())
    assert (p.text, p.rank, p.local_rank, p.layers[0]) == (text, rank, local, "template")


@pytest.mark.parametrize("line", ["[12/50] epoch 3 loss 0.4", "[2/8] building extension", "[epoch 1/10] loss 0.3"])
def test_a_bracket_without_a_rank_field_stays_text(line):
    p = strip_prefixes(line, Dialect())
    assert (p.text, p.rank) == (line, None)


def test_the_size_mismatch_under_the_template_has_its_exception_type():
    assert root_facts("gorse_ckpt_size_np6_r0_prefix") == \
        ("ckpt.size_mismatch", "checkpoint", 0, 9, "RuntimeError")
