from analyzer.cli import main

raise SystemExit(main())
