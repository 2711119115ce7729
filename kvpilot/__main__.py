from kvpilot.cli import main

raise SystemExit(main())
