"""The distributed runtime: devices, placement, workers, communication, channels, locks, traces,
and the watchdog that stops a run that no longer moves.

The names below are imported on first use, all at once: importing one runtime module
alone (``channel_actor`` in a channel's actor process, ``device_lock`` in a lock's) must
not import torch with them.
"""

from typing import Any

# module: the names it exports from the package
_EXPORTS = {
    "channel": ("Channel", "ChannelClosed", "ChannelEmpty", "ChannelFull"),
    "clock": ("Clock",),
    "cluster": ("Cluster", "Device"),
    "comm": ("CommWork",),
    "device_lock": ("DeviceLock", "LockTimeout"),
    "dispatching": ("dispatch",),
    "errors": ("WorkerDiedError", "WorkerError"),
    "group": ("GroupHandle", "WorkerGroup"),
    "placement": ("ComponentPlacement", "Placement", "PlacementError"),
    "trace": ("get_tracer", "write_chrome_trace"),
    "watchdog": ("RunHung", "Watchdog"),
    "worker": ("Worker",),
}
__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from m2flow.runtime import (channel, clock, cluster, comm, device_lock, dispatching, errors, group, placement, trace,
                                watchdog, worker)

    for module in (channel, clock, cluster, comm, device_lock, dispatching, errors, group, placement, trace, watchdog,
                   worker):
        globals().update((n, getattr(module, n)) for n in _EXPORTS[module.__name__.rpartition(".")[2]])
    return globals()[name]
