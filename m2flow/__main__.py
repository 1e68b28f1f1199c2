"""``python -m m2flow``: the ``m2flow`` command, where the package is importable but not installed."""

from m2flow.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
