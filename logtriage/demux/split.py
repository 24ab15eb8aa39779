"""Split physical lines that hold two ranks' output glued together.

Unbuffered workers write a record and its newline separately, so concurrent ranks produce
`[rank 0] step 1 loss 0.18[rank 1] step 1 loss 0.07` or `...main(args)[rank1]: main(args)`.
A line is cut before every torch prefix that appears after its start, and before every user rank
marker of the same shape as the one the line starts with. The parts, joined, give the line back."""

from __future__ import annotations

import re

_TORCH_PREFIX = re.compile(r"\[rank\d{1,12}\]:(?= |\[|$)|\[[A-Za-z_][A-Za-z_-]*?\d{1,7}\]:(?=\S|$)")
_LEADING = re.compile(r"(?:\d{1,7}: )?(?:\[[^\[\]]{1,120}\](?::|(?=\[))? ?)*")
_USER_MARKER = re.compile(r"\[[Rr]ank ?\d{1,9}\] ")


def split_glued(text: str) -> list[str]:
    if "]" not in text or len(text) < 6:
        return [text]
    cuts = {m.start() for m in _TORCH_PREFIX.finditer(text, 1)}
    if _USER_MARKER.match(text):
        cuts.update(m.start() for m in _USER_MARKER.finditer(text, 1))
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
