"""Shared test helpers: a config composed with Hydra's compose API, the real CLI run in a
subprocess, the real MLflow store read back; and the layout of the tests by kind.

- tests/unit/: in process - no CLI, rank, launcher, server or lock holder started
  (`make test-fast`, aimed at under a minute);
- tests/e2e/: real processes - `python -m train`, torchrun, spawned ranks, lock holders,
  servers, the browser - and the tests that wait on real stores for long (marked `slow`);
- tests/cluster/: the local Slurm cluster (marked `slow` and `slurm`; one work unit, one
  session-scoped cluster: tests/cluster/conftest.py).

The markers follow from the directory (pytest_collection_modifyitems), so no test can lack
one. Helpers shared by several kinds live here or in a top-level module (servers.py,
images.py); a heavier kind may import a lighter kind's helpers (e2e from unit, cluster from
e2e or unit), never the other way round.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from tests import warm as warm_start
from train.distributed import process_end

REPO = Path(__file__).resolve().parent.parent
USER_PATH = str(REPO / "tests")
"""What a user puts on PYTHONPATH: the directory that holds their package (tests/userpkg)."""
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SUBMITIT_EXECUTOR", "CUDA_VISIBLE_DEVICES", "TRAIN_LAUNCHER")
IN_CI = os.environ.get("CI", "").lower() == "true"

# The suite runs two pytest workers on two cores, each starting jobs whose one rank takes both
# cores' worth of OpenMP threads (train/engine/job.py: the node's CPUs per local rank). Idle
# OpenMP threads spin before they sleep, burning the CPU the other worker's jobs are waiting
# for: eight one-rank jobs at once took 101 s of CPU and 60 s of wall time, 60 s and 38 s with
# passive waiting (measured 2026-11-28). Set before any test imports torch (libgomp reads it
# once); the ranks' own thread counts are left as a user's job sets them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def skip_or_fail(reason: str) -> None:
    """A missing real part (root, chromium) skips on a developer's machine, fails in CI."""
    if IN_CI:
        pytest.fail(f"CI=true, so this cannot be skipped: {reason}")
    pytest.skip(reason)


DEFAULT_STORE = REPO / "mlflow.db"
"""MLflow's own default store when run from the repository (sqlite:///mlflow.db): a user's
`mlflow ui` there would find it, not the runs in mlruns/mlflow.db. No test may make it."""
_default_store_before = pytest.StashKey[bool]()


@pytest.hookimpl(trylast=True)  # after every other plugin's: its exit handlers come before
def pytest_unconfigure(config: pytest.Config) -> None:
    """A pytest-xdist worker leaves without the interpreter's own finalization: its Python
    exit handlers run (logging, multiprocessing's children, temporary folders, ours), then it
    exits. Tearing down torch's, MLflow's and the tests' modules took 3-4 s after the last
    test, which the run waited for (67.6 s of `make test-fast`, 64.2 s at the workers' exit)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(_exit_after_the_exit_handlers)  # the last registered: run first


def _exit_after_the_exit_handlers() -> None:
    atexit.unregister(_exit_after_the_exit_handlers)
    # Every other handler once, in the interpreter's order; the worker's results went to the
    # controller already, its exit code is not read.
    process_end.end_process(0)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_default_store_before] = DEFAULT_STORE.exists()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if DEFAULT_STORE.exists() and not session.config.stash.get(_default_store_before, True):
        print(f"\n{DEFAULT_STORE} was created by a test: something used MLflow's default "
              "tracking URI instead of the store it was given.")
        session.exitstatus = 1
    # Belt and braces: a skip from anywhere (a plain pytest.skip) also fails CI - except a
    # `gpu` test's: no CI machine of this project has CUDA (tests/{unit,e2e}/test_gpu.py).
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len([r for r in reporter.stats.get("skipped", [])
                   if "gpu" not in getattr(r, "keywords", {})]) if reporter else 0
    if IN_CI and skipped and exitstatus == 0:
        print(f"\nCI=true: {skipped} test(s) skipped; real-part tests must run in CI.")
        session.exitstatus = 1


KINDS = {"unit": (), "e2e": ("slow",), "cluster": ("slow", "slurm")}
"""tests/<kind>/ and the markers every test there gets."""
SLURM_UNIT = "tests/cluster"


def kind_of(nodeid: str) -> str | None:
    """unit, e2e or cluster: the directory under tests/ (None: a test outside all three)."""
    parts = Path(nodeid.partition("::")[0]).parts
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in KINDS else None


def work_unit(nodeid: str) -> str:
    """What `make test` (pytest-xdist, `-n 2 --dist loadfile`) sends to one worker as a whole:
    a test file, so that a module's fixtures (a server, a browser, a trained model) are made
    once; and every test in tests/cluster/ as one unit, so that the session-scoped cluster
    fixture starts the local Slurm cluster once, on one worker, and no two cluster tests run
    side by side (each must leave the queue empty: tests/cluster/conftest.py)."""
    path = nodeid.partition("::")[0]
    return SLURM_UNIT if kind_of(nodeid) == "cluster" else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a plain pytest run lacks
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its kind's markers; a test outside tests/{unit,e2e,cluster}/, a `slow`
    one in tests/unit/ or a Slurm one outside tests/cluster/ stops the run at collection."""
    for item in items:
        kind = kind_of(item.nodeid)
        if kind is None:
            raise pytest.UsageError(
                f"{item.nodeid}: every test lives in tests/unit/ (in process), tests/e2e/ (real "
                "processes) or tests/cluster/ (the local Slurm cluster): tests/conftest.py.")
        for marker in KINDS[kind]:
            item.add_marker(marker)
        if kind == "unit" and item.get_closest_marker("slow") is not None:
            raise pytest.UsageError(
                f"{item.nodeid} is marked slow: move it to tests/e2e/, which `make test-fast` "
                "leaves out (tests/unit/ is the quick layer).")
        if kind != "cluster" and item.get_closest_marker("slurm") is not None:
            raise pytest.UsageError(
                f"{item.nodeid} uses the Slurm cluster: put it in tests/cluster/, so that "
                "`make test` runs it in the one worker that has the cluster "
                "(tests/conftest.py, work_unit).")


