"""What each all_reduce algorithm sends, against its published cost; auto's choice from the cost model.

Payload bytes and messages per rank for ring, tree, halving_doubling (short,
long, folded) and hierarchical, from the algorithms' published costs (Thakur,
Rabenseifner & Gropp 2005) written here without the code under test; empty
and one-rank calls send nothing; receives are posted before the first send.
algorithm='auto' picks what the cost formulas predict fastest and moves
exactly the bytes of its choice.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradsync
from _dist import run_threads
from _reference import assert_bitwise_equal, closed_form_input, closed_form_result
from _variants import PAIR_SMALL, SMALL, VARIANTS, Variant, run_variant, variant_names_for
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import HierarchicalOptions, auto, halving_doubling
from gradsync.collectives.cost.formulas import predict_s
from gradsync.collectives.cost.profile import Link, Profile
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology


# ---------------------------------------------------------------- payload bytes


def split_numels(numel: int, parts: int) -> list[int]:
    """Chunk sizes as torch.tensor_split cuts ``numel`` elements into ``parts``."""
    return [piece.numel() for piece in torch.tensor_split(torch.empty(numel), parts)]


def payload_stats(variant: Variant, world_size: int, numel: int, dtype=torch.float32, segment_bytes=None):
    """Each rank's TransportStats dict after one all_reduce of ``numel`` elements."""
    def rank_fn(comm):
        gradsync.all_reduce(torch.ones(numel, dtype=dtype), algorithm=variant.algorithm, group=comm)
        return comm.stats.as_dict()

    return run_variant(variant, world_size, rank_fn, segment_bytes=segment_bytes)


def assert_conserved(all_stats):
    """Every payload byte sent is received by someone, and the layout check counts as control."""
    assert sum(s["bytes_sent"] for s in all_stats) == sum(s["bytes_received"] for s in all_stats)
    assert all(s["control_bytes_sent"] > 0 for s in all_stats), all_stats


def ring_sent_numel(numel: int, world_size: int, rank: int) -> int:
    """Ring rank r sends every chunk but its own (reduce-scatter) and every chunk but r+1's (all-gather)."""
    chunks = split_numels(numel, world_size)
    return 2 * numel - chunks[rank] - chunks[(rank + 1) % world_size]


def payload_stats_per_call(variant: Variant, world_size: int, calls, segment_bytes=None):
    """Per rank, one TransportStats difference per ``(numel, dtype)`` all_reduce of ``calls``, run on one group."""
    def rank_fn(comm):
        differences = []
        for numel, dtype in calls:
            before = comm.stats.as_dict()
            gradsync.all_reduce(torch.ones(numel, dtype=dtype), algorithm=variant.algorithm, group=comm)
            differences.append({key: value - before[key] for key, value in comm.stats.as_dict().items()})
        return differences

    outcomes = run_variant(variant, world_size, rank_fn, segment_bytes=segment_bytes)
    return [[outcome[index] for outcome in outcomes] for index in range(len(calls))]


RING_PAYLOAD_CALLS = [(numel, dtype) for numel in (1, 2, 840, 1001) for dtype in (torch.float32, torch.float64)]


