"""The persistent kernels' phase wait (kernels/_gluon.py `wait_count`): it returns once the
counter reaches its target, and a counter that never gets there makes the launch fail with an
error instead of hanging the GPU (run in a child process, whose CUDA context the trap ends)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpu_cases import DEV

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from peregrine.kernels._gluon import wait_count


    @gluon.jit
    def waiter(cnt_ptr, out_ptr, target, LIMIT: gl.constexpr):
        wait_count(cnt_ptr, target, LIMIT)
        gl.store(out_ptr + gl.program_id(0), 1)


    cnt = torch.tensor([int(sys.argv[1])], dtype=torch.int32, device="cuda")
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    waiter[(4,)](cnt, out, 3, LIMIT=1 << 12, num_warps=1)
    torch.cuda.synchronize()
    print("done", out.tolist())
''')


def _run(tmp_path: Path, count: int) -> subprocess.CompletedProcess:
    path = tmp_path / "waiter.py"
    path.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(path), str(count)], capture_output=True,
                          text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_a_reached_count_releases_every_program(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability(DEV) < (9, 0):
        pytest.skip("the Gluon helpers target sm_90+")
    res = _run(tmp_path, 3)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "done [1, 1, 1, 1]" in res.stdout


def test_a_count_that_never_arrives_fails_the_launch(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability(DEV) < (9, 0):
        pytest.skip("the Gluon helpers target sm_90+")
    res = _run(tmp_path, 2)
    assert res.returncode != 0
    assert "done" not in res.stdout
    assert "CUDA" in res.stderr or "cuda" in res.stderr, res.stderr[-2000:]
