"""`python -m bbrules`: the same command line as the `bbrules` console script."""

from .cli import main

raise SystemExit(main())
