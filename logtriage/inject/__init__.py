"""Fault injection: small real training scripts run under real torchrun, one fault each.

``registry.all_scenarios()`` lists the declared scenarios; ``registry.make_plan`` resolves one
variant into a run plan; ``runner.execute`` runs it and captures the console; ``sidecars``
writes the expectation and provenance files. ``triage inject`` (cli.py) drives it all.
"""
