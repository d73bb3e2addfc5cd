from torchoffload.cli import main

raise SystemExit(main())
