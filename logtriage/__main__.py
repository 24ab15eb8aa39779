from logtriage.cli import entry

entry()
