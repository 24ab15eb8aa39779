"""Benchmarks for issue 6: a generator of large realistic torchrun logs and a paired runner.

    python benchmarks/generate.py --ranks 64 --size 1G --seed 1 --out .bench/run.log
    python benchmarks/run.py --quick

See docs/performance.md for what is measured and how.
"""
