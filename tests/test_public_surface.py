"""The public surface: per-algorithm options and sub-calls, the registry, the error hierarchy,
top-level exports, one version, and which algorithm reduces each DataParallel bucket."""

import ast
import importlib.metadata
import pathlib

import pytest
import torch
from torch import nn

import gradsync
from gradsync.parallel.sync_round import SLOTS_PER_RANK
from _dist import run_threads
from gradsync.collectives import HierarchicalOptions, SegmentOptions, ShmState, auto, check, hierarchical, registry
from gradsync.collectives.communicator import Communicator
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError, GradsyncError, PeerFailure
from gradsync.transport.thread import ThreadWorld

SRC = pathlib.Path(gradsync.__file__).parent


# ---------------------------------------------------------------- options and sub-calls


def test_hierarchical_sub_call_inherits_options_so_inter_node_really_runs_tree(monkeypatch):
    """hierarchical run on a sub-call keeps the group's node layout, inter_node_algorithm="tree" and
    segment size (before the options objects a sub-call fell back to one node and the ring)."""
    world_size, numel = 4, 1001
    seen = []  # (rank, world_size, segment_bytes) of every inter-node tree call
    tree_all_reduce = hierarchical.INTER_NODE_ALGORITHMS["tree"]

    def spy(flat, call):
        seen.append((call.reported_rank[0], call.world_size, call.options(SegmentOptions).segment_bytes))
        tree_all_reduce(flat, call)

    monkeypatch.setitem(hierarchical.INTER_NODE_ALGORITHMS, "tree", spy)
    world = ThreadWorld(world_size)

    def rank_fn(comm):
        comm = Communicator(comm.transport, 10.0, options=[
            SegmentOptions(segment_bytes=8), HierarchicalOptions(ranks_per_node=2, inter_node_algorithm="tree")])
        sub = comm.new_call("all_reduce", "hierarchical").sub(list(range(world_size)), "hierarchical")
        flat = torch.full((numel,), float(comm.rank + 1))
        hierarchical.all_reduce(flat, sub)
        return flat

    results = run_threads(world_size, rank_fn, world=world)
    assert sorted(seen) == [(rank, 2, 8) for rank in range(world_size)]
    for result in results:
        assert torch.equal(result, torch.full((numel,), 10.0))


def test_sub_call_overrides_one_option_and_inherits_the_rest():
    comm = Communicator(ThreadWorld(4).transport(0), options=[SegmentOptions(4096)])
    own = ShmState()
    sub = comm.new_call("all_reduce", "hierarchical").sub([0, 1], "shm", options=[own])
    assert sub.options(ShmState) is own and comm.options(ShmState) is not own
    assert sub.options(SegmentOptions).segment_bytes == 4096
    assert sub.sub([0], "ring").options(ShmState) is own


def test_default_options_are_made_once_and_kept():
    """An algorithm whose options were not given gets defaults; stateful ones live as long as the group."""
    comm = Communicator(ThreadWorld(2).transport(0))
    state = comm.new_call("all_reduce", "shm").options(ShmState)
    assert comm.options(ShmState) is state
    assert comm.options(SegmentOptions) == SegmentOptions()
    assert comm.options(HierarchicalOptions).nodes(2) == ((0, 1),)


def test_communicator_rejects_two_options_of_one_class_and_non_options():
    transport = ThreadWorld(2).transport(0)
    with pytest.raises(ValueError, match="two SegmentOptions"):
        Communicator(transport, options=[SegmentOptions(8), SegmentOptions(16)])
    with pytest.raises(TypeError, match="AlgorithmOptions"):
        Communicator(transport, options=[{"segment_bytes": 8}])
    with pytest.raises(TypeError, match="AlgorithmOptions"):
        Communicator(transport).options(int)


def test_bad_options_are_value_errors_with_the_old_messages():
    with pytest.raises(ValueError, match="segment_bytes must be > 0"):
        SegmentOptions(0)
    with pytest.raises(ValueError, match="choose one of auto, ring, tree, halving_doubling, native"):
        HierarchicalOptions(inter_node_algorithm="shm")
    with pytest.raises(ValueError, match="choose one of auto, ring, shm"):
        HierarchicalOptions(intra_node_algorithm="tree")
    with pytest.raises(ValueError, match="ranks_per_node=3 must be >= 1 and divide the world size 4"):
        Communicator(ThreadWorld(4).transport(0), options=[HierarchicalOptions(ranks_per_node=3)])


# ---------------------------------------------------------------- the one algorithm list


def test_algorithms_come_from_the_registry():
    assert gradsync.ALGORITHMS == registry.ALGORITHMS == tuple(registry.ALL_REDUCE) + ("auto",)
    assert check.ALGORITHMS is registry.ALGORITHMS
    picks = {auto.choose(nbytes, world_size, nodes, shm)
             for nbytes in (4, 2**20, 2**26) for world_size, nodes in ((1, 1), (2, 2), (4, 4), (8, 2))
             for shm in (None, False)}
    assert picks <= set(registry.ALL_REDUCE)


