"""A line-prefix template written in double quotes (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${role_name}${rank}]:"`):
the shell expands its fields to nothing before torchrun reads it, and every worker line starts with `[]:` (cpu_adhoc
528th batch, a launcher's quoting slip). The prefix names no rank; what follows it is read as on any line."""

from __future__ import annotations

from logtriage.demux.dialect import Dialect
from logtriage.demux.prefixes import strip_prefixes
from sample_roots import sample_report


def test_the_empty_template_goes_and_the_excepthooks_rank_stays():
    got = strip_prefixes("[]:[rank6]: RuntimeError: Connection closed by peer", Dialect())
    assert (got.text, got.rank, got.layers) == ("RuntimeError: Connection closed by peer", 6,
                                               ("template", "excepthook"))


def test_a_bracketed_empty_list_inside_a_message_is_not_a_prefix():
    got = strip_prefixes("shapes []: none", Dialect())
    assert (got.text, got.rank, got.layers) == ("shapes []: none", None, ())


def test_the_scripts_error_line_behind_the_empty_template_is_its_logged_error():
    rc = sample_report("kayak_errexit_np7_r5_prefix")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.logged_error", "python_exception",
                                                                      5, 29)


def test_the_rank_that_went_on_alone_behind_the_empty_template_is_where_the_hang_was():
    report = sample_report("kayak_slowrank_np3_r1_prefix")
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["rank"]) == ("hung", "hang.stopped_while_waiting", 1)
