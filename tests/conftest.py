import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]


def checkout_state() -> str | None:
    """``git status --ignored`` of the checkout (None outside a git checkout): what the suite
    must leave as it found it (``test_hygiene.py``)."""
    try:
        done = subprocess.run(["git", "status", "--ignored", "--porcelain"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


# The suite writes nowhere but a temporary directory: its working directory (runs/, .m2flow/,
# logs), HOME and the model cache are there, and no process of it (Ray's workers and command
# lines inherit the environment) writes bytecode beside the sources.
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
WORK = Path(tempfile.mkdtemp(prefix="m2flow-tests-"))
for _name, _var in (("home", "HOME"), ("cache", "M2FLOW_CACHE_DIR"), ("xdg-cache", "XDG_CACHE_HOME")):
    (WORK / _name).mkdir()
    os.environ[_var] = str(WORK / _name)
os.chdir(WORK)
CHECKOUT_AT_START = checkout_state()

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:  # the driver imports the tests folder's env modules too (to read an env's spaces)
    sys.path.insert(0, TESTS)


# Worker classes defined in test modules travel to Ray workers by value: the workers
# cannot import the test modules by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


_shared = {"cluster": None, "pool": None, "next": None, "wants": {}}  # "wants": module -> fixtures its tests ask for


def _module(item) -> str:
    return item.nodeid.partition("::")[0]


def pytest_collection_modifyitems(items):
    """The test modules on the shared cluster run in a row after the others, and those whose
    runs share worker processes (``pool``) last, a flow's modules together (embodied, both,
    reasoning): one Ray and one set of worker processes then serve them all. A module's own
    tests keep their order."""
    wants = _shared["wants"]
    for item in items:
        uses = wants.setdefault(_module(item), set())
        uses.update(item.fixturenames)
        if "cluster" in vars(item.module):  # a Ray of its own: it shares neither (the pool is its own too)
            uses -= {"cluster", "pool"}

    def rank(module: str) -> tuple[int, int]:
        if module.endswith("test_hygiene.py"):  # what the others left behind: after them all
            return 3, 0
        uses = wants[module]
        if "pool" in uses:
            return 2, 0 if "embodied" in module else 2 if "reasoning" in module else 1
        return (1 if "cluster" in uses else 0), 0

    first = {}
    for i, item in enumerate(items):
        first.setdefault(_module(item), i)
    items[:] = sorted(items, key=lambda item: (*rank(_module(item)), first[_module(item)]))


def pytest_collection_finish(session):
    """Every test module is imported: their objects, and the libraries', leave the collector's
    sight, so that the full collections the suite's runs set off skip them (as each worker
    process does with its modules: ``m2flow.runtime.worker``)."""
    gc.collect()
    gc.freeze()


def _next_module_wants(fixture: str) -> bool:
    following = _shared["next"]
    return following is not None and fixture in _shared["wants"][_module(following)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    _shared["next"] = nextitem  # read by the module fixtures' teardowns, which run in this one
    yield


def _alive(c) -> bool:
    """Whether ``c``'s Ray is the one running (a module with a Ray of its own may have replaced it)."""
    return c is not None and ray.is_initialized() and ray.get_runtime_context().get_node_id() == c.nodes[0].node_id


def _close_pool() -> None:
    if _shared["pool"] is not None:
        _shared["pool"].close()
        _shared["pool"] = None


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """A private local Ray, 2 CPUs and 4 logical CPU slots, that test modules in a row share
    (starting and stopping one takes 5-10 s here): it is stopped after a module when the next
    module asks for it in none of its tests, or when any test of the module failed, so that
    what a failed test left running reaches no other module. (The tests of such a module that
    do not ask for it may run beside it: none of them starts a Ray of its own.) Its processes
    import from the tests folder (``fault_envs``, ``pixel_env``) as they would a user's env
    module: the folder is on their Python path."""
    from m2flow.runtime.cluster import Cluster

    module = sys.modules[request.module.__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    if not _alive(_shared["cluster"]):
        _shared["pool"] = None  # its processes ended with their Ray
        if _shared["cluster"] is not None:
            _shared["cluster"].shutdown()  # its Ray was replaced: its shared-memory leftovers go
        if ray.is_initialized():
            ray.shutdown()
        with pytest.MonkeyPatch.context() as env:  # Ray's processes inherit it when it starts
            env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
            _shared["cluster"] = Cluster(num_cpus=2, cpu_slots=4, run_dir=tmp_path_factory.mktemp("run"))
    failed = request.session.testsfailed
    yield _shared["cluster"]
    if request.session.testsfailed > failed or not _next_module_wants("cluster"):
        _close_pool()
        _shared["cluster"].shutdown()
        _shared["cluster"] = None


@pytest.fixture(scope="module")
def pool(cluster, request):
    """Worker processes the runs of test modules in a row share, as planner profiling shares
    them: a rank's process starts (imports, about 13 s a run on 2 cores) once and is
    re-initialised for each later run that names it alike (the runs of one flow do); it is
    closed after a module when the next module does not ask for it, or when any test of the
    module failed. A module with a cluster of its own has a pool of its own. Tests that kill
    workers or time out on them start their own."""
    from m2flow.runtime.pool import WorkerPool

    if cluster is not _shared["cluster"]:  # the module's own cluster: a pool of its own
        own = WorkerPool()
        yield own
        own.close()
        return
    if _shared["pool"] is None:
        _shared["pool"] = WorkerPool()
    failed = request.session.testsfailed
    yield _shared["pool"]
    if request.session.testsfailed > failed or not _next_module_wants("pool"):
        _close_pool()
