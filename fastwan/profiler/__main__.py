from fastwan.profiler.core import main

raise SystemExit(main())
