"""One error hierarchy for the library; the CLI alone turns these into messages and exit codes."""

from __future__ import annotations


class TriageError(Exception):
    """Base of every error logtriage raises on purpose."""

    exit_code = 1


class UsageError(TriageError):
    """The command line or an option value is wrong."""

    exit_code = 2


class InputError(TriageError):
    """An input cannot be read: missing, unreadable, a corrupt archive."""

    exit_code = 3


class CatalogError(TriageError):
    """A rule file is malformed; carries every problem found, each with path:line."""

    exit_code = 4

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if self.problems else "catalog error")


class StoreError(TriageError):
    """The incident store cannot be opened or written."""

    exit_code = 5