def test_no_two_modules_share_a_name_and_communicator_imports_no_algorithm():
    names = [path.stem for path in SRC.rglob("*.py") if path.stem != "__init__"]
    assert sorted({name for name in names if names.count(name) > 1}) == []
    tree = ast.parse((SRC / "collectives" / "communicator.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "typing", "gradsync.collectives.call", "gradsync.collectives.lane",
                        "gradsync.collectives.options", "gradsync.debug.flight", "gradsync.errors",
                        "gradsync.transport.base", "gradsync.transport.locality"}


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("error,second_base", [
    (CollectiveTimeoutError("all_reduce timed out", peer=3), TimeoutError),
    (CollectiveMismatchError("ranks disagree on shape"), ValueError),
    (PeerFailure(3, "timed out waiting for it", True), Exception),
    (gradsync.NotInitializedError("call init"), Exception),
])
def test_runtime_errors_derive_from_gradsync_error(error, second_base):
    assert isinstance(error, GradsyncError) and isinstance(error, second_base)
    assert not isinstance(error, RuntimeError)  # an `except RuntimeError` for torch's errors does not swallow them


def test_a_timeout_is_caught_by_except_gradsync_error():
    with pytest.raises(gradsync.GradsyncError):
        raise CollectiveTimeoutError("x", peer=1)
    with pytest.raises(TimeoutError):
        raise CollectiveTimeoutError("x", peer=1)


# ---------------------------------------------------------------- exports and version


@pytest.mark.parametrize("name", ["Communicator", "TorchP2PTransport", "ThreadWorld", "ThreadTransport",
                                  "all_to_all", "SegmentOptions", "HierarchicalOptions", "GradsyncError"])
def test_top_level_exports(name):
    assert name in gradsync.__all__ and getattr(gradsync, name) is not None


def test_readme_style_communicator_over_an_exported_transport_runs_all_to_all():
    def rank_fn(comm):
        comm = gradsync.Communicator(comm.transport, 10.0)
        sends = [torch.tensor([10.0 * comm.rank + peer]) for peer in range(2)]
        receives = [torch.empty(1) for _ in range(2)]
        return gradsync.all_to_all(sends, receives, group=comm)

    results = run_threads(2, rank_fn, world=gradsync.ThreadWorld(2))
    assert [[float(t) for t in received] for received in results] == [[0.0, 10.0], [1.0, 11.0]]


def test_one_version_source():
    pyproject = (SRC.parent.parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]
    assert importlib.metadata.version("gradsync") == gradsync.__version__


# ---------------------------------------------------------------- bucket_algorithms


def _model():
    torch.manual_seed(0)
    # weights of 8 MiB and 16 KiB: two buckets, each resolved by auto for its own size
    return nn.Sequential(nn.Linear(1024, 2048, bias=False), nn.Linear(2048, 2, bias=False))


def test_bucket_algorithms_resolve_auto_per_bucket_size():
    world_size = 4

    def rank_fn(comm):
        no_shm = ShmState()
        no_shm.available = False  # as after a host check that found several hosts
        comm = gradsync.Communicator(comm.transport, 30.0, options=[no_shm])
        model = gradsync.DataParallel(_model(), bucket_cap_mb=25.0, algorithm="auto", group=comm)
        return model.bucket_algorithms(), model._reducer.bucket_numels

    for pairs, numels in run_threads(world_size, rank_fn, timeout_s=60):
        nbytes = [numel * 4 for numel in numels]
        nbytes[-1] += 4 * (2 + world_size * SLOTS_PER_RANK)  # the last bucket: used flags, status slots
        assert [size for size, _ in pairs] == nbytes
        assert [name for _, name in pairs] == [auto.choose(size, world_size, world_size, shm_available=False)
                                               for size in nbytes]
        assert len(pairs) == 2  # each bucket resolved for its own size


def test_bucket_algorithms_name_the_compressor_and_fixed_algorithms():
    def rank_fn(comm):
        plain = gradsync.DataParallel(_model(), algorithm="halving_doubling", group=comm)
        compressed = gradsync.DataParallel(_model(), algorithm="ring", compression="onebit", group=comm)
        local = gradsync.LocalSGD(_model(), sync_every=2, group=comm, algorithm="auto")
        return plain.bucket_algorithms(), compressed.bucket_algorithms(), local.bucket_algorithms()

    plain, compressed, local = run_threads(2, rank_fn, timeout_s=60)[0]
    assert {name for _, name in plain} == {"halving_doubling"}
    assert {name for _, name in compressed} == {"ring+onebit"}
    assert sum(size for size, _ in compressed) == sum(size for size, _ in plain)
    assert local == [((1024 * 2048 + 2048 * 2) * 4, "shm")]  # one float32 average; thread ranks share a host


@pytest.mark.parametrize("make, error", [
    (lambda: SegmentOptions(segment_bytes=0.5), TypeError),
    (lambda: SegmentOptions(segment_bytes="8"), TypeError),
    (lambda: SegmentOptions(segment_bytes=0), ValueError),
    (lambda: HierarchicalOptions(ranks_per_node=2.5), TypeError),
    (lambda: HierarchicalOptions(ranks_per_node=True), TypeError),
    (lambda: HierarchicalOptions(ranks_per_node="2"), TypeError),
    (lambda: gradsync.Communicator(gradsync.ThreadWorld(1).transport(0), "5"), TypeError),
    (lambda: gradsync.Communicator(gradsync.ThreadWorld(1).transport(0), None), TypeError),
])
def test_options_of_the_wrong_type_are_refused_naming_the_parameter(make, error):
    """A float, bool or string where a count or seconds belong is refused, not rounded or compared."""
    with pytest.raises(error, match="segment_bytes|ranks_per_node|timeout"):
        make()
