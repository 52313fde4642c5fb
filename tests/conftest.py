import importlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Tests never need the hub. Set before anything imports huggingface_hub or datasets, which read it at
# import: without it a name that is neither a file nor a local dataset is looked up online, about 23 s of retries
# on a machine without network, and a different error wherever the hub answers.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from lit_growattn.__main__ import main as command_line  # noqa: E402
from lit_growattn.attention import ATTENTIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# Set by `make test` (as is CI=true on CI services): there every optional dependency is installed, so a test that
# cannot import one fails instead of skipping, and a broken install cannot pass by running fewer tests.
REQUIRE_OPTIONAL = "LIT_GROWATTN_REQUIRE_OPTIONAL"


def optional_dependencies_required() -> bool:
    return os.environ.get(REQUIRE_OPTIONAL, "") not in ("", "0") or os.environ.get("CI", "").lower() == "true"


# Every test that reads ../shared carries this mark. Without the shared data beside the clone they skip, or fail
# where optional inputs are required (`make test`, CI, which run with ../shared beside the clone): a missing corpus
# must not pass as fewer tests. Checked before each marked test by pytest_runtest_setup below.
needs_shakespeare = pytest.mark.needs_shakespeare


def require_shakespeare(path: Path | None = None) -> None:
    """Nothing when the shared corpus exists; otherwise skip the calling test, or fail it where optional inputs are
    required."""
    path = SHAKESPEARE if path is None else path
    if path.is_file():
        return
    if optional_dependencies_required():
        pytest.fail(f"{path} is not beside this clone, and {REQUIRE_OPTIONAL} or CI=true requires every optional "
                    f"input: put the shared folder beside the clone (../shared/data/tinyshakespeare.txt)",
                    pytrace=False)
    pytest.skip(f"{path} is not beside this clone")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_shakespeare: reads ../shared/data/tinyshakespeare.txt (skipped "
                                       "without it, failed where optional inputs are required)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_shakespeare") is not None:
        require_shakespeare()


def needs_module(name: str, extra: str):
    """The optional module `name` (installed by the package's `extra`), imported: without it the calling test, or
    the whole test file when called at its top, is skipped, or fails where optional dependencies are required."""
    if not optional_dependencies_required():
        return pytest.importorskip(name, reason=f"{name} is not installed (the {extra} extra)")
    try:
        return importlib.import_module(name)
    except ImportError as error:
        why = str(error)
    pytest.fail(f"{name} cannot be imported ({why}), and {REQUIRE_OPTIONAL} or CI=true requires every optional "
                f"dependency: install the {extra} extra, pip install -e '.[dev,{extra}]'", pytrace=False)


def needs_transformers():
    """transformers, for the Hugging Face tests (lit_growattn.hf, tests/hf_helpers.py); see needs_module."""
    return needs_module("transformers", extra="hf")


@pytest.fixture(autouse=True, scope="session")
def command_line_of_its_own():
    """LightningCLI gets its arguments from each test; pytest's own (`-q -x …`) are not the command line's.
    Session-wide, so that module-scoped fixtures which run the CLI see it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [sys.argv[0]])
        yield


@pytest.fixture(autouse=True, scope="session")
def log_handlers_on_this_sessions_stderr():
    """Lightning's loggers get a StreamHandler on the sys.stderr of their import. Where pytest runs more than once in
    one process (mutmut: its statistics run, then its clean run), that is an earlier session's capture stream,
    closed by now: each record would print "--- Logging error ---" with a traceback. Point them at this one's."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
    yield


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The models here are tiny: a second OpenMP thread only adds spin-waits (5× slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def required_args(attention: str) -> dict[str, int]:
    """A small value (2) for each argument a variant cannot do without (e.g. low-rank DINT's rank): a test over
    every registered variant, `sorted(ATTENTIONS)`, needs no list of its own."""
    signature = inspect.signature(ATTENTIONS[attention])
    return {name: 2 for name, p in list(signature.parameters.items())[2:] if p.default is inspect.Parameter.empty}


def reference_values(value, x: torch.Tensor) -> torch.Tensor:
    """V (b, s, n_head, d_v) of a value map (`attention.value.ValueMap`), per query head, written out: X′ W_V,j//g."""
    xa = torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1) if value.bias else x
    group = value.n_head // value.n_kv_head
    return torch.stack([xa @ value.w_v[j // group] for j in range(value.n_head)], 2)


def reference_output(value, heads: list[torch.Tensor]) -> torch.Tensor:
    """Σ_j y_j W_O,j + b_O for each head's output y_j (b, s, d_v), written out."""
    out = sum(y @ value.w_o[j] for j, y in enumerate(heads))
    return out if value.o_bias is None else out + value.o_bias


def scalar_tags(log_dir: Path) -> set[str]:
    """Every scalar tag written under log_dir (all event files)."""
    tags: set[str] = set()
    for event_file in log_dir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


@pytest.fixture
def tiny_cli_args(tmp_path):
    """CLI overrides that keep a fit to a few seconds and write everything under tmp_path."""
    return [
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=4",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory):
    """Token files and trained tokenizers of the tests go to a temporary folder, not the user's cache."""
    import lit_growattn.data.text as text

    folder, text.DEFAULT_CACHE = text.DEFAULT_CACHE, str(tmp_path_factory.mktemp("token_cache"))
    yield
    text.DEFAULT_CACHE = folder


# What a launched run must not inherit from this test process: the rendezvous that an in-process DDP or
# ModelParallelStrategy test left in os.environ (Lightning sets it and leaves it), which would send every rank the
# run launches to that earlier run's port, possibly still held by this process's store.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
              "LOCAL_WORLD_SIZE")


def launch(argv: list, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300,
           settle: float = 30) -> subprocess.CompletedProcess:
    """Runs `argv` (its output captured) in a session of its own, as a user starts a multi-process run, with `env`
    (default: this process's) less RENDEZVOUS. The ranks it launches may outlive it by a moment (writing their
    results); any still alive `settle` seconds after it ended (waiting for a rank that failed) are killed, so that a
    failed run leaves nothing waiting behind it."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in RENDEZVOUS}
    argv = [str(a) for a in argv]
    with subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        finally:
            _end_session(process.pid, settle)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _end_session(session: int, settle: float) -> None:
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_command(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m lit_growattn ARGS` as a user runs it: the exit code and what it printed (stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "LIT_GROWATTN_DEBUG": "", "OMP_NUM_THREADS": "1"}
    return launch([sys.executable, "-m", "lit_growattn", *args], cwd=cwd or REPO, env=env)


class Done:
    """What `python -m lit_growattn ARGS` returned and printed, run in this process."""

    def __init__(self, args, capsys):
        capsys.readouterr()
        self.returncode = command_line([str(a) for a in args])
        out = capsys.readouterr()
        self.stdout, self.stderr = out.out, out.err


@pytest.fixture
def cli(capsys, monkeypatch):
    """`cli(*args)` runs `python -m lit_growattn ARGS` in this process (short error reports, as a user sees them)."""
    monkeypatch.delenv("LIT_GROWATTN_DEBUG", raising=False)
    return lambda *args: Done(args, capsys)
