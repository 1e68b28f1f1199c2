import sys

import pytest
import ray

# Worker classes defined in test modules travel to Ray workers by value: the workers
# cannot import the test modules by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


_shared = {"cluster": None, "next": None}  # the embedded Ray modules in a row share; the test after this one


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    _shared["next"] = nextitem  # read by the cluster fixture's teardown, which runs in this one
    yield


def _alive(c) -> bool:
    """Whether ``c``'s Ray is the one running (a module with a Ray of its own may have replaced it)."""
    return c is not None and ray.is_initialized() and ray.get_runtime_context().get_node_id() == c.nodes[0].node_id


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """A private local Ray, 2 CPUs and 4 logical CPU slots, that test modules in a row share
    (starting and stopping one takes 5-10 s here): it is stopped after a module when the next
    test does not ask for it, or when any test of the module failed, so that what a failed
    test left running reaches no other module."""
    from m2flow.runtime.cluster import Cluster

    module = sys.modules[request.module.__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    if not _alive(_shared["cluster"]):
        if _shared["cluster"] is not None:
            _shared["cluster"].shutdown()  # its Ray was replaced: its shared-memory leftovers go
        if ray.is_initialized():
            ray.shutdown()
        _shared["cluster"] = Cluster(num_cpus=2, cpu_slots=4, run_dir=tmp_path_factory.mktemp("run"))
    failed = request.session.testsfailed
    yield _shared["cluster"]
    following = _shared["next"]
    if request.session.testsfailed > failed or following is None or "cluster" not in following.fixturenames:
        _shared["cluster"].shutdown()
        _shared["cluster"] = None


@pytest.fixture(scope="module")
def pool(cluster):
    """Worker processes the runs of a test module share, as planner profiling shares them: a
    rank's process starts (imports, about 13 s a run on 2 cores) once per module and is
    re-initialised for each later run that names it alike. Tests that kill workers or time out
    on them start their own."""
    from m2flow.runtime.group import WorkerPool

    p = WorkerPool()
    yield p
    p.close()
