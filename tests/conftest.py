import sys

import pytest
import ray

# Worker classes defined in test modules travel to Ray workers by value: the workers
# cannot import the test modules by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """A private local Ray per test module: 2 CPUs, 4 logical CPU slots."""
    from m2flow.runtime.cluster import Cluster

    module = sys.modules[request.module.__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(num_cpus=2, cpu_slots=4, run_dir=tmp_path_factory.mktemp("run"))
    yield c
    c.shutdown()


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
