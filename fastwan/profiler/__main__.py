from fastwan.profiler.cli import main

raise SystemExit(main())
