"""Ray for a run: start a local cluster, or join a running one.

Filled in below; kept importable from treadle.trainers.common.
"""

from __future__ import annotations

import os

from treadle.config import Config


def total_cpus(cfg: Config) -> float:
    return float(cfg.trainer.num_cpus or os.cpu_count() or 1)


def ensure_ray(cfg: Config) -> None:
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(
            num_cpus=int(total_cpus(cfg)),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
