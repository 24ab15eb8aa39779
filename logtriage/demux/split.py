"""Split physical lines that hold two ranks' output glued together.

Unbuffered workers write a record and its newline separately, so concurrent ranks produce
`[rank 0] step 1 loss 0.18[rank 1] step 1 loss 0.07` or `...main(args)[rank1]: main(args)`.
A line is cut before every torch prefix that appears after its start, and before every user rank
marker of the same shape as the one the line starts with; a line that starts with a script's bare `rank N `
is cut where another such marker is glued straight onto the end of a print (`rank 1 step 0 loss 1.1142 p_acc
0.125rank 2: ERROR station ...`). The parts, joined, give the line back."""

from __future__ import annotations

import re

_TORCH_PREFIX = re.compile(r"\[rank\d{1,12}\]:(?= |\[|$)|\[[A-Za-z_][A-Za-z_-]*?\d{1,7}\]:(?=\S|$)")
_LEADING = re.compile(r"(?:\d{1,7}: )?(?:\[[^\[\]]{1,120}\](?::|(?=\[))? ?)*")
_USER_MARKER = re.compile(r"\[[Rr]ank ?\d{1,9}\] ")
# a script's bare `rank N ` at a line's start, and the same glued on after the end of another rank's print,
# right after a number or a closing bracket (never after a word: `local_rank 0`, `the rank 2 shard`)
_BARE_START = re.compile(r"rank \d{1,6}[ :/]")
_BARE_GLUED = re.compile(r"(?<=[\d.)\]%])rank \d{1,6}[ :/]")


def split_glued(text: str) -> list[str]:
    bare = text.startswith("rank ") and _BARE_START.match(text) is not None
    if ("]" not in text and not bare) or len(text) < 6:
        return [text]
    cuts = {m.start() for m in _TORCH_PREFIX.finditer(text, 1)}
    if _USER_MARKER.match(text):
        cuts.update(m.start() for m in _USER_MARKER.finditer(text, 1))
    if bare:
        cuts.update(m.start() for m in _BARE_GLUED.finditer(text, 1))
    lead = _LEADING.match(text).end()
    cuts = {c for c in cuts if c > lead}
    if not cuts:
        return [text]
    parts, start = [], 0
    for cut in sorted(cuts):
        if cut > start:
            parts.append(text[start:cut])
            start = cut
    parts.append(text[start:])
    return parts
