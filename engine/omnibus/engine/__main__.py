"""`python -m omnibus.engine serve ...` (the `omnibus-engine` console script)."""

from omnibus.engine.serving.cli import main

raise SystemExit(main())
