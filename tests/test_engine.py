"""Process set-up helpers that need no process group."""

from __future__ import annotations

import pytest

from train.runtime.engine import plain_arch_list


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),                       # what torch and some images preset on Hopper; DeepSpeed cannot parse it
    ("9.0a;8.0+PTX 10.0a", "9.0;8.0+PTX;10.0"),
    ("8.6", "8.6"),
    ("9.0;9.0a", "9.0"),
])
def test_plain_arch_list(value, expected):
    """Arch-specific suffixes are dropped, +PTX kept, duplicates merged."""
    assert plain_arch_list(value) == expected


def _fake_zero(grads: list) -> object:
    """The attributes of DeepSpeedZeroOptimizer that the two gradient checks read (one group, world of one)."""
    import types

    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return types.SimpleNamespace(bit16_groups=[grads], averaged_gradients={0: grads}, device=torch.device("cpu"),
                                 model_parallel_rank=0, dp_process_group=None,
                                 _model_parallel_all_reduce=lambda tensor, op: None,
                                 _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan)


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_multi_tensor_grad_checks_equal_deepspeeds(monkeypatch, poison):
    """train.runtime.ds_patches gives DeepSpeed's overflow flag and global norm (all-reduce of a world of one:
    identity)."""
    import deepspeed.comm
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from train.runtime import ds_patches

    monkeypatch.setattr(deepspeed.comm, "all_reduce", lambda tensor, op=None, group=None: None)
    assert ds_patches.apply()
    original = ds_patches._ORIGINAL
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((4096, 1e-3), (64, 10.0), (0, 1.0), (1000, 1.0))]
    if poison is not None:
        grads[1][7] = poison
    params = [torch.nn.Parameter(torch.empty_like(x)) for x in grads]
    fake = _fake_zero(grads)
    ours = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(fake)
    theirs = original["has_overflow_partitioned_grads_serial"](fake)
    assert bool(ours) == bool(theirs) == (poison is not None)
    norm = DeepSpeedZeroOptimizer.get_grad_norm_direct(fake, grads, params)
    reference = original["get_grad_norm_direct"](fake, grads, params)
    if poison is None:
        assert norm.item() == pytest.approx(reference.item(), rel=1e-6)
        assert reference.item() == pytest.approx(torch.cat(grads).double().norm().item(), rel=1e-6)
    else:
        assert norm.item() == reference.item() == -1.0  # DeepSpeed's mark of an invalid norm


def test_taken_master_port_is_one_line_naming_the_fix(tiny_edit, tmp_path, monkeypatch, capsys):
    """A rendezvous port that another process holds ends train/main.py with exit 2 and one line naming
    --master_port, not a c10d traceback."""
    import socket

    from conftest import TINY_CONFIG

    from train import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # as the launcher sets them (monkeypatch restores them: init_distributed fills them in otherwise)
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port)).items():
            monkeypatch.setenv(name, value)
        code = main.main(["--ds_config", str(TINY_CONFIG), "--model", str(tiny_edit / "model"),
                          "--data", str(tiny_edit / "data"), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"error: port {port} (the launcher's --master_port, default 29500) is already in use")
    assert "deepspeed --master_port" in err[-1] and "Traceback" not in "\n".join(err)