@functools.cache
def _schema_registered() -> None:
    """register_schema() once per test process, as `python -m train` does it once: building
    the structured configs again for every compose was a third of its time."""
    from train.config.schema import register_schema

    register_schema()


@contextlib.contextmanager
def hydra_conf() -> Iterator[None]:
    """Hydra initialised on conf/ with the schema registered, as `python -m train` has it."""
    from hydra import initialize_config_dir

    _schema_registered()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        yield


def composed(*overrides: str, return_hydra_config: bool = False) -> Any:
    """The config `python -m train <overrides>` composes (a DictConfig), through Hydra's
    compose API: in process, a copy of its own. Composed once per pytest process for each set
    of overrides (~150 ms a compose; copying it, ~35 ms): a unit run composed 229 times, 27
    of them a set composed before."""
    return copy.deepcopy(_composed_once(overrides, return_hydra_config))


@functools.cache
def _composed_once(overrides: tuple[str, ...], return_hydra_config: bool) -> Any:
    from hydra import compose

    with hydra_conf():
        return compose(config_name="train", overrides=list(overrides),
                       return_hydra_config=return_hydra_config)


def typed(*overrides: str) -> Any:
    """composed(), as the job sees it: a TrainConfig."""
    from train.config.schema import to_container, to_typed

    return to_typed(to_container(composed(*overrides)))


