"""Resource pools: a Ray placement group with one bundle per rank.

Roles that share a pool are colocated: they take turns on its bundles (here: one fused worker
class per process holds actor, rollout engine and reference, or several worker groups each
take a ``share`` of every bundle, so that Ray places rank r of each on bundle r). A role with
a pool of its own is split: it runs beside the others. A pool that does not fit the cluster
in 120 s is an error that says what to ask for instead, and gives its bundles back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.runtime.errors import TreadleError


@dataclass
class ResourcePool:
    """A Ray placement group with one bundle per rank; roles sharing it are colocated.

    ``resources``: Ray custom resources every bundle also holds, which places the pool on the
    nodes started with them (``ray start --resources='{"rollout": 2}'``)."""

    world_size: int
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        bundle: dict[str, float] = {"CPU": self.cpus_per_rank, **self.resources}
        if self.gpus_per_rank:
            bundle["GPU"] = self.gpus_per_rank
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            free = {k: v for k, v in ray.available_resources().items() if "memory" not in k}
            raise TreadleError(
                f"{self.world_size} bundles of {bundle} did not fit the Ray cluster in 120 s "
                f"(free now: {free}): ask for fewer CPUs/GPUs (trainer.num_cpus, "
                "rollout.num_cpus, rollout.replicas) or add nodes"
            ) from None

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
