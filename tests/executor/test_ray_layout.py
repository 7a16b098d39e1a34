"""The ray backend without a cluster: the missing-package error, the ranks' order and layout."""
from __future__ import annotations

import sys

import pytest

from peregrine.config import EngineArgs
from peregrine.entrypoints.cli import main
from peregrine.executor.ray_executor import import_ray, local_layout, rank_order
from peregrine.testing.checkpoints import tiny_checkpoint

INSTALL = "pip install 'peregrine-llm[ray]'"


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError


def test_choosing_ray_without_ray_says_how_to_install_it(no_ray) -> None:
    args = EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu", tensor_parallel_size=2,
                      distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"distributed_executor_backend: the ray backend needs "
                                         r"Ray, which is not installed: pip install "):
        args.create_engine_config()
    with pytest.raises(ImportError, match=f"cannot be imported .*: {INSTALL.replace('[', '.')}"):
        import_ray()


def test_the_cli_prints_one_line_without_ray(no_ray, capsys) -> None:
    code = main(["generate", "--model", str(tiny_checkpoint("llama")), "--device", "cpu",
                 "-tp", "2", "--distributed-executor-backend", "ray", "hello"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.endswith(INSTALL) and "distributed_executor_backend" in err


def test_an_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'rpc' .*expected mp, ray, uni"):
        EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu",
                   distributed_executor_backend="rpc").create_engine_config()


def test_ranks_of_one_node_are_consecutive_with_the_drivers_node_first() -> None:
    assert rank_order(["a", "a", "b", "b"], driver_node="a") == [0, 1, 2, 3]
    assert rank_order(["b", "a", "b", "a"], driver_node="a") == [1, 3, 0, 2]
    assert rank_order(["c", "b", "c", "b"], driver_node="a") == [0, 2, 1, 3]


def _place(node: str, gpus: list[str]) -> dict:
    return {"node_id": node, "ip": f"10.0.0.{ord(node)}", "gpu_ids": gpus, "pid": 1}


def test_each_gpu_rank_sees_its_nodes_gpus_and_indexes_its_own() -> None:
    places = [_place("a", ["3"]), _place("a", ["1"]), _place("b", ["0"]), _place("b", ["10"]),
              _place("b", ["2"])]
    assert local_layout(places, on_cuda=True) == [
        (1, 2, "1,3"), (0, 2, "1,3"), (0, 3, "0,2,10"), (2, 3, "0,2,10"), (1, 3, "0,2,10")]


def test_cpu_ranks_count_their_node_peers() -> None:
    places = [_place("a", []), _place("b", []), _place("a", [])]
    assert local_layout(places, on_cuda=False) == [(0, 2, None), (0, 1, None), (1, 2, None)]


def test_an_actor_with_other_than_one_gpu_is_refused() -> None:
    with pytest.raises(RuntimeError, match="rank 1's Ray actor holds GPUs"):
        local_layout([_place("a", ["0"]), _place("a", ["1", "2"])], on_cuda=True)