def run_train(*overrides: str, env: dict[str, str] | None = None, timeout: float = 300,
              cwd: Path = REPO, module: tuple[str, ...] = ("-m", "train"), warm: bool = True,
              ) -> subprocess.CompletedProcess[str]:
    """`python -m train <overrides>` as a user would type it; output captured as text. Forked
    from this worker's warm interpreter (tests/warm.py: the imports done once) unless `warm`
    is false or the job could differ from a fresh interpreter's."""
    # A clean launch environment: no torchrun/Slurm variables from the test process itself.
    full_env = {k: v for k, v in os.environ.items()
                if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    full_env.update(env or {})
    if warm and warm_start.eligible(module, cwd, full_env):
        return warm_start.run(list(overrides), full_env, cwd, timeout)
    return subprocess.run([sys.executable, *module, *overrides], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def profiled_ops(uri: str, run_id: str, dst: Path) -> dict[int, set[str]]:
    """The names in each rank's trace (trainer.profile), as a user gets them: the run's
    `profile/` artifacts downloaded and unzipped."""
    import gzip
    import json

    from mlflow import MlflowClient

    MlflowClient(tracking_uri=uri).download_artifacts(run_id, "profile", str(dst))
    found = {}
    for trace in sorted((dst / "profile").glob("rank-*.json.gz")):
        with gzip.open(trace, "rt") as f:
            events = json.load(f)["traceEvents"]
        found[int(trace.name.split("-")[1].split(".")[0])] = {e.get("name", "") for e in events}
    return found


T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, what: str, every: float = 0.2,
               job: subprocess.Popen[str] | None = None) -> T:
    """`check()` once it is truthy, polled every `every` seconds; fails after `timeout`, or at
    once when `job` (the process that should bring it about) has ended."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert job is None or job.poll() is None, f"{what}: the job ended first"
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(every)
    return value


def process_ended(p: psutil.Process) -> bool:
    """Gone, or a zombie (PID 1 reaps orphans lazily)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def command_line(p: psutil.Process) -> str:
    """A process's command line; "" once it has gone or is a zombie (a launcher's short-lived
    children, such as a `git` it ran, come and go while a test looks)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def rank_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """The local rank processes a launcher started and that still run: the children of its
    fork server (multiprocessing's forkserver, the launcher's child)."""
    return [p for server in launcher.children() if "forkserver" in command_line(server)
            for p in server.children() if not process_ended(p)]


def kill_job_after_checkpoints(out_dir: Path, env: dict[str, str], checkpoints: int,
                               *overrides: str, timeout: float = 180) -> None:
    """Start `python -m train <overrides>` in `out_dir` and SIGKILL it - launcher, ranks and
    their DataLoader workers, as a node failure would - once `checkpoints` checkpoints exist
    (single files or sharded directories)."""
    proc = subprocess.Popen([sys.executable, "-m", "train", f"hydra.run.dir={out_dir}",
                             *overrides], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    def whole() -> int:  # files (step-<N>.pt) and sharded directories (step-<N>.dcp)
        folder = out_dir / "checkpoints"
        return len([*folder.glob("step-*.pt"), *folder.glob("step-*.dcp")])

    while whole() < checkpoints:
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint came"
        time.sleep(0.1)
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in family:
        p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def assert_refused(out: subprocess.CompletedProcess[str], expected: str,
                   store: dict[str, str]) -> None:
    """Refused as a user must see it: exit 2, one `error:` line saying `expected`, no
    traceback, and no MLflow run created."""
    assert out.returncode == 2, out.stdout + out.stderr
    [line] = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert expected in line, out.stderr
    assert "Traceback" not in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


@pytest.fixture(autouse=True)
def no_leaked_tracking_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow.set_tracking_uri() also sets MLFLOW_TRACKING_URI in os.environ: without this, one
    in-process test would point every later subprocess at its (deleted) store."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so the original comes back
    monkeypatch.delenv("MLFLOW_TRACKING_URI")


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun or Slurm variables: a job run in this process starts as on a login node."""
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real gloo process group of one rank, in this process; destroyed afterwards."""
    import torch.distributed as dist

    from train.distributed.env import free_port

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def user_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees the user's package, as `PYTHONPATH=tests` gives the CLI."""
    monkeypatch.syspath_prepend(USER_PATH)


SMALL_TEXT = Path(__import__("textwrap").__file__)
"""A 20 KB standard-library module: 585 training windows of 32 tokens, 31 validation ones."""
TINY_GPT = ("data=tokens", "model=gpt", "task=language_model", "model.n_layer=2",
            "model.n_head=2", "model.n_embd=32", "data.num_workers=0", "data.seq_len=32",
            "optim=adamw", "optim.lr=3e-3", "task.sample_tokens=0",
            "trainer.log_every_n_steps=1", "trainer.epochs=1",
            # 30 a step: 15 a rank at world 2 (validation: 16 and 15 windows, 2 and 1
            # batches), 10 at world 3 (11, 10, 10: 2, 1, 1 batches), so FSDP's evaluation pads
            # with filler forwards.
            "data.batch_size=30")
"""A 2-layer GPT on `small_tokens` (with `data.root=`): steps of a few milliseconds that take
the same losses at any world size (tests/e2e/test_fsdp.py, test_ema.py)."""


@pytest.fixture(scope="session")
def small_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SMALL_TEXT as `python -m train.prepare_text` writes it (5 % held out): the tiny GPT's
    data set of tests/e2e/test_fsdp.py and test_ema.py, prepared once per pytest process."""
    out = tmp_path_factory.mktemp("small") / "tokens"
    done = subprocess.run([sys.executable, "-m", "train.prepare_text", str(SMALL_TEXT), str(out),
                           "--val-fraction", "0.05"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return out


VOCAB = 512
"""bpe_tokens' vocabulary."""


@pytest.fixture(scope="session")
def bpe_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pydoc's source (109 KB) as token files of a byte-level BPE trained on it
    (tests/e2e/test_hf.py, tests/cluster/test_hf_slurm.py, tests/unit/test_pretokenize.py)."""
    import pydoc

    out = tmp_path_factory.mktemp("bpe") / "tokens"
    done = subprocess.run([sys.executable, "-m", "train", "prepare-text", pydoc.__file__,
                           str(out), "--train-tokenizer", "bpe", "--vocab-size", str(VOCAB),
                           "--val-fraction", "0.05"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return out


SENTENCES = 240
"""Labelled sentences of the test's own (80 % training, 20 % validation): class 0 speaks of
animals, class 1 of numbers, in random words of each."""


@pytest.fixture(scope="session")
def sentences(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `datasets` directory (save_to_disk) of texts with a ClassLabel, train and validation."""
    import random

    import datasets

    rng = random.Random(0)
    words = (["cat", "dog", "horse", "bird", "fish", "mouse", "cow"],
             ["one", "two", "seven", "ten", "forty", "hundred", "nine"])
    filler = ["the", "a", "and", "of", "saw", "with", "near"]
    rows = {"text": [], "label": []}
    for i in range(SENTENCES):
        label = i % 2
        rows["text"].append(" ".join(rng.choice(words[label] + filler)
                                     for _ in range(rng.randint(4, 12))))
        rows["label"].append(label)
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["animals", "numbers"])})
    whole = datasets.Dataset.from_dict(rows, features=features)
    cut = SENTENCES * 4 // 5
    out = tmp_path_factory.mktemp("sentences") / "set"
    datasets.DatasetDict({"train": whole.select(range(cut)),
                          "validation": whole.select(range(cut, SENTENCES))}).save_to_disk(out)
    return out


