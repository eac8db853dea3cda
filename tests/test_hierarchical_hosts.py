"""``hierarchical`` grouped by real host: unequal and interleaved hosts, bytes across hosts, defaults,
``inter_node_algorithm="native"`` and ``auto`` across hosts.

Thread ranks with an injected :class:`~gradsync.transport.locality.Locality`
pretend to be on several hosts (they all share one ``/dev/shm``, so the
shared-memory steps inside a host really run). Expected values are closed
forms (``_reference``); byte counts come from the scheme's phases (chunks
split by the smallest host), written here without the code under test.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import gradsync
from _dist import capture, run_threads, run_world
from _reference import assert_bitwise_equal, closed_form_input, closed_form_result
from gradsync.collectives import Communicator, HierarchicalOptions, auto
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import hierarchical
from gradsync.collectives.cost.formulas import predict_s
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.hierarchical import BackendSubgroups
from gradsync.collectives.validate import resolve_algorithm
from gradsync.process_group import default_communicator
from gradsync.transport.locality import Locality
from gradsync.transport.thread import ThreadWorld

HOSTS = [(0, 0, 1), (0, 1, 0, 1), (0, 0, 1, 1), (0, 0, 0, 1, 1), (0, 1, 1)]
DTYPES = (torch.float32, torch.float16, torch.int64)
NUMELS = (0, 1, 7, 1000)
COLLECTIVE_TIMEOUT_S = 10.0


def host_comm(comm, hosts, timeout_s: float = COLLECTIVE_TIMEOUT_S, **options) -> Communicator:
    """A communicator on ``comm``'s transport whose ranks are on ``hosts`` (hosts[r]: rank r's host)."""
    made = Communicator(comm.transport, timeout_s, options=[HierarchicalOptions(**options)])
    made.locality = Locality(tuple(hosts))
    return made


def _ids(hosts):
    return "hosts" + "".join(map(str, hosts))


@pytest.mark.parametrize("inter", ["auto", "ring", "tree", "halving_doubling"])
@pytest.mark.parametrize("intra", ["ring", "shm"])
@pytest.mark.parametrize("hosts", HOSTS, ids=_ids)
def test_hierarchical_on_real_hosts_is_exact_and_bitwise_equal_everywhere(hosts, intra, inter):
    """Unequal / interleaved hosts, every dtype and numel (0, 1, 7 < or > L_min, 1000): the exact closed-form sum."""
    world_size = len(hosts)
    cases = [(dtype, numel) for dtype in DTYPES for numel in NUMELS]

    def rank_fn(comm):
        comm = host_comm(comm, hosts, inter_node_algorithm=inter, intra_node_algorithm=intra)
        results = []
        for dtype, numel in cases:
            tensor = closed_form_input(numel, comm.rank, world_size, dtype)
            gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm)
            results.append(tensor)
        comm.close()
        return results

    for rank, results in enumerate(run_threads(world_size, rank_fn)):
        for (dtype, numel), result in zip(cases, results):
            expected = closed_form_result(numel, world_size, dtype, "sum")
            assert_bitwise_equal(result, expected, f"rank {rank} {dtype} n={numel}")


@pytest.mark.parametrize("intra", ["ring", "shm"])
@pytest.mark.parametrize("hosts", [(0, 0, 1), (0, 1, 0, 1, 1)], ids=_ids)
def test_hierarchical_rounded_sums_are_bitwise_equal_on_every_rank(hosts, intra):
    """Random float32 (sums round): every rank holds the same bits, within summation tolerance of float64."""
    world_size, numel = len(hosts), 1001
    generator = torch.Generator().manual_seed(17)
    inputs = [torch.randn(numel, generator=generator) for _ in hosts]

    def rank_fn(comm):
        comm = host_comm(comm, hosts, intra_node_algorithm=intra)
        tensor = inputs[comm.rank].clone()
        gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm)
        comm.close()
        return tensor

    results = run_threads(world_size, rank_fn)
    for rank, result in enumerate(results):
        assert_bitwise_equal(result, results[0], f"rank {rank} against rank 0")
    reference = torch.stack([tensor.double() for tensor in inputs]).sum(0).float()
    torch.testing.assert_close(results[0], reference, rtol=1e-5, atol=1e-5)


def _cross_host_bytes(hosts, numel, **options):
    """Per rank: (payload bytes sent to other hosts, payload bytes sent inside its host) in a second call
    (the first sets shared memory up, whose small messages are not the algorithm's)."""
    world_size = len(hosts)
    across, inside = [0] * world_size, [0] * world_size

    def rank_fn(comm):
        transport = comm.transport
        plain_isend = transport.isend

        def counting_isend(tensor, peer):
            counter = across if hosts[peer] != hosts[transport.rank] else inside
            counter[transport.rank] += tensor.numel() * tensor.element_size()
            return plain_isend(tensor, peer)

        comm = host_comm(comm, hosts, **options)
        collectives_api.all_reduce(torch.ones(numel), comm, algorithm="hierarchical", verify=False)
        transport.isend = counting_isend
        collectives_api.all_reduce(torch.ones(numel), comm, algorithm="hierarchical", verify=False)
        comm.close()

    run_threads(world_size, rank_fn)
    return across, inside


def test_two_hosts_of_two_send_half_the_vector_across_per_rank_interleaved():
    """Hosts (0, 1, 0, 1), n floats: each rank ring-all-reduces n/2 with its peer, sending n/2 across (a
    host n, against 1.5 n for a flat ring); inside, ring reduce-scatter + all-gather send n/2 each."""
    numel = 840
    across, inside = _cross_host_bytes((0, 1, 0, 1), numel, intra_node_algorithm="ring")
    assert across == [4 * numel // 2] * 4
    assert inside == [4 * numel // 2 * 2] * 4


def test_unequal_hosts_send_the_whole_vector_across_from_the_leader_only():
    """Hosts (0, 0, 1): L_min = 1, so ranks 0 and 2 ring-all-reduce all n (each sends n across); the extra
    rank 1 hands its n to rank 0 and gets n back (ring inside), or moves nothing point-to-point (shm)."""
    numel = 1000
    across, inside = _cross_host_bytes((0, 0, 1), numel, intra_node_algorithm="ring")
    assert across == [4 * numel, 0, 4 * numel] and inside == [4 * numel, 4 * numel, 0]
    across, inside = _cross_host_bytes((0, 0, 1), numel, intra_node_algorithm="shm")
    assert across == [4 * numel, 0, 4 * numel] and inside == [0, 0, 0]


def test_three_and_two_ranks_cross_on_two_local_ranks_and_extras_send_n():
    """Hosts (0, 0, 0, 1, 1), ring inside: L_min = 2 chunks of n/2; local ranks 0 and 1 each send n/2
    across; the extra rank 2 sends n inside (its two chunks) and each owner sends it its chunk back."""
    numel = 840
    half = 4 * numel // 2
    across, inside = _cross_host_bytes((0, 0, 0, 1, 1), numel, intra_node_algorithm="ring")
    assert across == [half, half, 0, half, half]
    # owners: ring reduce-scatter + all-gather among 2 (n/2 each) + chunk to the extra (n/2)
    assert inside == [half * 3, half * 3, 2 * half, half * 2, half * 2]


def test_default_intra_node_is_shm_on_real_hosts_and_ring_on_pretend_nodes():
    """intra_node_algorithm="auto": real hosts of 2 send only the cross-host share point-to-point; pretend
    nodes of 2 (ranks_per_node=2) keep the ring inside (n/2 more each way)."""
    numel = 840
    across, inside = _cross_host_bytes((0, 0, 1, 1), numel)
    assert across == [4 * numel // 2] * 4 and inside == [0] * 4
    assert HierarchicalOptions().intra_for(2, "cpu") == "shm"
    assert HierarchicalOptions(ranks_per_node=2).intra_for(2, "cpu") == "ring"
    assert HierarchicalOptions().intra_for(1, "cpu") == HierarchicalOptions().intra_for(2, "cuda") == "ring"


def test_explicit_ranks_per_node_keeps_contiguous_pretend_nodes():
    """ranks_per_node=2 wins over the hosts: nodes are rank blocks, whatever the locality says."""
    options = HierarchicalOptions(ranks_per_node=2)
    assert options.nodes(4, Locality((0, 1, 0, 1))) == ((0, 1), (2, 3))
    assert HierarchicalOptions().nodes(4, Locality((0, 1, 0, 1))) == ((0, 2), (1, 3))
    assert HierarchicalOptions().nodes(3, None) == ((0, 1, 2),)


def test_native_across_nodes_on_threads_raises_on_every_rank_before_data_moves():
    """inter_node_algorithm="native" needs backend subgroups: ValueError on every rank, tensor untouched."""
    def rank_fn(comm):
        comm = host_comm(comm, (0, 0, 1, 1), inter_node_algorithm="native")
        tensor = torch.full((10,), float(comm.rank))
        before = comm.stats.bytes_sent
        exc, _ = capture(lambda: gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm))
        return exc, tensor, comm.stats.bytes_sent - before

    for rank, (exc, tensor, sent) in enumerate(run_threads(4, rank_fn)):
        assert type(exc) is ValueError and "native" in str(exc) and "ThreadTransport" in str(exc), f"{exc!r}"
        assert_bitwise_equal(tensor, torch.full((10,), float(rank)), f"rank {rank}")
        assert sent == 0, f"rank {rank} sent {sent} payload bytes"


# ---------------------------------------------------------------- auto across hosts


def _model_pick(hosts: tuple[int, ...], nbytes: int) -> str:
    """The algorithm with the least predicted time on the test-hosts profile, from the formulas here
    (hosts as rank counts)."""
    sizes = tuple(hosts.count(host) for host in sorted(set(hosts)))
    names = ("ring", "tree", "double_binary_tree", "halving_doubling", "hierarchical")
    profile = get_profile("test-hosts")
    return min(names, key=lambda name: predict_s(name, profile, Topology(sizes), nbytes))


@pytest.mark.parametrize("hosts", [(0, 0, 1), (0, 1, 0, 1), (0, 1), (0, 1, 2, 3), (0, 1, 2), (0, 0, 0, 1),
                                   (0, 0, 1, 1)])
@pytest.mark.parametrize("nbytes", [4, 4096, 65536, 2**20, 2**26])
def test_auto_across_hosts_picks_what_the_model_predicts_fastest(hosts, nbytes):
    """auto over several hosts: the cost model's fastest on the group's real topology, never shm."""
    comm = Communicator(ThreadWorld(len(hosts)).transport(0))
    comm.locality = Locality(hosts)
    chosen = resolve_algorithm(comm, nbytes, "auto")
    assert chosen == _model_pick(hosts, nbytes) and chosen != "shm"


def test_auto_on_one_host_may_pick_shm():
    comm = Communicator(ThreadWorld(3).transport(0))
    comm.locality = Locality((0, 0, 0))
    assert resolve_algorithm(comm, 4, "auto") == auto.choose(4, 3, 3)


def test_auto_across_unequal_hosts_runs_hierarchical_with_its_bytes():
    """auto on hosts (0, 0, 1) where the model picks hierarchical: exact sum and exactly its payload bytes."""
    hosts = (0, 0, 1)
    numel = next(n for n in (2**10, 2**14, 2**18, 2**22, 2**24) if _model_pick(hosts, 4 * n) == "hierarchical")

    def rank_fn(algorithm):
        def run(comm):
            comm = host_comm(comm, hosts)
            tensor = closed_form_input(numel, comm.rank, 3, torch.float32)
            gradsync.all_reduce(tensor, algorithm=algorithm, group=comm)
            comm.close()
            return tensor, comm.stats.bytes_sent
        return run

    expected = closed_form_result(numel, 3, torch.float32, "sum")
    for rank, ((result, auto_bytes), (_, chosen_bytes)) in enumerate(zip(run_threads(3, rank_fn("auto")),
                                                                         run_threads(3, rank_fn("hierarchical")))):
        assert_bitwise_equal(result, expected, f"rank {rank}")
        assert auto_bytes == chosen_bytes, f"rank {rank}: auto {auto_bytes} B, hierarchical {chosen_bytes} B"


# ---------------------------------------------------------------- native across hosts, real processes

NATIVE_HOSTS = (0, 1, 1, 0)  # host 0 = ranks (0, 3), host 1 = (1, 2): subgroups [0, 1] and [3, 2]
NATIVE_CASES = ((torch.float32, 1001), (torch.float16, 7), (torch.int8, 5), (torch.float32, 1))


def _rank_native_across_hosts():
    """With injected hosts: hierarchical, native across hosts, shm and ring inside; twice (subgroups kept)."""
    base = default_communicator()
    results = {}
    for intra in ("auto", "ring"):
        comm = Communicator(base.transport, COLLECTIVE_TIMEOUT_S,
                            options=[HierarchicalOptions(inter_node_algorithm="native", intra_node_algorithm=intra)])
        comm.locality = Locality(NATIVE_HOSTS)
        for repeat in range(2):
            for dtype, numel in NATIVE_CASES:
                tensor = closed_form_input(numel, comm.rank, len(NATIVE_HOSTS), dtype)
                gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm)
                results[(intra, repeat, str(dtype), numel)] = tensor
        results[(intra, "layouts")] = len(comm.options(BackendSubgroups).by_layout)
        comm.close()
    return results


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_hierarchical_native_across_hosts_in_real_processes():
    """Gloo subgroups per local rank (made once): exact sums on every rank, shm or ring inside."""
    world_size = len(NATIVE_HOSTS)
    for rank, results in enumerate(run_world(world_size, _rank_native_across_hosts, timeout_s=50)):
        for intra in ("auto", "ring"):
            assert results[(intra, "layouts")] == 1, f"rank {rank} {intra}"
            for repeat in range(2):
                for dtype, numel in NATIVE_CASES:
                    expected = closed_form_result(numel, world_size, dtype, "sum")
                    assert_bitwise_equal(results[(intra, repeat, str(dtype), numel)], expected,
                                         f"rank {rank} {intra} #{repeat} {dtype} n={numel}")


# ---------------------------------------------------------------- the pipeline (shm inside, several hosts)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1 KiB, so that messages of a few KB run the pipeline of several pieces."""
    monkeypatch.setattr(hierarchical, "PIPELINE_PIECE_BYTES", 1024)


def test_pipeline_pieces_cover_the_message_in_order():
    """Pieces are contiguous, cover [0, numel), hold >= PIPELINE_PIECE_BYTES each, and number <= the maximum."""
    piece = hierarchical.PIPELINE_PIECE_BYTES
    for numel, element_size in [(0, 4), (1, 4), (piece // 4, 4), (piece // 2 - 1, 4), (5 * piece // 2 + 3, 2),
                                (10**8, 4)]:
        pieces = hierarchical.pipeline_pieces(numel, element_size)
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(a_stop == b_start for (_, a_stop), (b_start, _) in zip(pieces, pieces[1:]))
        assert 1 <= len(pieces) <= hierarchical.PIPELINE_MAX_PIECES
        if len(pieces) > 1:
            assert min(b - a for a, b in pieces) * element_size >= piece, (numel, pieces)
    assert len(hierarchical.pipeline_pieces(16 * 2**20 // 4, 4)) == hierarchical.PIPELINE_MAX_PIECES


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (0, 0, 0, 1, 1), (0, 1, 1), (1, 0, 1, 0)], ids=_ids)
def test_pipelined_hierarchical_is_exact_and_bitwise_equal_everywhere(small_pieces, hosts):
    """Several pieces crossing on the helper thread while shm works on the next: the exact closed-form
    sum (float32, int64, float16, bfloat16; 2 to PIPELINE_MAX_PIECES pieces), and random float32 with the same
    bits on every rank."""
    world_size = len(hosts)
    cases = [(torch.float32, 700), (torch.float32, 5000), (torch.int64, 301), (torch.float16, 1100),
             (torch.bfloat16, 1100)]
    assert [len(hierarchical.pipeline_pieces(n, d.itemsize)) for d, n in cases[:3]] == [
        2, hierarchical.PIPELINE_MAX_PIECES, 2]
    generator = torch.Generator().manual_seed(5)
    randoms = [torch.randn(3001, generator=generator) for _ in hosts]

    def rank_fn(comm):
        comm = host_comm(comm, hosts, intra_node_algorithm="shm")
        results = []
        for dtype, numel in cases:
            tensor = closed_form_input(numel, comm.rank, world_size, dtype)
            gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm)
            results.append(tensor)
        tensor = randoms[comm.rank].clone()
        gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm)
        comm.close()
        return results, tensor

    outcomes = run_threads(world_size, rank_fn)
    for rank, (results, rounded) in enumerate(outcomes):
        for (dtype, numel), result in zip(cases, results):
            assert_bitwise_equal(result, closed_form_result(numel, world_size, dtype, "sum"),
                                 f"rank {rank} {dtype} n={numel}")
        assert_bitwise_equal(rounded, outcomes[0][1], f"rank {rank} random against rank 0")
    reference = torch.stack([tensor.double() for tensor in randoms]).sum(0).float()
    torch.testing.assert_close(outcomes[0][1], reference, rtol=1e-5, atol=1e-5)


def test_pipeline_rank_that_never_calls_times_out_everywhere_and_leaves_no_helper_thread(small_pieces):
    """Hosts (0, 0, 1, 1), rank 3 skips the call: its host peer waits in shm, the other host's ranks on the
    crossing thread; every caller raises CollectiveTimeoutError within timeout + 2 s, and no thread stays."""
    timeout_s = 1.0

    def rank_fn(comm):
        comm = host_comm(comm, (0, 0, 1, 1), timeout_s, intra_node_algorithm="shm")
        if comm.rank == 3:
            return None
        started = time.monotonic()
        exc, _ = capture(lambda: gradsync.all_reduce(torch.ones(5000), algorithm="hierarchical", group=comm))
        return exc, time.monotonic() - started

    outcomes = run_threads(4, rank_fn, timeout_s=30)
    for rank, outcome in enumerate(outcomes[:3]):
        exc, elapsed = outcome
        assert isinstance(exc, gradsync.CollectiveTimeoutError), f"rank {rank}: {exc!r}"
        assert elapsed < timeout_s + 2, f"rank {rank} took {elapsed:.1f} s"
    deadline = time.monotonic() + 5
    while any(t.name.startswith("gradsync-inter-node") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a crossing thread outlived its call"
        time.sleep(0.05)
