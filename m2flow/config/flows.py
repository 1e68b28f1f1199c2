"""Where a flow is found by the name a config's ``flow`` key gives it: the flows shipped with
m2flow by their short name (the module ``m2flow.runners.<name>``), any other by its module's
import path (``my_package.my_flow``). A flow's module declares ``FLOW`` (a
``runners.flow.Flow``), whose ``config`` is the config's root section and ``check`` the rules
between its keys: loading and checking a config ask the flow for both, so that adding a flow
touches no module here.

A flow's module is imported when a config of it is loaded (its workers' imports with it)."""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path
from typing import Any

PACKAGE = "m2flow.runners"  # a shipped flow's module: PACKAGE.<name>
DECLARES = re.compile(r"^FLOW = Flow\(", re.M)


class UnknownFlow(ValueError):
    pass


def declared(name: Any) -> Any:
    """The ``FLOW`` of the flow ``name`` names; ``UnknownFlow`` (one line) where there is none."""
    if not isinstance(name, str) or not name:
        raise UnknownFlow(f"must name a flow ({' | '.join(shipped())}, or a module's import path), got {name!r}")
    module = name if "." in name else f"{PACKAGE}.{name}"
    try:
        found = getattr(importlib.import_module(module), "FLOW", None)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):  # the flow's module is there; an import of its failed
            raise
        found = None
    if found is None or not hasattr(found, "config"):
        raise UnknownFlow(f"no flow {name!r}: one of {' | '.join(shipped())}, or the import path of a module that "
                          "defines FLOW = Flow(...)")
    return found


def root_of(name: str) -> type:
    """The root config section of the flow ``name`` names."""
    return declared(name).config


@cache
def shipped() -> tuple[str, ...]:
    """The flows shipped with m2flow: the modules of ``PACKAGE`` that declare ``FLOW`` (read,
    not imported)."""
    folder = Path(__file__).resolve().parents[1] / PACKAGE.rpartition(".")[2]
    return tuple(sorted(p.stem for p in folder.glob("*.py") if DECLARES.search(p.read_text())))
