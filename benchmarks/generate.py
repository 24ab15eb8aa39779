"""Generate a large, realistic torchrun console log with exactly one injected failure.

    python benchmarks/generate.py --ranks 64 --size 1G --seed 1 --out .bench/run.log \\
        [--failure oom|exception|sigkill|timeout|none] [--fail-rank R] [--fail-at 0.97] \\
        [--style plain|tee|srun] [--ranks-per-node 8] [--no-banner]

Writes LOG and its sidecar LOG-without-extension.expect.toml (what triage must say, and the
1-based `line` of the root-cause evidence). The same arguments give the same bytes.
Sizes are decimal: 100M = 100,000,000 bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loggen.build import generate  # noqa: E402
from benchmarks.loggen.expect import sidecar_path, write_sidecar  # noqa: E402
from benchmarks.loggen.spec import Expectation, FailureKind, GenSpec, SpecError, Style, parse_size  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=64, help="world size (default 64)")
    parser.add_argument("--size", default="100M", help="target size: 100M, 300M, 1G ... (default 100M)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, type=Path, help="the log file to write")
    parser.add_argument("--failure", choices=[k.value for k in FailureKind], default="oom")
    parser.add_argument("--fail-rank", type=int, default=None, help="the culprit (default: drawn from the seed)")
    parser.add_argument("--fail-at", type=float, default=0.97,
                        help="where the failure starts, as a fraction of the size (default 0.97)")
    parser.add_argument("--style", choices=[s.value for s in Style], default="plain",
                        help="plain torchrun, torchrun --tee 3, or srun --label around torchrun")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--no-banner", action="store_true", help="leave out the NGC container banner")


def spec_from_args(args: argparse.Namespace) -> GenSpec:
    return GenSpec(ranks=args.ranks, size=parse_size(args.size), seed=args.seed,
                   failure=FailureKind(args.failure), fail_rank=args.fail_rank, fail_at=args.fail_at,
                   style=Style(args.style), ranks_per_node=args.ranks_per_node, banner=not args.no_banner)


def generate_file(spec: GenSpec, out: Path) -> Expectation:
    """Write the log (atomically: a half-written file never has the final name) and its sidecar."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "wb") as stream:
        expectation = generate(spec, stream)
    write_sidecar(out, spec, expectation)
    os.replace(partial, out)
    return expectation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/generate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except SpecError as exc:
        print(f"generate: error: {exc}", file=sys.stderr)
        return exc.exit_code
    started = time.perf_counter()
    exp = generate_file(spec, args.out)
    seconds = time.perf_counter() - started
    rate = exp.bytes_total / 1e6 / seconds if seconds > 0 else float("inf")
    print(f"{args.out}: {exp.bytes_total} bytes, {exp.lines_total} lines in {seconds:.1f} s ({rate:.0f} MB/s); "
          f"sidecar {sidecar_path(args.out).name}", file=sys.stderr)
    if exp.line:
        print(f"  {exp.rule} on rank {exp.rank} at line {exp.line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