@pytest.mark.parametrize("segment_bytes", [8, 100, 2**20])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7])
def test_ring_all_reduce_payload_bytes_match_formula(world_size, segment_bytes):
    """Ring rank r sends (2n - c_r - c_(r+1)) elements and receives (2n - c_(r-1) - c_r), one message per
    segment whatever segment_bytes; 2(p-1)n in total (2(p-1)/p·n per rank when p divides n); the layout
    check goes to control bytes. numel 1, 2, 840, 1001 in float32 and float64, on one group."""
    per_call = payload_stats_per_call(Variant("ring"), world_size, RING_PAYLOAD_CALLS, segment_bytes)
    for (numel, dtype), all_stats in zip(RING_PAYLOAD_CALLS, per_call):
        element_nbytes = torch.tensor([], dtype=dtype).element_size()
        segment_numel = max(1, segment_bytes // element_nbytes)
        chunks = split_numels(numel, world_size)
        for rank, stats in enumerate(all_stats):
            what = f"rank {rank} numel={numel} {dtype}: {stats}"
            left, right = (rank - 1) % world_size, (rank + 1) % world_size
            assert stats["bytes_sent"] == element_nbytes * ring_sent_numel(numel, world_size, rank), what
            received = 2 * numel - chunks[left] - chunks[rank]
            assert stats["bytes_received"] == element_nbytes * received, what
            sent_chunks = [c for index, c in enumerate(chunks) if index != rank] + \
                          [c for index, c in enumerate(chunks) if index != right]
            segments = sum(math.ceil(c / segment_numel) for c in sent_chunks)
            assert stats["messages_sent"] == segments, f"{what}, expected {segments} segments"
            if numel % world_size == 0:
                assert stats["bytes_sent"] * world_size == 2 * (world_size - 1) * numel * element_nbytes, what
        assert sum(s["bytes_sent"] for s in all_stats) == element_nbytes * 2 * (world_size - 1) * numel
        assert_conserved(all_stats)


def tree_children(rank: int, world_size: int) -> list[int]:
    return [child for child in (2 * rank + 1, 2 * rank + 2) if child < world_size]


@pytest.mark.parametrize("segment_bytes", [40, 2**20])
@pytest.mark.parametrize("numel", [840, 1001])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])
def test_tree_all_reduce_payload_bytes_match_formula(world_size, numel, segment_bytes):
    """Tree: a rank sends n to its parent (not the root) and n to each child; 2(p-1)n in total, per segment."""
    all_stats = payload_stats(Variant("tree"), world_size, numel, segment_bytes=segment_bytes)
    segments = math.ceil(numel / max(1, segment_bytes // 4))
    for rank, stats in enumerate(all_stats):
        links = (rank > 0) + len(tree_children(rank, world_size))  # parent + children
        assert stats["bytes_sent"] == 4 * numel * links, f"rank {rank}: {stats}"
        assert stats["bytes_received"] == 4 * numel * links, f"rank {rank}: {stats}"
        assert stats["messages_sent"] == segments * links, f"rank {rank}: {stats}"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * 2 * (world_size - 1) * numel
    assert_conserved(all_stats)


def fold_layout(world_size: int) -> tuple[int, int]:
    """(p', extra): the largest power of two <= p and the number of ranks folded into it."""
    core_size = 2 ** int(math.log2(world_size))
    return core_size, world_size - core_size


@pytest.mark.parametrize("path", ["short", "long"])
@pytest.mark.parametrize("numel", [840, 1001, 3])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_halving_doubling_payload_bytes_match_formula(world_size, numel, path):
    """Core ranks send log2(p')·n (short, or n < p') or 2(p'-1)/p'·n (long, p' | n); folds add n each way."""
    variant = VARIANTS[f"halving_doubling-{path}"]
    all_stats = payload_stats(variant, world_size, numel)
    core_size, extra = fold_layout(world_size)
    if numel < core_size:
        path = "short"  # fewer elements than core ranks: recursive doubling whatever the byte count
    log2_core = int(math.log2(core_size))
    core_total = core_size * log2_core * numel if path == "short" else 2 * (core_size - 1) * numel
    for rank, stats in enumerate(all_stats):
        folded_away = rank < 2 * extra and rank % 2 == 0  # sends n once, then waits for the result
        folded_into = rank < 2 * extra and rank % 2 == 1  # core member that also returns the result
        if folded_away:
            expected = numel
        elif path == "short":
            expected = log2_core * numel + folded_into * numel
        elif numel % core_size == 0:
            expected = 2 * (core_size - 1) * numel // core_size + folded_into * numel
        else:
            continue  # uneven halves: only the total has a closed form
        assert stats["bytes_sent"] == 4 * expected, f"rank {rank}: {stats}"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * (core_total + 2 * extra * numel)
    assert_conserved(all_stats)


def test_halving_doubling_power_of_two_paths_match_published_costs():
    """p = 8, n = 840: the long path sends 2(p-1)/p·n per rank, the short path log2(p)·n, as in Thakur et al."""
    long_path = payload_stats(VARIANTS["halving_doubling-long"], 8, 840)
    short_path = payload_stats(VARIANTS["halving_doubling-short"], 8, 840)
    assert [s["bytes_sent"] for s in long_path] == [4 * 2 * 7 * 840 // 8] * 8
    assert [s["bytes_sent"] for s in short_path] == [4 * 3 * 840] * 8


def hierarchical_sent_numel(numel: int, world_size: int, ranks_per_node: int, rank: int) -> int:
    """Intra-node ring reduce-scatter + inter-node ring all-reduce of chunk l + intra-node ring all-gather."""
    node, local_rank = divmod(rank, ranks_per_node)
    nodes = world_size // ranks_per_node
    local_chunks = split_numels(numel, ranks_per_node)
    reduce_scatter = numel - local_chunks[local_rank]  # every local chunk but its own
    all_gather = numel - local_chunks[(local_rank + 1) % ranks_per_node]  # every one but the right's
    return reduce_scatter + ring_sent_numel(local_chunks[local_rank], nodes, node) + all_gather


@pytest.mark.parametrize("numel", [840, 1001, 5])
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_hierarchical_all_reduce_payload_bytes_match_phases(world_size, ranks_per_node, numel):
    """Hierarchical sends the sum of its three ring phases per rank, and 2(p-1)n in total like a flat ring."""
    all_stats = payload_stats(Variant("hierarchical", ranks_per_node=ranks_per_node), world_size, numel)
    for rank, stats in enumerate(all_stats):
        expected = hierarchical_sent_numel(numel, world_size, ranks_per_node, rank)
        assert stats["bytes_sent"] == 4 * expected, f"rank {rank}: {stats}"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * 2 * (world_size - 1) * numel
    assert_conserved(all_stats)


def test_hierarchical_sends_one_node_share_across_nodes():
    """2 nodes of 2 ranks, n elements: each rank sends only n/2 to the other node (a flat ring would send more)."""
    world_size, ranks_per_node, numel = 4, 2, 840
    inter_node_bytes = [0] * world_size

    def rank_fn(comm):
        transport = comm.transport
        plain_isend = transport.isend

        def counting_isend(tensor, peer):
            if peer // ranks_per_node != transport.rank // ranks_per_node:
                inter_node_bytes[transport.rank] += tensor.numel() * tensor.element_size()
            return plain_isend(tensor, peer)

        transport.isend = counting_isend
        collectives_api.all_reduce(torch.ones(numel), comm, algorithm="hierarchical", verify=False)

    run_threads(world_size, rank_fn, ranks_per_node=ranks_per_node)
    # Local chunk l (n/2 elements) is ring-all-reduced by the 2 ranks of local rank l: n/2 sent each.
    assert inter_node_bytes == [4 * numel // 2] * world_size


@pytest.mark.parametrize("name", sorted(variant_names_for(4)))
def test_algorithms_empty_tensor_sends_no_payload(name):
    """An empty all_reduce moves no payload bytes for any variant (the layout check is control traffic)."""
    variant = VARIANTS[name]
    if variant.warm_shm:  # the segment exists: the layout check goes through it, nothing point-to-point
        [all_stats] = payload_stats_per_call(variant, 4, [(0, torch.float32)])
        assert all(not any(stats.values()) for stats in all_stats), all_stats
        return
    all_stats = payload_stats(variant, 4, 0)
    for rank, stats in enumerate(all_stats):
        assert stats["bytes_sent"] == 0 and stats["bytes_received"] == 0, f"rank {rank}: {stats}"
    assert_conserved(all_stats)


def test_all_reduce_alone_sends_nothing():
    """p = 1: an empty or non-empty all_reduce sends no payload and no control bytes (there is no peer)."""
    for numel in (0, 10):
        [stats] = payload_stats(VARIANTS["ring"], 1, numel)
        assert stats["bytes_sent"] == stats["bytes_received"] == stats["control_bytes_sent"] == 0, stats


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["ring", "halving_doubling"])
def test_receives_are_posted_before_the_first_send(name, world_size):
    """Gloo moves a payload only into a posted receive: a send posted first costs a notify round trip
    that waits behind the link's queue (ring reached 59% of a shaped 1 Gbit/s link, 99% receive-first).
    Every rank posts a receive before its first payload send, for short and long messages."""
    orders = [[] for _ in range(world_size)]

    def rank_fn(comm):
        transport = comm.transport
        for method in ("isend", "irecv", "isend_tagged", "irecv_tagged"):
            plain = getattr(transport, method)

            def recording(*args, _plain=plain, _kind=method.startswith("isend")):
                orders[transport.rank].append("send" if _kind else "recv")
                return _plain(*args)

            setattr(transport, method, recording)
        for numel in (16, halving_doubling.SHORT_MESSAGE_BYTES // 4 + 64):
            start = len(orders[comm.rank])
            collectives_api.all_reduce(torch.ones(numel), comm, algorithm=name, verify=False)
            orders[comm.rank].append(orders[comm.rank][start:])

    run_threads(world_size, rank_fn)
    for rank, recorded in enumerate(orders):
        for order in (entry for entry in recorded if isinstance(entry, list)):
            assert order and order[0] == "recv", f"rank {rank} posted {order[:4]} first"


# ---------------------------------------------------------------- auto


def _model_choice(nbytes, host_sizes, candidates, profile):
    """The candidate with the least predicted time, computed here from the formulas."""
    topology = Topology(tuple(host_sizes))
    return min(candidates, key=lambda name: predict_s(name, profile, topology, nbytes - nbytes % 4))


@pytest.mark.parametrize("profile_name", ["this-machine", "test-hosts", "h100-ib"])
@pytest.mark.parametrize("nbytes", [4, 4096, 65536, 2**20, 16 * 2**20, 2**28])
@pytest.mark.parametrize("host_sizes", [(2,), (3,), (4,), (8,), (2, 2), (1, 1, 1, 1), (4, 4)])
def test_auto_choose_follows_the_cost_model(nbytes, host_sizes, profile_name):
    """choose picks the algorithm whose formula predicts the least time on the group's topology."""
    profile = get_profile(profile_name)
    several = len(host_sizes) > 1
    if several and profile.inter is None:
        return
    world_size = sum(host_sizes)
    flat = ("ring", "tree", "double_binary_tree", "halving_doubling")
    for shm_available in (None, False):
        candidates = flat + (("hierarchical",) if several else ()) + \
            (("shm",) if not several and shm_available is None and profile.shm else ())
        expected = _model_choice(nbytes, host_sizes, candidates, profile)
        chosen = auto.choose(nbytes, world_size, 1 if several else world_size, shm_available=shm_available,
                             host_sizes=host_sizes if several else None, profile=profile)
        assert chosen == expected, (nbytes, host_sizes, shm_available)


def test_auto_moves_from_latency_to_bandwidth_algorithms_as_messages_grow():
    """On a slow-start link the short messages go to a log-step algorithm and the long ones to the ring,
    whose per-link bytes are the least: the crossover the thresholds used to encode, now from the model."""
    profile = Profile("t", "", Link(1e-3, 1e9), None, 1e-10, 1e-10, ranks_per_host=8)
    picks = [auto.choose(nbytes, 8, 8, shm_available=False, profile=profile) for nbytes in (4096, 2**30)]
    assert picks[0] in ("tree", "halving_doubling") and picks[1] == "ring"
    assert auto.choose(2**30, 1, 1, profile=profile) == "ring"


@pytest.mark.parametrize("nbytes", [4, 2**20, 2**30])
def test_auto_never_picks_shm_where_it_cannot_run(nbytes):
    """shm only when every rank shares one node and shared memory is not known to be unavailable."""
    assert auto.choose(nbytes, 4, 4, shm_available=False) != "shm"
    assert auto.choose(nbytes, 4, 2) != "shm"  # pretend nodes
    assert auto.choose(nbytes, 4, 1, shm_available=False, host_sizes=(2, 2)) != "shm"
    assert auto.choose(nbytes, 1, 1) == "ring"


@given(nbytes=st.integers(min_value=0, max_value=2**40), world_size=st.integers(min_value=1, max_value=64),
       nodes=st.integers(min_value=1, max_value=8))
def test_auto_choose_returns_a_concrete_algorithm(nbytes, world_size, nodes):
    """choose always names a point-to-point algorithm in ALGORITHMS (never auto or native)."""
    ranks_per_node = max(world_size // nodes, 1)
    chosen = auto.choose(nbytes, world_size, ranks_per_node)
    assert chosen in gradsync.ALGORITHMS and chosen not in ("auto", "native")


AUTO_CASES = {  # id -> (world_size, ranks_per_node, numel): what auto should choose for it
    "small-p4": (4, None, 1000),
    "large-p4": (4, None, SMALL // 4 + 1),
    "large-p4-two-nodes": (4, 2, SMALL // 4 + 1),
    "large-p2": (2, None, PAIR_SMALL // 4 + 1),
    "small-p2": (2, None, 33),
    "small-p5": (5, None, 17),
}


@pytest.mark.parametrize("case", sorted(AUTO_CASES))
def test_auto_all_reduce_sums_and_moves_the_bytes_of_its_choice(case):
    """algorithm='auto' gives the exact sum and exactly the payload bytes of the algorithm choose() names."""
    world_size, ranks_per_node, numel = AUTO_CASES[case]
    chosen = auto.choose(numel * 4, world_size, ranks_per_node or world_size)
    expected = closed_form_result(numel, world_size, torch.float32, "sum")

    def rank_fn(algorithm):
        def run(comm):
            tensor = closed_form_input(numel, comm.rank, world_size, torch.float32)
            gradsync.all_reduce(tensor, algorithm=algorithm, group=comm)
            return tensor, comm.stats.bytes_sent
        return run

    auto_results = run_threads(world_size, rank_fn("auto"), ranks_per_node=ranks_per_node)
    chosen_results = run_threads(world_size, rank_fn(chosen), ranks_per_node=ranks_per_node)
    for rank, ((result, auto_bytes), (_, chosen_bytes)) in enumerate(zip(auto_results, chosen_results)):
        assert_bitwise_equal(result, expected, f"rank {rank}")
        assert auto_bytes == chosen_bytes, f"rank {rank}: auto sent {auto_bytes} B, {chosen} sends {chosen_bytes} B"


def test_inter_node_auto_is_halving_doubling_over_a_power_of_two_number_of_nodes_else_ring():
    """The default across nodes: halving_doubling at 1, 2, 4, 8 nodes; ring at 3, 5, 6; explicit choices kept."""
    options = HierarchicalOptions()
    assert options.inter_node_algorithm == "auto"
    assert [options.inter_for(nodes) for nodes in (1, 2, 3, 4, 5, 6, 8)] == [
        "halving_doubling", "halving_doubling", "ring", "halving_doubling", "ring", "ring", "halving_doubling"]
    assert HierarchicalOptions(inter_node_algorithm="tree").inter_for(4) == "tree"
