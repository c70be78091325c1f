"""Shared fixtures: one Ray instance and one tiny prepared task per test session."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_models import TINY_SHAPE, tiny_model

from treadle.runtime.omp import openmp_env

# OpenMP's waiting as a run's processes have it (libgomp reads it when torch first loads it,
# after this): the soak runs beside the other tests, and the machine may be shared.
os.environ.update(openmp_env())
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# datasets pings the hub (a HEAD request, up to 3 s with no network) per load_dataset otherwise
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
# `treadle check`'s kept answers (treadle.runtime.cache): this session's own folder, not ~/.cache
_CHECK_CACHE = tempfile.TemporaryDirectory(prefix="treadle-check-cache-")
os.environ.setdefault("TREADLE_CHECK_CACHE", _CHECK_CACHE.name)
# the library messages of commands that have no run directory (treadle.cli.console): not ~/.cache
_COMMAND_LOGS = tempfile.TemporaryDirectory(prefix="treadle-command-logs-")
os.environ.setdefault("TREADLE_LOGS", _COMMAND_LOGS.name)


# A test that starts Ray or a real inference engine is `slow` (`make test-fast` leaves it out),
# and so is one that starts a `treadle` command, a server or a browser in a process of its own,
# or compares whole runs (a resumed run against a straight one): the edit-run loop keeps the
# tests that take a second or two. Those that get Ray or an engine from these fixtures are marked
# here; the others carry the mark themselves, and one that starts Ray without it fails at
# `ray.init` (see _fast_tests_start_no_ray).
STARTS_RAY_OR_ENGINE = {"ray_session", "ray_actor", "vllm_session"}


def pytest_collection_modifyitems(items):
    for item in items:
        if STARTS_RAY_OR_ENGINE & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# A `background` test's module has `start(folder) -> Popen`: its process starts once the
# session's tests are chosen and runs beside them; the test runs last and gets (process,
# folder) from the `background` fixture. For work bounded by time (the soak's three minutes),
# which would otherwise leave the second core idle under the mostly one-core tests. A `late`
# test runs after the others (before the background ones), when the background processes have
# ended: one that starts Ray nodes with fixed deadlines of Ray's own (tests/controller/
# test_cluster.py's two-node cluster: 22 s alone, 85-184 s as the soak started beside it).
_BACKGROUND: dict[str, tuple[subprocess.Popen[str], Path]] = {}


class _Background:
    @pytest.hookimpl(trylast=True)  # after `-m`/`-k` chose the tests
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: (_marked(item, "background"), _marked(item, "late")))

    def pytest_collection_finish(self, session):
        if session.config.option.collectonly:
            return
        for item in session.items:
            if _marked(item, "background"):
                folder = Path(tempfile.mkdtemp(prefix="treadle-background-"))
                _BACKGROUND[item.nodeid] = (item.module.start(folder), folder)

    def pytest_sessionfinish(self, session):
        for proc, _ in _BACKGROUND.values():
            if proc.poll() is None:  # its test did not run to the end (stopped, -x)
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _marked(item: pytest.Item, name: str) -> bool:
    return item.get_closest_marker(name) is not None


def pytest_configure(config):
    config.pluginmanager.register(_Background(), "treadle-background")
    # (here rather than in pyproject.toml's list: the tests' own business)
    long = "long: a long check that `make test` leaves to `make test-long` (docs/testing.md)"
    config.addinivalue_line("markers", long)


@pytest.fixture
def background(request):
    return _BACKGROUND[request.node.nodeid]


@pytest.fixture(autouse=True)
def _fast_tests_start_no_ray(request, monkeypatch):
    if request.node.get_closest_marker("slow") is None:
        try:
            import ray
        except ImportError:  # (the GPU machine's image has no Ray: nothing can start it)
            return

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{request.node.nodeid} starts Ray: mark it `slow`")

        monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="module", autouse=True)
def _a_module_leaves_the_logs_routed_as_it_found_them(request):
    """A trainer left open (``t.actors.close()`` instead of ``t.close()``) keeps the library
    loggers and Python's warnings routed to its run's log: a later test in the same process
    (under xdist, whichever file comes next) then fails for no reason of its own. Caught at
    the module that leaves it, once its own fixtures are closed."""
    yield
    tracker = sys.modules.get("treadle.tracking.tracker")
    if tracker is not None and tracker._route is not None:
        tracker._route.restore()  # (so that the next module starts clean)
        pytest.fail(f"{request.node.nodeid} leaves the logs routed: close its trainer")


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """The built-in task at test size: data, tokenizer, a ~0.1M model.

    Head size 32 (64 / 2 heads): the smallest vLLM's CPU attention runs."""
    return _tiny(tmp_path_factory.mktemp("arithmetic"), 400, 64, max_positions=128)


