"""The issue's yardstick: ordered regexes, first hit wins, no reasoning across ranks.

Issue 2 says such a script scores 90 % category / 43 % rank on the judges' public logs and
49 % / 7 % on their CPU runs. Running it on our own held-out sets tells how hard they are next to
the judges'. Usage: python -m benchmarks.regex_baseline sample_logs/public4 [...]"""
import re
import sys
import tomllib
from pathlib import Path

ORDERED = [(re.compile(p, re.IGNORECASE | re.MULTILINE), c) for p, c in [
    (r"CUDA out of memory|OutOfMemoryError|HIP out of memory", "gpu_oom"),
    (r"DefaultCPUAllocator|\bMemoryError\b|oom.kill|Out of memory: Kill", "host_oom"),
    (r"Detected mismatch between collectives|CollectiveFingerPrint|mismatch.*collective", "collective_mismatch"),
    (r"Watchdog caught collective operation timeout|Timed out waiting \d+ ?ms|collective operation timeout", "collective_timeout"),
    (r"Address already in use|EADDRINUSE", "rendezvous"),
    (r"Rendezvous\w*Error|TCPStore|DistStoreError|rendezvous", "rendezvous"),
    (r"Duplicate GPU|invalid device ordinal", "device_assignment"),
    (r"device-side assert|illegal memory access|CUDA error|CUBLAS_STATUS|cuDNN error", "cuda_runtime"),
    (r"NCCL error|ncclSystemError|ncclInternalError|ncclInvalidUsage|unhandled (system|cuda) error|Connection (reset|closed) by peer", "collective_error"),
    (r"Expected to have finished reduction|did not receive grad|marked as ready twice|find_unused_parameters", "ddp_usage"),
    (r"Missing key\(s\) in state_dict|size mismatch for|Weights only load failed|PytorchStreamReader|Unexpected key\(s\)", "checkpoint"),
    (r"\bnan\b|non-finite|loss scale.*minimum|overflow", "numerical"),
    (r"libcudart|libcupti|CUDA_HOME|externally-managed-environment|ModuleNotFoundError|ImportError|No module named", "environment"),
    (r"unrecognized arguments|can't open file|No such file or directory", "launch_usage"),
    (r"DUE TO TIME LIMIT|CANCELLED|got signal: (15|2)|preempt", "external_stop"),
    (r"SIGSEGV|SIGABRT|SIGKILL|SIGBUS|Signals\.SIG|exitcode\s*:\s*-\d+|Segmentation fault", "crash_signal"),
    (r"^\S*(Error|Exception)\b:?", "python_exception"),
]]
RANK = re.compile(r"\[(?:rank|Rank |RANK )(\d+)\]|\brank[ =:]+(\d+)|local_rank: (\d+)|^(\d+): ", re.IGNORECASE)


def diagnose(text: str) -> tuple[str, int | None]:
    for pattern, category in ORDERED:
        hit = pattern.search(text)
        if hit:
            end = text.find("\n", hit.end())
            line = text[text.rfind("\n", 0, hit.start()) + 1:end if end >= 0 else len(text)]
            rank = RANK.search(line)
            return category, next((int(g) for g in rank.groups() if g), None) if rank else None
    return "unknown", None


def main(folders: list[str]) -> None:
    for folder in folders:
        cat_ok = cat_n = rank_ok = rank_n = 0
        for expect_path in sorted(Path(folder).glob("*.expect.toml")):
            expect = tomllib.loads(expect_path.read_text())
            log = expect_path.with_name(expect_path.name.removesuffix(".expect.toml") + ".log")
            if expect.get("verdict") != "failed" or not log.exists():
                continue
            category, rank = diagnose(log.read_text(errors="replace"))
            cat_n += 1
            cat_ok += category == expect.get("category")
            if "rank" in expect:
                rank_n += 1
                rank_ok += rank == expect["rank"]
        print(f"{folder}: category {cat_ok}/{cat_n} ({100 * cat_ok / max(cat_n, 1):.0f} %), "
              f"rank {rank_ok}/{rank_n} ({100 * rank_ok / max(rank_n, 1):.0f} %)")


if __name__ == "__main__":
    main(sys.argv[1:])
