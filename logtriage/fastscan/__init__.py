"""The fast path of the scan (issue 6): same ScanResult as logtriage.scan.scan, at grep speed."""

from logtriage.fastscan.kernel_cache import drop_stale_cache

drop_stale_cache()   # before any kernel function loads its cached machine code

from logtriage.fastscan.driver import fast_scan  # noqa: E402

__all__ = ["fast_scan"]