@pytest.fixture(scope="session")
def long_task(tmp_path_factory):
    """The tiny task with room for tool instructions, games and several turns: 1152 positions
    (its tokenizer spells English nearly letter by letter: the tool instructions alone are ~800
    tokens, TextArena's first message ~600)."""
    return _tiny(tmp_path_factory.mktemp("arithmetic_long"), 64, 16, max_positions=1152)


def _tiny(out, n_train: int, n_test: int, max_positions: int):  # type: ignore[no-untyped-def]
    """The built-in task (sums up to 20) with the tests' tiny model shape."""
    from treadle.tasks.arithmetic import prepare

    return prepare(
        out,
        seed=0,
        n_train=n_train,
        n_test=n_test,
        max_value=20,
        shape=replace(TINY_SHAPE, max_positions=max_positions),
    )


@pytest.fixture(scope="session")
def length_reward(tmp_path_factory):
    """A user reward function that varies across samples even for an untrained model."""
    path = tmp_path_factory.mktemp("reward") / "length_reward.py"
    path.write_text(
        "def score(prompt, response, ground_truth):\n    return (len(response) % 7) / 6\n"
    )
    return f"{path}:score"


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from treadle.controller.cluster import _fewer_daemons, _on_loopback

        os.environ.setdefault("RAY_worker_niceness", "0")
        # as a run starts its own (treadle.controller.cluster): no log monitor, no autoscaler,
        # no idle workers ahead (the suite's log monitors took ~70 CPU-s of a `make test` on
        # 2026-11-29, most of it this one's, reading the workers' output while the session
        # lasts); a worker's error still reaches the test as its exception.
        with _on_loopback(), _fewer_daemons(log_monitor=False):
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                _system_config={"prestart_worker_first_driver": False},
            )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def env(tiny_task, tmp_path_factory):  # type: ignore[no-untyped-def]
    """For `treadle check` cases (tests/test_check.py, tests/test_bad_input.py): a good run
    config (tiny model, 40 prompts, 16 pairs) and a scratch directory, one per module."""
    from pathlib import Path

    import yaml

    root = tmp_path_factory.mktemp("check")

    def head(src: Path, name: str, n: int) -> str:
        lines = Path(src).read_text().splitlines()[:n]
        (root / name).write_text("\n".join(lines) + "\n")
        return str(root / name)

    files = {
        "model": str(tiny_task["model"]),
        "train": head(tiny_task["train"], "train.jsonl", 40),
        "test": head(tiny_task["test"], "test.jsonl", 8),
        "pairs": head(tiny_task["pairs_train"], "pairs.jsonl", 16),
    }
    config = {
        "model": {"path": files["model"]},
        "data": {
            "train_files": [files["train"]],
            "val_files": [files["test"]],
            "max_prompt_length": 64,
            "batch_size": 8,
        },
        "rollout": {"n": 4, "max_new_tokens": 32},
        "reward": {"function": "arithmetic", "num_workers": 0},
        "actor": {"ppo_mini_batch_size": 32, "micro_batch_size": 8},
        "trainer": {"backend": "local", "output_dir": str(root / "run"), "progress": False},
    }
    path = root / "good.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return {**files, "config": str(path), "root": root, "raw": config}


@pytest.fixture(scope="session")
def teacher_model(tiny_task, tmp_path_factory):
    """A distillation teacher for the tiny task: another model (3 layers, its own seed) with
    the tiny task's tokenizer."""
    return tiny_model(
        tmp_path_factory.mktemp("teacher"),
        tiny_task["model"],
        num_layers=3,
        intermediate_size=96,
        seed=7,
    )


@pytest.fixture(scope="session")
def parallel_model(tiny_task, tmp_path_factory):
    """The tiny task's model shape with 4 heads and 2 key/value heads, so that 2 tensor- or
    sequence-parallel ranks can split them (the tiny task's model has 1 key/value head)."""
    return tiny_model(
        tmp_path_factory.mktemp("parallel_model"), tiny_task["model"], num_heads=4, num_kv_heads=2
    )


@pytest.fixture(scope="session")
def shapes_task(tmp_path_factory):
    """The built-in image task at test size: 48 train and 16 test pictures, a tiny Idefics3
    (~0.3M parameters) with its processor."""
    from treadle.tasks.shapes import prepare

    out = tmp_path_factory.mktemp("shapes")
    return prepare(out, seed=0, n_train=48, n_test=16, hidden_size=64, num_layers=2)
