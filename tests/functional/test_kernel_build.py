"""Building the CPU kernel: never an endless silent wait on a build lock (a lock left by a killed build is reclaimed,
a live holder is waited for with a bounded time, and with a message when it builds or is slow), one build folder per
environment (tools found on PATH included) kept side by side, and a one-line message whenever a build runs.
The ninja and compiler these tests put on PATH are shell scripts: no test here compiles the kernel but the one that
needs the built library."""
from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mgk.functional import _mixture_flash

fcntl = pytest.importorskip("fcntl", reason="the build lock is an fcntl.flock (POSIX)")

SRC = str(Path(_mixture_flash.__file__).parents[2])


def _fresh(monkeypatch):
    monkeypatch.setattr(_mixture_flash, "_module", None)
    monkeypatch.setattr(_mixture_flash, "_failed", None)
    monkeypatch.delenv("MGK_CPU_KERNEL", raising=False)


def _hold(path: Path, text: str = "pid 4242") -> int:
    """Take the build lock through a separate open file description (flock locks conflict between those)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, text.encode())
    return fd


def _fake_tool(folder: Path, name: str, version: str, dry_run: str = "ninja: no work to do.", rc: int = 0) -> Path:
    """An executable ``folder/name`` answering ``--version`` with ``version`` and ``-n`` (ninja's dry run) with
    ``dry_run`` and exit status ``rc``."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text(f"#!/bin/sh\ncase \"$1\" in\n  --version) echo {shlex.quote(version)} ;;\n"
                    f"  -n) printf '%s\\n' {shlex.quote(dry_run)}; exit {rc} ;;\nesac\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


def _path_first(monkeypatch, *folders: Path) -> None:
    monkeypatch.setenv("PATH", os.pathsep.join([*map(str, folders), os.environ["PATH"]]))


def test_build_name_covers_source_torch_python_compiler_ninja_and_flags():
    base = dict(source=b"kernel", torch_version="2.5.0", python="cpython 3.11.7", compiler="c++",
                cflags=["-O3"], ldflags=["-fopenmp"], source_path="/a/mixture_flash.cpp", ninja="ninja 1.11.1",
                torch_path="/venv-a/torch")
    name = _mixture_flash._build_name(**base)
    assert name == _mixture_flash._build_name(**base)
    for key, other in [("source", b"kernel2"), ("torch_version", "2.6.0"), ("python", "cpython 3.12.1"),
                       ("compiler", "clang++"), ("cflags", ["-O2"]), ("ldflags", []),
                       ("source_path", "/b/mixture_flash.cpp"), ("ninja", "ninja 1.13.2"),
                       ("torch_path", "/venv-b/torch")]:
        assert _mixture_flash._build_name(**{**base, key: other}) != name, key


def test_the_ninja_and_compiler_found_on_path_name_the_build_folder(monkeypatch, tmp_path):
    """A venv's ninja and /usr/bin's record their commands differently, so each rebuilds what the other built:
    whichever PATH puts first (or a new version of it) gets its own folder, and the same PATH the same folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("CXX", raising=False)
    _fake_tool(tmp_path / "venv", "ninja", "1.13.2")
    _fake_tool(tmp_path / "usr", "ninja", "1.11.1")
    _fake_tool(tmp_path / "cc", "c++", "c++ (Fake) 99.1")
    names = {}
    for label, folders in [("venv", ["venv"]), ("usr", ["usr"]), ("venv again", ["venv"]),
                           ("other compiler", ["cc", "venv"])]:
        _path_first(monkeypatch, *(tmp_path / f for f in folders))
        names[label] = _mixture_flash.build_folder()[0]
    _fake_tool(tmp_path / "venv", "ninja", "1.13.3")  # upgraded in place
    _path_first(monkeypatch, tmp_path / "venv")
    names["venv upgraded"] = _mixture_flash.build_folder()[0]
    assert names["venv"] == names["venv again"]
    assert len({names[k] for k in ("venv", "usr", "other compiler", "venv upgraded")}) == 4, names


def test_a_lock_590_s_old_beside_a_built_library_loads_at_once():
    """A `lock` file left 590 s ago by a killed build (younger than the old 600 s staleness rule), next to an
    already compiled library: a new process loads the kernel without waiting and removes the lock."""
    if _mixture_flash._load() is None:
        pytest.skip(f"the kernel could not be built here: {_mixture_flash.build_error()}")
    _, folder = _mixture_flash.build_folder()
    lock = folder / "lock"
    lock.write_text("")
    old = time.time() - 590
    os.utime(lock, (old, old))
    code = "from mgk.functional import _mixture_flash as m; import sys; sys.exit(m._load() is None)"
    env = {**os.environ, "PYTHONPATH": SRC, "MGK_KERNEL_BUILD_TIMEOUT": "60"}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    finally:
        lock.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert "stale build lock" in done.stderr and str(lock) in done.stderr
    assert "building" not in done.stderr  # the library was there: no rebuild
    assert time.monotonic() - start < 200


def test_a_building_holder_is_announced_at_once_and_the_wait_is_bounded(tmp_path, capfd):
    path = tmp_path / _mixture_flash._LOCK_FILE
    fd = _hold(path, f"pid 4242, {_mixture_flash._BUILDING}")
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=str(path)):
            with _mixture_flash._build_lock(tmp_path, timeout=0.6, poll_s=0.05):
                pass
        assert 0.5 < time.monotonic() - start < 10
    finally:
        os.close(fd)
    err = capfd.readouterr().err
    assert err.count("waiting for the MGK kernel build lock") == 1 and "pid 4242" in err and str(path) in err
    with _mixture_flash._build_lock(tmp_path, timeout=0.0):  # released: taken at once
        assert path.read_text().strip() == f"pid {os.getpid()}"


def test_a_queue_of_holders_that_only_load_is_waited_for_silently(tmp_path, capfd):
    """Under torchrun every rank takes the lock in turn to load the built library: waiting behind them is no news
    (each holder here keeps it 0.1 s, the queue 0.5 s, well inside the default quiet time)."""
    path = tmp_path / _mixture_flash._LOCK_FILE
    fd = _hold(path, "pid 1")

    def loaders_in_turn():
        for pid in range(2, 6):
            time.sleep(0.1)
            os.pwrite(fd, f"pid {pid}\n".encode(), 0)
        time.sleep(0.1)
        os.close(fd)

    queue = threading.Thread(target=loaders_in_turn)
    queue.start()
    try:
        start = time.monotonic()
        with _mixture_flash._build_lock(tmp_path, timeout=30, poll_s=0.02):
            assert time.monotonic() - start > 0.3
    finally:
        queue.join()
    assert "waiting" not in capfd.readouterr().err


def test_a_holder_slower_than_the_quiet_time_is_announced_once(tmp_path, capfd):
    path = tmp_path / _mixture_flash._LOCK_FILE
    fd = _hold(path, "pid 4242")
    try:
        with pytest.raises(TimeoutError, match="pid 4242"):
            with _mixture_flash._build_lock(tmp_path, timeout=0.5, poll_s=0.02, quiet_s=0.2):
                pass
    finally:
        os.close(fd)
    assert capfd.readouterr().err.count("waiting for the MGK kernel build lock") == 1


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    path = tmp_path / _mixture_flash._LOCK_FILE
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, os, time; fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError):
            with _mixture_flash._build_lock(tmp_path, timeout=0.2, poll_s=0.05):
                pass
    finally:
        holder.kill()
        holder.wait()
    with _mixture_flash._build_lock(tmp_path, timeout=0.0):
        pass


def test_load_gives_up_with_a_warning_naming_the_lock(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp

    _fresh(monkeypatch)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("MGK_KERNEL_BUILD_TIMEOUT", "0.3")
    monkeypatch.setattr(cpp, "load", lambda *a, **kw: pytest.fail("must not build while the lock is held"))
    _, folder = _mixture_flash.build_folder()
    fd = _hold(folder / _mixture_flash._LOCK_FILE)
    try:
        with pytest.warns(RuntimeWarning, match="build lock"):
            assert _mixture_flash._load() is None
    finally:
        os.close(fd)
    assert _mixture_flash._LOCK_FILE in _mixture_flash.build_error()


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_bad_timeout_setting_is_named(monkeypatch, value):
    monkeypatch.setenv("MGK_KERNEL_BUILD_TIMEOUT", value)
    with pytest.raises(ValueError, match="MGK_KERNEL_BUILD_TIMEOUT"):
        _mixture_flash.build_timeout()


def test_one_line_message_when_a_build_starts_and_builds_side_by_side(monkeypatch, tmp_path, capfd):
    import torch.utils.cpp_extension as cpp

    built = []
    _path_first(monkeypatch, _fake_tool(tmp_path / "bin", "ninja", "1.13.2").parent)  # says: no work to do

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        assert not (Path(build_directory) / "lock").exists()
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        built.append(name)
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp, "load", fake_load)
    messages = []
    for version in ("1.0-env-a", "2.0-env-b", "1.0-env-a"):
        _fresh(monkeypatch)
        monkeypatch.setattr(torch, "__version__", version)
        assert _mixture_flash._load() is not None
        messages.append(capfd.readouterr().err)
    assert [m.count("building the MGK CPU kernel") for m in messages] == [1, 1, 0]
    assert len(set(built)) == 2 and len(list(tmp_path.glob("mgk_mixture_flash_*"))) == 2  # kept side by side


@pytest.mark.parametrize("dry_run, rc", [("[1/3] c++ -c mixture_flash.cpp\n[2/3] c++ -c mixture_decode.cpp\n"
                                          "[3/3] c++ -shared -o kernel.so", 0),
                                         ("ninja: error: loading 'build.ninja': No such file or directory", 1)])
def test_a_rebuild_of_an_existing_library_is_announced_and_the_lock_says_so(monkeypatch, tmp_path, capfd, dry_run,
                                                                            rc):
    """The library is there but ninja will rebuild it (another ninja's log, a changed header, no build.ninja): a
    35-75 s build is announced every time it runs, not only the first, and waiters see the holder is building."""
    import torch.utils.cpp_extension as cpp

    holder_states = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        holder_states.append((Path(build_directory) / _mixture_flash._LOCK_FILE).read_text())
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpp, "load", fake_load)
    bin_dir = tmp_path / "bin"
    _path_first(monkeypatch, bin_dir)
    messages = []
    for answer, status in [("ninja: no work to do.", 0), ("ninja: no work to do.", 0), (dry_run, rc)]:
        _fake_tool(bin_dir, "ninja", "1.13.2", answer, status)
        _fresh(monkeypatch)
        assert _mixture_flash._load() is not None
        messages.append(capfd.readouterr().err)
    assert [m.count("mgk: building the MGK CPU kernel") for m in messages] == [1, 0, 1], messages
    assert all(m.count("\n") == bool(m) for m in messages)  # one line each
    assert "no library built yet" in messages[0] and ("3 build steps" if rc == 0 else "build.ninja") in messages[2]
    assert [_mixture_flash._BUILDING in state for state in holder_states] == [True, False, True]


def test_disabled_by_environment_warns_once_per_process():
    code = ("import warnings, torch; warnings.simplefilter('always');"
            "from mgk.functional import _mixture_flash as m;"
            "[m.available(torch.zeros(2), 0.0) for _ in range(3)]")
    env = {**os.environ, "PYTHONPATH": SRC, "MGK_CPU_KERNEL": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("MGK_CPU_KERNEL=0") == 1, done.stderr
