"""Cut a captured console (<slug>.full.txt) the way a user pastes it into a GitHub issue (batch 47).

usage: python fault47_paste.py FORM IN [IN2] > OUT      (reads bytes as UTF-8, writes bytes; no other change)

Forms (ONE paste habit per run):
  tail:N       only the last N lines (the top cut off)
  firsttb      the first traceback block in the log (from its first `Traceback (most recent call last):` line, the
               lines that follow with the same prefix, or for a bare block up to and including its exception line),
               then a line `[...]`, then the summary (from the `...ChildFailedError: ` line to the end)
  fenced:N     the whole log inside a Markdown ``` fence, with the user's sentence before ("I get this error when
               running on N GPUs:") and after ("Any idea what is wrong? It works on a single GPU.")
  hard:W       every line cut into pieces of W characters (a terminal copy: no word boundaries)
  wrap:W       every line word-wrapped at W columns (an e-mail client; textwrap, long words broken, continuation
               lines unindented; empty lines kept)
  lstrip       leading whitespace stripped from every line
  nosummary    everything up to the launcher's own `Traceback (most recent call last):` (the first bare one after
               the agent's `failed (exitcode: ...)` line) kept, that traceback and the ChildFailedError summary removed
  twice        IN and IN2 (two runs of the same command) glued one after the other, nothing between
  crlf         every `\n` becomes `\r\n`
  summary:R    rank R's traceback block only (the lines starting `[rankR]: `, contiguous from its Traceback line),
               an empty line, then the summary (from the `...ChildFailedError: ` line to the end); R may be `first`
               (the first prefixed traceback block in the log)
"""
import re, sys, textwrap

CFE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"


def lines_of(path):
    return open(path, "rb").read().decode("utf-8").split("\n")[:-1]


def summary_start(ls):
    return next(i for i, l in enumerate(ls) if l.startswith(CFE))


def block_from(ls, i):
    """The traceback block starting at line i."""
    pre = ls[i][: ls[i].index("Traceback (most recent call last):")]
    out = [ls[i]]
    for l in ls[i + 1:]:
        if pre:
            if not l.startswith(pre):
                break
            out.append(l)
        else:
            out.append(l)
            if l and not l[0].isspace():
                break
    return out


def main():
    form, src = sys.argv[1], sys.argv[2]
    ls = lines_of(src)
    kind, _, arg = form.partition(":")
    if kind == "tail":
        out = ls[-int(arg):]
    elif kind == "firsttb":
        i = next(i for i, l in enumerate(ls) if "Traceback (most recent call last):" in l)
        out = block_from(ls, i) + ["[...]"] + ls[summary_start(ls):]
    elif kind == "fenced":
        out = [f"I get this error when running on {arg} GPUs:", "", "```"] + ls + ["```", "",
               "Any idea what is wrong? It works on a single GPU."]
    elif kind == "hard":
        w = int(arg)
        out = []
        for l in ls:
            out += [l[k:k + w] for k in range(0, len(l), w)] or [""]
    elif kind == "wrap":
        out = []
        for l in ls:
            out += textwrap.wrap(l, width=int(arg), break_on_hyphens=False) or [""]
    elif kind == "lstrip":
        out = [l.lstrip() for l in ls]
    elif kind == "nosummary":
        e = next(i for i, l in enumerate(ls) if re.search(r"\] failed \(exitcode: ", l))
        j = next(i for i in range(e, len(ls)) if ls[i] == "Traceback (most recent call last):")
        out = ls[:j]
    elif kind == "twice":
        out = ls + lines_of(sys.argv[3])
    elif kind == "crlf":
        sys.stdout.buffer.write("".join(l + "\r\n" for l in ls).encode("utf-8"))
        return
    elif kind == "summary":
        if arg == "first":
            i = next(i for i, l in enumerate(ls) if re.match(r"(\[\w+\]:)?\[rank\d+\]: Traceback", l))
        else:
            i = next(i for i, l in enumerate(ls) if f"[rank{arg}]: Traceback (most recent call last):" in l)
        out = block_from(ls, i) + [""] + ls[summary_start(ls):]
    else:
        raise SystemExit(f"unknown form {form}")
    sys.stdout.buffer.write("".join(l + "\n" for l in out).encode("utf-8"))


if __name__ == "__main__":
    main()
