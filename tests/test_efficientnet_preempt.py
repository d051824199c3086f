"""Week-long runs of the application: checkpoints every N steps in a directory that keeps the
last K, each written atomically; ``--resume auto`` from the newest intact one; SageMaker's
checkpoint directory; and a SIGTERM at any step, after which the same command ends bitwise
where an uninterrupted run ends (2 ranks, the small CNN on the digits, under shoalrun and
under torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
from apps.efficientnet.config.flags import parse_args  # noqa: E402
from apps.efficientnet.runtime.checkpoint import (  # noqa: E402
    checkpoint_dir,
    checkpoint_name,
    load_checkpoint,
)
from harness import free_port_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _state(step: int) -> dict:
    return {"step": step, "weights": torch.full((1000,), float(step))}


def test_the_last_k_are_kept_and_a_truncated_newest_falls_back(tmp_path: Path) -> None:
    store = checkpoint_dir(tmp_path, keep=3)
    for step in (5, 10, 15, 20):
        store.save(_state(step), step)
    assert [p.name for p in store.files()] == [checkpoint_name(s) for s in (20, 15, 10)]
    newest = store.files()[0]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # cut short
    said: list[str] = []
    path, state = store.newest(said.append)
    assert path.name == checkpoint_name(15) and state["step"] == 15
    assert len(said) == 1 and "unreadable" in said[0] and newest.name in said[0]
    assert load_checkpoint(tmp_path)["step"] == 15  # a directory: its newest intact one
    assert checkpoint_dir(tmp_path / "none").newest() is None


def test_a_crash_while_writing_leaves_the_previous_ones(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = checkpoint_dir(tmp_path, keep=2)
    store.save(_state(1), 1)
    store.save(_state(2), 2)

    def crash(obj: object, f: object) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        store.save(_state(3), 3)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(1),
                                                          checkpoint_name(2)]  # no temp file
    assert store.newest()[1]["step"] == 2  # type: ignore[index]


def test_resume_flags_and_sagemakers_checkpoint_directory(tmp_path: Path) -> None:
    args = parse_args([], environ={})
    assert (args.resume, args.checkpoint_dir) == ("auto", args.model_dir)
    assert parse_args(["--resume_checkpoint"], environ={}).resume == "auto"
    assert parse_args(["--resume_checkpoint", "x.pt"], environ={}).resume == "x.pt"
    assert parse_args(["--resume_checkpoint", "false"], environ={}).resume == "none"
    assert parse_args(["--resume", "none"], environ={}).resume == "none"
    sm = {"SM_MODEL_DIR": str(tmp_path / "model"), "SAGEMAKER_BASE_DIR": str(tmp_path)}
    assert parse_args([], environ=sm).checkpoint_dir == str(tmp_path / "model")  # none there
    (tmp_path / "checkpoints").mkdir()
    assert parse_args([], environ=sm).checkpoint_dir == str(tmp_path / "checkpoints")
    assert parse_args(["--checkpoint_dir", "/x"], environ=sm).checkpoint_dir == "/x"


# ------------------------------------------------------------------ SIGTERM, end to end


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apps.efficientnet.dataloader.digits import digits_jpegs, write_imagenet_layout
    data = tmp_path_factory.mktemp("digits")
    jpegs, labels = digits_jpegs(32)
    write_imagenet_layout(data, jpegs[:320], labels[:320], "train", 2)
    return data


def _app(digits: Path, model_dir: Path, framework: str) -> list[str]:
    return ["-m", "apps.efficientnet.main", "--framework", framework, "--mode", "train",
            "--arch", "small-cnn",
            "--data_dir", str(digits), "--num_classes", "10", "--image_size", "32",
            "--max_epochs", "2", "--train_batch_size", "16", "--num_workers", "1",
            "--log_steps", "1", "--save_checkpoint_freq", "0", "--augmenter_name", "none",
            "--intraop_threads", "1", "--model_dir", str(model_dir)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "SM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return {**env, "SHOAL_SECRET": "7a" * 16, "OMP_NUM_THREADS": "1"}


def _launch(how: str, digits: Path, model_dir: Path, framework: str = "torch") -> list[str]:
    app = [sys.executable, *_app(digits, model_dir, framework)]
    if how == "shoalrun":
        return [sys.executable, "-m", "shoal.runner", "-np", "2", *app]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port_pair()), *app[1:]]


def _steps_logged(model_dir: Path) -> int:
    try:
        lines = (model_dir / "log.json").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line).get("step"))
        except json.JSONDecodeError:  # a line being written
            continue
    return max((s[1] for s in steps if isinstance(s, list)), default=0)


def _store(model_dir: Path, framework: str) -> object:
    if framework == "torch":
        return checkpoint_dir(model_dir)
    from apps.efficientnet.keras.checkpoint import keras_checkpoints
    return keras_checkpoints(model_dir)


def _final(model_dir: Path, framework: str) -> dict:
    state = _store(model_dir, framework).newest()[1]  # type: ignore[attr-defined]
    return state["model"] if framework == "torch" else state


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)  # type: ignore[arg-type]
    import numpy as np
    return bool(np.array_equal(a, b))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "framework"), [("shoalrun", "torch"), ("torchrun", "torch"),
                                                ("shoalrun", "tensorflow")])
def test_sigterm_then_the_same_command_ends_bitwise_equal(how: str, framework: str,
                                                          digits: Path, tmp_path: Path) -> None:
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    done = subprocess.run(_launch(how, digits, straight, framework), env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(_launch(how, digits, stopped, framework), env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(stopped) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # mid-epoch (10 steps an epoch)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if how == "shoalrun":
        assert proc.returncode == 143, err[-3000:]
        assert "every one exited 0" in err
    else:
        assert proc.returncode != 0  # torchrun re-raises the signal it was stopped by
    assert "SIGTERM: every rank stopped after step" in out + err, (out + err)[-3000:]
    cut = _store(stopped, framework).files()  # type: ignore[attr-defined]
    assert len(cut) == 1 and 5 <= int(cut[0].stem.split("-")[1]) < 20
    again = subprocess.run(_launch(how, digits, stopped, framework), env=_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {cut[0]}" in again.stdout
    if framework == "torch":
        assert "the stream continues after batch" in again.stdout  # exact, mid-epoch
    a, b = _final(straight, framework), _final(stopped, framework)
    differ = [k for k in a if not _equal(a[k], b[k])]
    assert a.keys() == b.keys() and not differ, f"stopped at {cut[0].name}: {differ[:5]}"
    if how == "shoalrun":  # a finished run says so and trains no more
        third = subprocess.run(_launch(how, digits, stopped, framework), env=_env(), cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        assert third.returncode == 0 and "the run finished already" in third.stdout
        assert "step 1 " not in third.stdout


def _steps_run(rank: int, model_dir: str, framework: str) -> list[str]:
    if framework == "tensorflow":
        from harness import single_threaded_tf
        single_threaded_tf()
        from apps.efficientnet.keras.train import run
    else:
        torch.set_num_threads(1)
        from apps.efficientnet.runtime.runner import run
    run(parse_args(["--framework", framework, "--arch", "small-cnn", "--image_size", "32",
                        "--num_classes", "10", "--synthetic", "--mode", "train",
                        "--max_epochs", "2", "--steps_per_epoch", "4", "--train_batch_size",
                        "2", "--num_workers", "0", "--log_steps", "0",
                        "--save_checkpoint_freq", "0", "--save_checkpoint_steps", "3",
                        "--keep_checkpoints", "2", "--model_dir", model_dir], environ={}))
    return sorted(p.name for p in Path(model_dir).glob("ckpt-*"))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_step_checkpoints_keep_the_newest(framework: str, tmp_path: Path) -> None:
    """Every 3 steps and at the end (steps 3, 6 and 8 of 2 x 4), the newest 2 kept."""
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    from harness import run_ranks
    suffix = ".pt" if framework == "torch" else ".npz"
    got = run_ranks(_steps_run, 2, str(tmp_path), framework, timeout=120)
    assert got[0] == [checkpoint_name(6, suffix), checkpoint_name(8, suffix)]
