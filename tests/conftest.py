"""Shared fixtures. Tests run on CPU with tiny models the code builds; nothing is downloaded."""

import importlib.metadata
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

# OpenMP threads that wait sleep instead of spinning, in this process and every process it starts (launch.py
# runs, Ray's workers): torch's 2 threads per component spin-wait in each parallel region, and on 2 cores
# shared with another process (a Ray actor, the MLflow server, a second test run) a tiny model's step
# then took 4-14 s instead of 0.2-1.3 s (measured: a 6-step launch.py run 125-142 s -> 55-89 s under load,
# the same metrics). Same threads, same kernels, same numbers: only how an idle thread waits. It must be
# set before torch loads its OpenMP runtime; an OMP_WAIT_POLICY of the caller's is kept. Not in the vLLM
# tier's environment (.venv-vllm), whose CPU backend manages its OpenMP threads itself.
if "torch" not in sys.modules and "vllm" not in importlib.metadata.packages_distributions():
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# tmp_path / tmp_path_factory and this process's tempfile dirs in RAM (/dev/shm) where there is one
# with room: the runs' checkpoints are written and read there. Only this process's tempfile module:
# not TMPDIR, which Ray would follow for its session dirs and sockets, and which subprocesses inherit.
# MILES_TEST_TMP=default keeps the default (/tmp or TMPDIR).
_SHM = Path("/dev/shm")
if os.environ.get("MILES_TEST_TMP") != "default" and "TMPDIR" not in os.environ and _SHM.is_dir() \
        and os.access(_SHM, os.W_OK) and os.statvfs(_SHM).f_bavail * os.statvfs(_SHM).f_frsize > 4 << 30:
    tempfile.tempdir = str(_SHM)


# What a composition reads besides conf/ and the overrides: conf/config.yaml's ${oc.env:...} defaults.
_COMPOSE_ENV = ("MILES_CACHE_DIR", "MILES_SWEEPS_DIR")


@pytest.fixture(scope="session")
def compose():
    """compose(overrides) -> typed RunCfg, through the same ConfigStore schema launch.py uses.
    Each distinct composition is made once per process and handed out as a deep copy (a Hydra
    composition costs ~0.3 s on 2 cores, and the unit tests repeat a quarter of theirs: 175 of 696)."""
    import copy

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from miles.config.store import register_configs

    register_configs()
    composed: dict = {}

    def _compose(overrides=()):
        overrides = list(overrides)
        key = (tuple(overrides), *(os.environ.get(name) for name in _COMPOSE_ENV))
        if key not in composed:
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                dcfg = hydra_compose("config", overrides=overrides)
            composed[key] = OmegaConf.to_object(dcfg)
        return copy.deepcopy(composed[key])

    return _compose


# Each Ray test module starts a local Ray in this process (`ray_connection`), and each Ray run through
# run_with / launch.py starts its own (run_with runs on the module's Ray where the test holds one,
# killing each run's actors: ray_runs.on_this_ray): never one Ray shared by the session or joined from
# another process. Both of those were tried (2026-12-04) and CI failed 56 Ray tests each time with
# "the actor never ran - it was cancelled before it started", after the external-cluster tests had
# run; this arrangement passed every CI run before them. address="local" starts a new Ray even where
# one runs on the machine (a `ray start` of the external-cluster tests, which `make test` runs in a
# pass of their own).
RAY_CPUS = 4  # the most any test asks for at once: 2 FSDP ranks + 2 engines (test_scale_out_runs)


@pytest.fixture(scope="module")
def ray_connection():
    """A local Ray in this process for the module's tests, started as a run starts it (start_ray: its
    workers at nice 0, so the other xdist worker's tests do not starve the actors)."""
    import ray

    from miles.orchestrate.handles import start_ray

    start_ray(None, RAY_CPUS)
    yield
    ray.shutdown()


