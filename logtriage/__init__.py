"""logtriage: find why a distributed PyTorch run died from its console log."""

__version__ = "0.1.0"
