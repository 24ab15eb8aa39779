"""`triage tui`: a Textual browser for a failed run, rank by rank.

Layout (toolong's split): ``model/`` holds what the screen shows as plain data and imports no
Textual (line index, streams, views, search, alignment, spooling, export); ``widgets/`` and
``app.py`` draw it. This package is the only one in logtriage that imports textual.
"""
