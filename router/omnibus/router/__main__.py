"""`python -m omnibus.router serve ...` (the `omnibus-router` console script)."""

from omnibus.router.cli import main

raise SystemExit(main())
