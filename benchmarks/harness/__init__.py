"""The runner's parts: measure (timed subprocesses), catalog_inputs (grep patterns, synthetic
rules), machine (where it ran), verify (report vs sidecar), results (values, targets), report
(Markdown into docs/performance.md)."""
