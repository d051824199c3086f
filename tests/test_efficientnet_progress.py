"""What a person watching the application sees: a progress bar per epoch on a terminal
(the application's own, or shoalrun's when the job runs under it), none in a log, and a
compact summary table at the end."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[1]
APP = ["-m", "apps.efficientnet.main", "--arch", "small-cnn", "--image_size", "32",
       "--num_classes", "10", "--synthetic", "--mode", "train", "--max_epochs", "2",
       "--steps_per_epoch", "4", "--train_batch_size", "4", "--num_workers", "0",
       "--log_steps", "0"]


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "SHOALRUN_", "SM_")) and k != "COLUMNS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
               TERM="xterm")
    return env


def _in_pty(argv: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal (100 columns) as stdin, stdout and stderr."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                            close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_bar_on_a_terminal_not_in_a_log(tmp_path: Path) -> None:
    argv = [sys.executable, *APP, "--model_dir", str(tmp_path / "a")]
    rc, screen = _in_pty(argv, _env(tmp_path))
    assert rc == 0, screen[-3000:]
    assert "epoch 1/2: " in screen and "%|" in screen and "| 0/4 [" in screen  # the bar
    assert "\r" in screen
    assert "epoch 2/2  loss " in screen  # the plain line too
    log = subprocess.run([*argv[:-1], str(tmp_path / "b")], capture_output=True, text=True,
                         env=_env(tmp_path), cwd=ROOT, timeout=120)
    assert log.returncode == 0, log.stderr[-3000:]
    assert "%|" not in log.stdout + log.stderr and "\r" not in log.stdout + log.stderr
    lines = log.stdout.splitlines()
    assert any(line.startswith("epoch 2/2  loss ") for line in lines)
    assert [line.split()[0] for line in lines[-4:]] == ["summary", "training", "latency",
                                                        "training"]
    assert lines[-4].split() == ["summary", "loss", "top-1", "top-5", "img/s"]
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)


def test_bar_through_shoalrun_on_a_terminal(tmp_path: Path) -> None:
    """Under shoalrun on a terminal, rank 0's bar is shoalrun's status line: drawn with
    carriage returns and erased (ESC [K) around the tagged lines, which stay whole."""
    argv = [sys.executable, "-m", "shoal.runner", "-np", "2", sys.executable, *APP,
            "--model_dir", str(tmp_path / "a")]
    rc, screen = _in_pty(argv, _env(tmp_path))
    assert rc == 0, screen[-3000:]
    assert "[0]<stderr>: epoch 1/2: " in screen and "%|" in screen
    assert "\r\x1b[K" in screen
    assert "[1]<stderr>: epoch" not in screen  # only rank 0 draws one
    lines = [line.split("\x1b[K")[-1] for line in screen.replace("\r\n", "\n").split("\n")]
    assert any(line.startswith("[0]<stdout>: epoch 2/2  loss ") for line in lines)
    assert any(line.startswith("[0]<stdout>:   summary") for line in lines)
    out = subprocess.run([*argv[:-1], str(tmp_path / "b")], capture_output=True, text=True,
                         env=_env(tmp_path), cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "%|" not in out.stdout + out.stderr
