"""The viewer's keys, as data: the app builds its bindings (and so its footer) from this table
and `triage tui --help` prints it, so the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    key: str          # Textual key name
    shown: str        # how --help writes it
    action: str       # the app's action_<name>
    label: str        # footer
    help: str         # --help


KEYS: tuple[Key, ...] = (
    Key("e", "e", "next_finding", "finding", "next finding in the view"),
    Key("E", "E", "previous_finding", "prev", "previous finding in the view"),
    Key("r", "r", "root_cause", "root", "jump to the root cause: its stream selected, its line in view"),
    Key("slash", "/", "search", "search", "search the view (RE2 regex; case-insensitive unless it has capitals): "
                                          "match count, matches highlighted"),
    Key("n", "n", "next_match", "match", "next search match"),
    Key("N", "N", "previous_match", "prev", "previous search match"),
    Key("ampersand", "&", "filter", "filter", "show only lines matching a pattern (an empty pattern shows all again)"),
    Key("x", "x", "errors_only", "errors", "show only findings and their tracebacks (toggle)"),
    Key("m", "m", "merged", "merged", "merged view: every stream in input order, coloured by rank "
                                     "(several files: by timestamp) (toggle)"),
    Key("s", "s", "split", "split", "split view: this stream beside the one selected in the rank list, "
                                   "aligned on step, else time (toggle)"),
    Key("t", "t", "follow", "tail", "follow a growing file: new lines at the bottom, triage re-run when it pauses "
                                   "(toggle)"),
    Key("question_mark", "?", "explain", "explain", "the rule of the finding under the cursor (or selected): "
                                                   "explanation, fix, misdiagnosis"),
    Key("w", "w", "export", "export", "write the report as Markdown to a file"),
    Key("q", "q", "quit", "quit", "quit"),
)

MOVES = ("tab / shift+tab   next / previous pane (ranks, log, findings)",
         "enter             select the stream or finding under the cursor",
         "up down pgup pgdn home end   move the cursor; left / right scroll long lines",
         "escape            close a prompt or a panel")


def keys_help() -> str:
    lines = ["keys:"]
    lines += [f"  {k.shown:<16}  {k.help}" for k in KEYS]
    lines += [f"  {m}" for m in MOVES]
    return "\n".join(lines)
