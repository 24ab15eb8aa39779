"""What a person pastes around a log in an issue or a chat, which is not the log: collect_env's
report of the machine (an issue template asks for it under or above the paste), the reporter's own
sentences (`I get the following error when running on 8 GPUs:`), a template's Markdown headings."""

from __future__ import annotations

import re

# `python -m torch.utils.collect_env`'s report (an issue template asks for it under the log): no job output
_ENVIRONMENT_REPORT = re.compile(
    r"^\s*(?:\[(?:pip3?|conda)\] |Collecting environment information|(?:PyTorch version|Is debug build|"
    r"CUDA used to build PyTorch|ROCM used to build PyTorch|Is CUDA available|CUDA runtime version|"
    r"CUDA_MODULE_LOADING set to|GPU models and configuration|Nvidia driver version|cuDNN version|"
    r"HIP runtime version|MIOpen runtime version|Is XNNPACK available|Python version|Python platform|"
    r"Libc version|GCC version|Clang version|CMake version|OS|Versions of relevant libraries|"
    # its CPU section is lscpu's
    r"CPU|Architecture|CPU op-mode\(s\)|Address sizes|Byte Order|CPU\(s\)|On-line CPU\(s\) list|Vendor ID|"
    r"Model name|CPU family|Model|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|Stepping|BogoMIPS|Flags|"
    r"Virtuali[sz]ation(?: type)?|Hypervisor vendor|L[123][di]? cache|NUMA node\d* ?(?:\(s\)|CPU\(s\))?)"
    r":|Vulnerability )")
_REPORT_GAP = 16     # lscpu's lines between the report's own (a 2-socket host's flags, caches)
# lines only collect_env writes (a script printing its own `PyTorch version:` is job output)
_REPORT_OWN = re.compile(r"^\s*(?:\[(?:pip3?|conda)\] |Collecting environment information|Is debug build:|"
                         r"Versions of relevant libraries:)")
_REPORT_START = re.compile(r"^\s*(?:Collecting environment information|PyTorch version:)")


def environment_report_span(lines: list[str]) -> tuple[int, int] | None:
    """[start, end) of collect_env's report among the lines (pasted under or above the log), from
    its first line to its last (`[pip3] ...`, `[conda] ...`), the CPU lines between them included."""
    marked = [i for i, line in enumerate(lines) if _ENVIRONMENT_REPORT.match(line)]
    best: tuple[int, int] | None = None
    start = 0
    for k in range(1, len(marked) + 1):   # runs of marked lines at most _REPORT_GAP apart
        if k == len(marked) or marked[k] - marked[k - 1] > _REPORT_GAP:
            run = marked[start:k]
            # (from its own first line where the run has it: a log's `Model: ...` just above stays)
            first = next((i for i in run if _REPORT_START.match(lines[i])), run[0])
            if len(run) >= 3 and any(_REPORT_OWN.match(lines[i]) for i in run) and (
                    best is None or run[-1] + 1 - first > best[1] - best[0]):
                best = (first, run[-1] + 1)
            start = k
    return best


# the person who pasted the log, around it: "I get the following error when running on 8 GPUs:",
# "I already tried ..., it still fails with the same error"
_FIRST_PERSON = re.compile(r"\b(?:I|[Ww]e)(?:'m|'ve| am| are| have| had| also| already| still)? (?:get|got|getting|see|saw|"
                           r"seeing|tried|trying|ran|run|running|encounter\w*|fac(?:e|ed|ing)|hit|meet|met|receiv\w+)\b")
# an issue template's Markdown heading above the paste (`### Error logs`)
_HEADING = re.compile(r"^#{1,6} \S")


def reporters_words(text: str) -> bool:
    """A line the reporter wrote around the paste: a sentence in the first person, a heading."""
    return bool(_FIRST_PERSON.search(text) or _HEADING.match(text))
