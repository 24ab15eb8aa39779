from logtriage.report.model import Report
from logtriage.report.render import FORMATS, render

__all__ = ["Report", "render", "FORMATS"]
