from pin_and_cite.cli import main

raise SystemExit(main())
