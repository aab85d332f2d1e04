from control.cli.main import main

raise SystemExit(main())
