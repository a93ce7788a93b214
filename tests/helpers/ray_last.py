"""The suite on two pytest-xdist workers, the Ray tests last and on one of them.

Most tests use one core at a time (planners, simulators, a single process); two workers
keep both cores busy through them. The Ray tests start clusters of many processes, time
failures against timeouts and already use both cores: they wait until every other test
has been handed out, then all go, in their files' order, to one worker, and the other
ends once its own queue is done. The scheduler knows them by their files, `test_ray_*.py`
(`tests/conftest.py` refuses a Ray test anywhere else, and a test there without the mark).
"""

from __future__ import annotations

from xdist.scheduler import LoadScheduling

RAY_FILE_PREFIX = "test_ray_"


def is_ray_test(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].startswith(RAY_FILE_PREFIX)


class RayTestsLast(LoadScheduling):
    """xdist's `load` scheduling of the other tests; the Ray tests held back until none
    of those is left to hand out, then sent together to the worker that asks next."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self.held: list[int] = []

    @property
    def tests_finished(self) -> bool:
        return not self.held and super().tests_finished

    @property
    def has_pending(self) -> bool:
        return bool(self.held) or super().has_pending

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:  # a worker added later: hand it work as to the others
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        ray = [i for i, nodeid in enumerate(self.collection) if is_ray_test(nodeid)]
        held = set(ray)
        self.held = ray
        self.pending[:] = [i for i in range(len(self.collection)) if i not in held]
        if self.maxschedchunk is None:
            self.maxschedchunk = len(self.collection)
        # consecutive chunks first, as xdist's `load` does (a file's fixtures stay together)
        chunk = max(2, min(len(self.pending) // max(1, len(self.nodes)) // 4, self.maxschedchunk))
        for node in self.nodes:
            self._send_tests(node, chunk)
        for node in self.nodes:
            self.check_schedule(node)

    def check_schedule(self, node, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if self.pending:
            super().check_schedule(node, duration)
        elif self.held:
            # every other test has a worker: this one runs the Ray tests after its queue
            self.node2pending[node].extend(self.held)
            node.send_runtest_some(self.held)
            self.held = []
        else:
            node.shutdown()
