from logtriage.cli import main

raise SystemExit(main())