HUB_NAME = "tester/sentences"
"""`sentences` as a Hub data set of that name in a `datasets` cache (hub_cache)."""


@pytest.fixture(scope="session")
def hub_cache(sentences: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `datasets` cache ($HF_DATASETS_CACHE) holding HUB_NAME as `load_dataset` leaves a Hub
    data set after downloading it (owner___name/<config>/<version>/<hash>/: dataset_info.json
    and <name>-<split>.arrow), made offline: the Parquet builder a Hub download runs, on
    Parquet files of `sentences`' splits, moved to the Hub name's place."""
    import shutil

    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    work = tmp_path_factory.mktemp("hub")
    for split in ("train", "validation"):
        datasets.load_from_disk(str(sentences / split)).to_parquet(work / f"{split}.parquet")
    files = DataFilesDict.from_patterns({s: [f"{s}.parquet"] for s in ("train", "validation")},
                                        base_path=str(work))
    builder = Parquet(cache_dir=str(work / "build"), dataset_name="sentences", hash="0123abcd",
                      data_files=files, config_name="default")
    builder.download_and_prepare()
    cache = work / "cache"
    owner, name = HUB_NAME.split("/")
    shutil.copytree(builder.cache_dir, cache / f"{owner}___{name}" / "default" / "0.0.0" /
                    "0123abcd")
    return cache


@pytest.fixture(scope="session")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite MLflow store, its tables made once per pytest process: MLflow migrates a
    new database through some 40 schema versions, 1-2.5 s here, which every test that trained
    into a fresh file paid. The service's own creation of a new store (one process, under a
    lock) is tested where it matters: tests/{unit,e2e}/test_new_store.py."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    db = tmp_path_factory.mktemp("store-template") / "mlflow.db"
    engine = SqlAlchemyStore(f"sqlite:///{db}", (db.parent / "artifacts").as_uri()).engine
    engine.dispose()
    return db


def new_store(db: Path, template: Path) -> str:
    """A private copy of `template` at `db` (as the service would make it: 0600), with the
    Default experiment's artifacts beside it, not the template's; its URI."""
    import shutil
    import sqlite3

    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, db)
    db.chmod(0o600)
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                           ((db.parent / "artifacts" / "0").as_uri(),))
    return f"sqlite:///{db}"


@pytest.fixture
def store(tmp_path: Path, store_template: Path) -> Iterator[dict[str, str]]:
    """An empty SQLite MLflow store of this test's own; yields the env that points training
    at it."""
    yield {"MLFLOW_TRACKING_URI": new_store(tmp_path / "mlflow.db", store_template)}


def runs_in(uri: str, experiment: str = "train") -> list:
    """All runs of `experiment` in the store at `uri` (empty if it does not exist)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], max_results=1000)


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    metrics = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in metrics)