# Under pytest-xdist (`make test`, `make test-fast`: -n 2 --dist loadgroup) the tests of every file
# that may start a Ray (in this process, through a run, or in a launch.py subprocess: Ray is on by
# default) form one scope of the scheduler (pytest_xdist_make_scheduler below), so one worker runs
# them, one file after another, and two Rays never run at once (2b368db: 2 workers running Ray
# files side by side had 9 of ~100 Ray tests' actors "cancelled before they started"). Every other
# file is a scope of its own, as --dist loadfile: the other worker runs those meanwhile. The test is
# on the file's text and errs towards Ray. Inside a Ray file, the tests that start no Ray leave the
# Ray scope for their file's own: those marked `no_ray` (in-process runs, refusals before a Ray
# starts) and the `in_process` case of ray_runs.WITH_AND_WITHOUT_RAY; the Ray scope was the suite's
# long pole (CI 2026-12-05: ~20 of its 20 min, the other worker idle for the last ~10). A test outside
# the Ray scope that calls ray.init in its process fails at once (_ray_init_guard).
RAY_GROUP = "ray"
_USES_RAY = re.compile(
    r"ray_connection|\blocal_ray\b|\bimport ray\b|\bfrom ray\b|\bray\.|run_with|run_launch|LiveRun|launch\.py"
    r"|WITH_AND_WITHOUT_RAY|orchestrate\.run\b|orchestrate import run\b|\blaunch import\b|start_ray"
)
# Files that match _USES_RAY but never start a Ray: every run they make is in-process
# (ray.enabled=false, launch.py's too), a dry run, or refused before it starts (exit 2 / 3). Checked
# by running each alone and watching /tmp/ray for new sessions (none). A file that gains a Ray run
# comes off this list.
RAY_FREE_FILES = {
    "tests/integration/test_algo_presets.py",
    "tests/integration/test_cli_errors.py",
    "tests/integration/test_debug_modes.py",
    "tests/integration/test_dry_runs.py",
    "tests/integration/test_inprocess_runs.py",
    "tests/integration/test_lora_llama4_experts_run.py",
    "tests/integration/test_lora_runs.py",
    "tests/integration/test_mlflow_outage.py",
    "tests/integration/test_multi_lora_run.py",
    "tests/integration/test_multi_lora_speculative_run.py",
    "tests/integration/test_model_zoo_runs.py",
    "tests/integration/test_qlora_llama4_run.py",
    "tests/integration/test_resume.py",
    "tests/integration/test_sglang_run.py",
    "tests/integration/test_sweep_and_reproduce.py",
    "tests/integration/test_vlm_engines_runs.py",
    "tests/unit/config/test_backend_choice.py",
    "tests/unit/config/test_backend_rules.py",
    "tests/unit/config/test_configs.py",
    "tests/unit/config/test_experiments.py",
    "tests/unit/config/test_hybrid_rules.py",
    "tests/unit/config/test_lora_merge_config.py",
    "tests/unit/config/test_qlora_config.py",
    "tests/unit/hardware/test_fsdp_lora_plan.py",
    "tests/unit/hardware/test_planner.py",
    "tests/unit/orchestrate/test_backend_registry.py",
    "tests/unit/orchestrate/test_fault_classify.py",
    "tests/unit/orchestrate/test_gpu_share.py",
    "tests/unit/tracking/test_reproduce.py",
}
_file_uses_ray: dict[Path, bool] = {}


def uses_ray(path: Path) -> bool:
    if path not in _file_uses_ray:
        try:
            ray_free = path.resolve().relative_to(ROOT).as_posix() in RAY_FREE_FILES
        except ValueError:
            ray_free = False
        try:
            _file_uses_ray[path] = not ray_free and bool(_USES_RAY.search(path.read_text()))
        except OSError:
            _file_uses_ray[path] = True
    return _file_uses_ray[path]


_ray_free_tests: dict[Path, tuple[frozenset[str], str | None]] = {}


def ray_free_tests(path: Path) -> tuple[frozenset[str], str | None]:
    """The test functions of a file decorated with @pytest.mark.no_ray, and the file's RAY_CASE_ID (a
    module-level string literal, else None): where a file sets one, only its parametrized cases with
    that word among their id's dash-separated parts start a Ray (test_transport_contract.py: the
    `ray-...` cases; the rest run in-process). Read from its source: xdist's scheduler sees node ids only."""
    if path not in _ray_free_tests:
        import ast

        names, case_id = set(), None
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("pytest.mark.no_ray") for d in node.decorator_list):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["RAY_CASE_ID"] \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                case_id = node.value.value
        _ray_free_tests[path] = frozenset(names), case_id
    return _ray_free_tests[path]


def in_ray_scope(path: Path, nodeid: str) -> bool:
    """Whether the test `nodeid` of `path` may start a Ray (see above)."""
    if not uses_ray(path):
        return False
    test = nodeid.split("::")[-1]
    name, _, params = test.partition("[")
    words = params.rstrip("]").split("-") if params else []
    names, case_id = ray_free_tests(path)
    if name in names or "in_process" in words:
        return False
    return not (case_id is not None and words and case_id not in words)


def _loadgroup(config) -> bool:
    """--dist loadgroup (in an xdist worker, whose `dist` option reads "no", xdist sets `loadgroup`)."""
    return bool(getattr(config.option, "loadgroup", False)) or config.getoption("dist", "no") == "loadgroup"


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, grouped here: xdist's own loadgroup reads xdist_group marks into the node ids
    (item._nodeid), which pytest 9 no longer reads, so it fell back to sending single tests (Ray tests
    ran in both workers at once). The scope of a test is "ray" for a test that may start a Ray, else
    its file; the largest scope (the Ray tests) goes out first."""
    if not _loadgroup(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return RAY_GROUP if in_ray_scope(config.rootpath / file, nodeid) else file

    return RayGroupScheduling(config, log)


_current_item = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _current_item
    _current_item = item


@pytest.fixture(scope="session", autouse=True)
def _ray_init_guard(request):
    """In an xdist worker: ray.init from a test outside the Ray group fails (it would run beside the
    other worker's Ray)."""
    if not hasattr(request.config, "workerinput") or not _loadgroup(request.config):
        yield
        return
    try:
        import ray
    except ImportError:
        yield
        return
    real_init = ray.init

    def guarded_init(*args, **kwargs):
        item = _current_item
        if item is not None and not in_ray_scope(Path(str(item.path)), item.nodeid):
            raise RuntimeError(f"{item.nodeid} starts Ray but is not in the xdist scope {RAY_GROUP!r}: "
                               "tests/conftest.py's _USES_RAY must match its file, and it must not be "
                               "marked no_ray nor be an in_process case")
        return real_init(*args, **kwargs)

    ray.init = guarded_init
    yield
    ray.init = real_init
