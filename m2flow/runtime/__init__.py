"""The distributed runtime: devices, placement, workers, communication, channels, locks, traces."""

from m2flow.runtime.channel import Channel, ChannelClosed, ChannelEmpty, ChannelFull
from m2flow.runtime.cluster import Cluster, Device
from m2flow.runtime.comm import CommWork
from m2flow.runtime.device_lock import DeviceLock, LockTimeout
from m2flow.runtime.group import GroupHandle, WorkerDiedError, WorkerError, WorkerGroup
from m2flow.runtime.placement import ComponentPlacement, Placement, PlacementError
from m2flow.runtime.trace import get_tracer, write_chrome_trace
from m2flow.runtime.worker import Worker, dispatch

__all__ = [
    "Channel", "ChannelClosed", "ChannelEmpty", "ChannelFull", "Cluster", "CommWork", "ComponentPlacement",
    "Device", "DeviceLock", "GroupHandle", "LockTimeout", "Placement", "PlacementError", "Worker",
    "WorkerDiedError", "WorkerError", "WorkerGroup", "dispatch", "get_tracer", "write_chrome_trace",
]
