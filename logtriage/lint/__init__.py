"""`triage lint`: static checks of training code and launch templates for known hang and crash
patterns. Each rule is one unit (id, docs, linked runtime catalog ids, annotated fixtures); the
code is parsed, never imported.

    from logtriage.lint import lint_paths
    result = lint_paths(["train.py", "jobs/"])
    for finding in result.findings: ...
"""

from logtriage.lint.engine import lint_paths, lint_text
from logtriage.lint.model import FileKind, Finding, LintResult, LintRule, Severity

__all__ = ["lint_paths", "lint_text", "FileKind", "Finding", "LintResult", "LintRule", "Severity"]
