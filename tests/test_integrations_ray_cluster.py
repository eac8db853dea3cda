"""gradsync.integrations.ray on real Ray clusters (slow): against Ray's DDP, a worker failure, two test hosts.

One local Ray cluster per module (2 CPUs declared, so 2 workers of 1 CPU fit this machine's 2 cores; an
80 MiB object store, no dashboard, no usage reporting), its storage in a temporary folder. Every run is
:mod:`gradsync.integrations.ray_run`'s fixed loop: the same seeded MLP, data and SGD steps, so runs differ
only by what a test changes. The two-host test starts a Ray head inside test host 0 and a Ray worker node
inside test host 1 (network namespaces, 198.18.0.x addresses that exist only there), runs the driver inside
host 0 and stops Ray in both hosts before the hosts are closed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gradsync.hosts import netns

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="gradsync.integrations.ray needs gradsync[ray] (ray[train])")
pytest.importorskip("ray.train", reason="gradsync.integrations.ray needs gradsync[ray] (ray[train])")
from gradsync.integrations.ray_run import LoopConfig, make_model, run  # noqa: E402

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0",  # no usage reporting
           "RAY_AUTH_MODE": "disabled"}  # ray start's token auth: the test hosts are closed namespaces
OBJECT_STORE_BYTES = 80 * 2**20
HEAD_PORT = 6380  # inside test host 0's own network namespace


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """A local Ray cluster for the module; yields the storage folder for the runs."""
    patch = pytest.MonkeyPatch()
    for name, value in RAY_ENV.items():
        patch.setenv(name, value)
    temp_dir = tempfile.mkdtemp(prefix="gsr", dir="/tmp")  # short: Ray's socket paths live under it
    ray.init(address="local", num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             _temp_dir=temp_dir)
    try:
        yield tmp_path_factory.mktemp("ray-storage")
    finally:
        ray.shutdown()
        patch.undo()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def one_host(local_ray):
    """The reference: gradsync's prepare_model, 2 workers on the local cluster, no failure."""
    return run(LoopConfig(impl="gradsync"), storage_path=local_ray, name="one-host")


@pytest.mark.timeout(60)
def test_in_the_driver_of_a_running_cluster_prepare_model_says_it_needs_a_worker(local_ray):
    import gradsync.integrations.ray as gray
    from torch import nn

    with pytest.raises(RuntimeError, match="inside a Ray Train worker") as caught:
        gray.prepare_model(nn.Linear(2, 2))
    assert "\n" not in str(caught.value)


def _assert_trained(parameters: dict) -> None:
    """The run moved the parameters away from their initial values (so equal runs are not equal by doing nothing)."""
    initial = make_model(LoopConfig().hidden, LoopConfig().seed).state_dict()
    assert any(not torch.allclose(parameters[name], initial[name]) for name in initial)


@pytest.mark.timeout(150)
def test_gradsync_prepare_model_trains_as_rays_ddp_prepare_model(local_ray, one_host):
    """The same loop wrapped by ray.train.torch.prepare_model (torch DDP): final parameters allclose."""
    ddp = run(LoopConfig(impl="ddp"), storage_path=local_ray, name="ddp")
    _assert_trained(one_host["parameters"])
    assert one_host["world_size"] == ddp["world_size"] == one_host["local_world_size"] == 2
    assert one_host["samples_per_s"] > 0 and one_host["timed_steps"] == LoopConfig().steps - LoopConfig().warmup_steps
    for name, tensor in ddp["parameters"].items():
        torch.testing.assert_close(one_host["parameters"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(150)
def test_a_worker_that_dies_is_restarted_by_ray_from_the_gradsync_checkpoint(local_ray, one_host, tmp_path):
    """Rank 1 exits before step 6 on the first attempt; FailureConfig(max_failures=1) restarts both workers from
    the checkpoint of step 4, and the run ends with the fault-free run's parameters, bit for bit (same data,
    same bucket layout and summation order, same momentum and RNG: nothing depends on the attempt)."""
    config = LoopConfig(impl="gradsync", checkpoint_every=2, fail_at="1:6", marker_dir=str(tmp_path))
    result = run(config, storage_path=local_ray, name="failure", max_failures=1)
    assert (tmp_path / "failed-rank1-step6").is_file()  # the failure did happen
    assert result["resumed_from"] == 4
    for name, tensor in one_host["parameters"].items():
        assert torch.equal(result["parameters"][name], tensor), name


def _run_in_host(hosts, index: int, argv: list[str], log: Path, timeout_s: float) -> str:
    """Run ``argv`` inside test host ``index`` to its end; its output (raises with it on failure)."""
    with open(log, "w") as out:
        process = hosts.popen(index, argv, env={**os.environ, **RAY_ENV}, stdout=out, stderr=subprocess.STDOUT)
        code = process.wait(timeout_s)
    text = log.read_text()
    assert code == 0, f"{' '.join(argv[:3])} in host {index} exited {code}:\n{text[-4000:]}"
    return text


@pytest.mark.timeout(240)
@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=f"{netns.unavailable_reason()}")
def test_one_worker_per_test_host_trains_as_the_one_host_run(one_host, tmp_path):
    """A Ray head in host 0, a worker node in host 1 (1 CPU each, STRICT_SPREAD), the driver in host 0, the
    storage a folder both hosts see: final parameters allclose to the one-host run's."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    temp_root = Path(tempfile.mkdtemp(prefix="gsr", dir="/tmp"))  # per node: the file system is shared
    node = ["--num-cpus", "1", "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
    head = f"{netns.host_addr(0)}:{HEAD_PORT}"
    try:
        with netns.TestHosts(2) as hosts:
            try:
                _run_in_host(hosts, 0, [ray_cli, "start", "--head", "--node-ip-address", netns.host_addr(0),
                                        "--port", str(HEAD_PORT), "--include-dashboard=false",
                                        "--temp-dir", str(temp_root / "h0"), *node], tmp_path / "head.log", 90)
                _run_in_host(hosts, 1, [ray_cli, "start", "--address", head, "--node-ip-address", netns.host_addr(1),
                                        "--temp-dir", str(temp_root / "h1"), *node], tmp_path / "node.log", 90)
                output = _run_in_host(hosts, 0, [sys.executable, "-m", "gradsync.integrations.ray_run",
                                                 "--address", head, "--node-ip-address", netns.host_addr(0),
                                                 "--storage", str(tmp_path / "storage"),
                                                 "--out", str(tmp_path / "final.pt"),
                                                 "--placement-strategy", "STRICT_SPREAD"], tmp_path / "driver.log", 150)
            finally:
                for index in (0, 1):
                    hosts.popen(index, [ray_cli, "stop", "--force"], env={**os.environ, **RAY_ENV},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait(30)
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    metrics = json.loads(output.strip().splitlines()[-1])
    assert metrics["world_size"] == 2 and metrics["local_world_size"] == 1  # one worker on each host's node
    parameters = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, tensor in one_host["parameters"].items():
        torch.testing.assert_close(parameters[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
