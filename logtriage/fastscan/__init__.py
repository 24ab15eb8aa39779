"""The fast path of the scan (issue 6): same ScanResult as logtriage.scan.scan, at grep speed."""

from logtriage.fastscan.driver import fast_scan

__all__ = ["fast_scan"]
