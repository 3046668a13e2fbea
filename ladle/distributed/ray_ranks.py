"""`--distributed-executor-backend ray`: tensor-parallel ranks 1..world-1 as actors on a Ray cluster.

The driver (rank 0) joins the cluster named by RAY_ADDRESS, or the one already running on this
machine, or starts a local one. One placement group reserves every rank's CPUs before any
model loads, so a cluster that is too small is refused at start-up instead of hanging. Each
actor runs the same worker loop an `mp` process does; the ranks then find rank 0's TCP store at
this machine's cluster address. Every node needs ladle installed and the model at the same path.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("ladle")

PLACEMENT_TIMEOUT_S = 60.0


class RayRanks:
    """The same interface as tensor_parallel.LocalRanks, over Ray actors."""

    def __init__(self):
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # CPU ranks: leave device variables alone
        try:
            import ray
        except ImportError as e:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'ladle[ray]'") from e
        self.ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(ignore_reinit_error=True, logging_level=logging.WARNING)
        self.host = ray.util.get_node_ip_address()
        self.actors: list = []
        self.runs: list = []
        self.where: list[tuple[int, str]] = []
        self.group = None

    def start(self, spec) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, need = self.ray, spec.world - 1
        if self._owns_ray and need * spec.num_threads > ray.cluster_resources().get("CPU", 0):
            self._refuse(spec, "on the local Ray instance")  # nothing will join it: say so now, not in 60 s
        self.group = placement_group([{"CPU": spec.num_threads}] * need, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self._refuse(spec, f"within {PLACEMENT_TIMEOUT_S:.0f} s")
        actor = ray.remote(_RankActor)
        for rank in range(1, spec.world):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                        placement_group_bundle_index=rank - 1)
            self.actors.append(actor.options(num_cpus=spec.num_threads, scheduling_strategy=strategy).remote())
        self.where = ray.get([a.where.remote() for a in self.actors])
        self.runs = [a.run.remote(spec, rank) for rank, a in enumerate(self.actors, start=1)]
        log.info("Ray: ranks 1..%d on %s", need, ", ".join(f"{ip} pid {pid}" for pid, ip in self.where))

    def _refuse(self, spec, where: str) -> None:
        free = self.ray.available_resources().get("CPU", 0)
        self.stop(0.0)
        raise ValueError(f"the Ray cluster cannot place {spec.world - 1} tensor-parallel worker(s) of "
                         f"{spec.num_threads} CPU(s) each {where} ({free:g} CPUs free); lower --num-threads "
                         "or add nodes")

    @property
    def pids(self) -> list[int]:
        return [pid for pid, _ in self.where]

    def wait(self, rank: int) -> str:
        """Blocks until the rank's actor ends; how it ended."""
        pid, ip = self.where[rank - 1]
        try:
            self.ray.get(self.runs[rank - 1])
            return f"(Ray actor, pid {pid} on {ip}) stopped"
        except self.ray.exceptions.RayError as e:
            return f"(Ray actor, pid {pid} on {ip}) died: {str(e).strip().splitlines()[0]}"

    def settle(self, timeout: float) -> None:
        if self.runs:
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)

    def stop(self, timeout: float) -> None:
        self.settle(timeout)
        if self._owns_ray:  # the local instance this driver started: shutting it down ends every actor
            self.ray.shutdown()
            return
        # someone else's cluster: hand back what this driver holds, but never hang the engine's shutdown on it
        threading.Thread(target=self._release, name="ladle-ray-release", daemon=True).start()

    def _release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            self.ray.kill(a)
        if self.group is not None:
            remove_placement_group(self.group)


class _RankActor:
    """One rank, as a Ray actor: the same loop an `mp` worker process runs."""

    def where(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, spec, rank: int) -> None:
        from ladle.distributed.tensor_parallel import worker_main

        worker_main(spec, rank)
