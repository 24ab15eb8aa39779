"""A deterministic generator of large torchrun console logs with one injected failure.

`build.generate(spec, stream)` writes the log and returns the Expectation; `expect.write_sidecar`
writes it next to the log. Modules: spec (arguments and results), clock (timestamps), layout
(nodes, pids, prefixes), preamble, training (healthy noise), tracebacks and cascade (the failure).
"""
