"""``python -m m2flow``: the ``m2flow`` command, where the package is importable but not installed."""

from m2flow.cli import main

raise SystemExit(main())
