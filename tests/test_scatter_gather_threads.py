"""reduce_scatter and all_gather of every algorithm over in-process thread ranks, as the AllReduce suites.

The public calls (``gradsync.reduce_scatter`` / ``gradsync.all_gather``) and
the in-place pair DataParallel's sharding calls (``reduce_scatter_flat`` /
``all_gather_flat``), for every algorithm that carries them (ring,
halving_doubling, hierarchical on pretend nodes and on unequal, interleaved
hosts, shm and its arena, native, auto): closed-form inputs give exact sums,
so every result is compared bitwise with ``torch.tensor_split`` of the
reference sum, or with every rank's input; random floats show the promises
about summation order (ring's and halving_doubling's chunks are their
AllReduce's, shm's arena and copy paths agree). Mismatched shapes and dtypes
raise on every rank, ``tree`` is refused on every rank, a silent rank is
named within the timeout plus 2 s.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradsync
from _dist import capture, run_threads
from _reference import assert_bitwise_equal, closed_form_input, closed_form_result, strided_column_view
from _variants import PROPERTY_RUN, VARIANTS, Variant, dtype_and_op, run_variant, selected_path, world_and_variant
from gradsync import CollectiveMismatchError, CollectiveTimeoutError, Communicator
from gradsync.collectives import HierarchicalOptions, halving_doubling, registry
from gradsync.collectives import ops as collectives_api
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.scatter_gather import all_gather_flat, reduce_scatter_flat
from gradsync.transport.locality import Locality

CARRIERS = ("ring", "halving_doubling", "hierarchical", "shm", "native", "auto")
SG_VARIANTS = {name: variant for name, variant in VARIANTS.items()
               if variant.algorithm not in registry.NO_REDUCE_SCATTER
               and name not in ("halving_doubling-short", "shm-lean")}
SG_VARIANTS["ring-tiny-segments"] = Variant("ring", segment_bytes=8)


def _run_all_four(algorithm, inputs, op, world_size, rank):
    """This rank's (public chunk, public list, flat bounds, flat chunk, flat gathered) for ``inputs``."""
    def run(comm):
        tensor = inputs[comm.rank].clone()
        chunk = gradsync.reduce_scatter(tensor, op=op, algorithm=algorithm, group=comm)
        assert_bitwise_equal(tensor, inputs[comm.rank], "input after reduce_scatter")
        parts = gradsync.all_gather(tensor, algorithm=algorithm, group=comm)
        flat = inputs[comm.rank].clone()
        bounds = reduce_scatter_flat(flat, comm, algorithm=algorithm)
        mine = flat[bounds[0]:bounds[1]].clone()
        gathered = torch.zeros_like(flat)
        gathered[bounds[0]:bounds[1]] = mine
        all_gather_flat(gathered, comm, algorithm=algorithm)
        return chunk, parts, bounds, mine, gathered
    return run


def _check_all_four(results, inputs, op, what):
    """Every rank's results against tensor_split of the closed form and the inputs, bitwise."""
    world_size, numel, dtype = len(inputs), inputs[0].numel(), inputs[0].dtype
    chunks = torch.tensor_split(closed_form_result(numel, world_size, dtype, op), world_size)
    total = closed_form_result(numel, world_size, dtype, "sum")
    sums = torch.tensor_split(total, world_size)
    for rank, (chunk, parts, bounds, mine, gathered) in enumerate(results):
        assert_bitwise_equal(chunk, chunks[rank], f"{what} rank {rank}: reduce_scatter")
        assert len(parts) == world_size, f"{what} rank {rank}: {len(parts)} parts"
        for source, part in enumerate(parts):
            assert_bitwise_equal(part, inputs[source], f"{what} rank {rank}: all_gather part {source}")
        assert bounds == chunk_bounds(numel, world_size)[rank], f"{what} rank {rank}: bounds {bounds}"
        assert_bitwise_equal(mine, sums[rank], f"{what} rank {rank}: reduce_scatter_flat")
        assert_bitwise_equal(gathered, total, f"{what} rank {rank}: all_gather_flat")


@given(world_variant=world_and_variant(table=SG_VARIANTS, max_world_size=5),
       numel=st.integers(min_value=0, max_value=3000), dtype_op=dtype_and_op())
def test_every_algorithm_reduce_scatters_and_all_gathers_exactly(world_variant, numel, dtype_op):
    """Every carrier and path, p 1..5, numel 0..3000, every dtype, sum/avg: the public pair and the
    in-place pair give tensor_split's chunk of the exact sum and every rank's tensor, bitwise."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    variant = SG_VARIANTS[name]
    numel = variant.numel(numel)
    inputs = [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
    results = run_variant(variant, world_size, _run_all_four(variant.algorithm, inputs, op, world_size, None),
                          **PROPERTY_RUN)
    _check_all_four(results, inputs, op, f"{name} p={world_size} {dtype} n={numel}")


@pytest.mark.parametrize("algorithm", CARRIERS)
def test_named_sizes_layouts_and_dtypes_on_one_group(algorithm):
    """Numel 0, 1, < p, odd and large; strided and 2-D inputs; bf16 and int16: on one group of 3 ranks
    (hierarchical: one node), every result exact."""
    world_size = 3
    cases = [(dtype, numel) for numel in (0, 1, 2, 7, 30_011) for dtype in (torch.float32,)]
    cases += [(torch.bfloat16, 11), (torch.int16, 5), (torch.float64, 4)]
    inputs = {case: [closed_form_input(case[1], rank, world_size, case[0]) for rank in range(world_size)]
              for case in cases}

    def rank_fn(comm):
        out = {case: _run_all_four(algorithm, inputs[case], "sum", world_size, comm.rank)(comm) for case in cases}
        base, view = strided_column_view(inputs[(torch.float32, 7)][comm.rank])
        out["strided"] = gradsync.reduce_scatter(view, algorithm=algorithm, group=comm), base
        grid = inputs[(torch.float32, 7)][comm.rank][:6].reshape(2, 3)
        out["2-D"] = gradsync.reduce_scatter(grid, algorithm=algorithm, group=comm), gradsync.all_gather(
            grid.t(), algorithm=algorithm, group=comm)
        return out

    results = run_threads(world_size, rank_fn)
    for case in cases:
        _check_all_four([out[case] for out in results], inputs[case], "sum", f"{algorithm} {case}")
    seven = closed_form_result(7, world_size, torch.float32, "sum")
    rows = [inputs[(torch.float32, 7)][rank][:6].reshape(2, 3) for rank in range(world_size)]
    for rank, out in enumerate(results):
        chunk, base = out["strided"]
        assert_bitwise_equal(chunk, torch.tensor_split(seven, world_size)[rank], f"strided rank {rank}")
        assert_bitwise_equal(base, strided_column_view(inputs[(torch.float32, 7)][rank])[0], "strided input")
        chunk, parts = out["2-D"]
        assert_bitwise_equal(chunk, torch.tensor_split(sum(rows).flatten(), world_size)[rank], f"2-D rank {rank}")
        for source, part in enumerate(parts):
            assert_bitwise_equal(part, rows[source].t(), f"2-D all_gather rank {rank} part {source}")


HOSTS = [(0, 0, 1), (0, 1, 0, 1, 1), (1, 0, 0, 1)]


@pytest.mark.parametrize("intra,inter", [("ring", "auto"), ("shm", "tree"), ("auto", "ring")])
@pytest.mark.parametrize("hosts", HOSTS, ids=lambda hosts: "hosts" + "".join(map(str, hosts)))
def test_hierarchical_on_unequal_interleaved_hosts(hosts, intra, inter):
    """Hosts of unequal sizes and interleaved ranks (lanes, extra ranks): exact chunks and gathers, for sum
    over numel 0, 1, 4 and 1001 (tree across runs a ring)."""
    world_size = len(hosts)
    numels = (0, 1, 4, 1001)
    inputs = {numel: [closed_form_input(numel, rank, world_size, torch.float32) for rank in range(world_size)]
              for numel in numels}

    def rank_fn(comm):
        comm = Communicator(comm.transport, 10.0, options=[HierarchicalOptions(intra_node_algorithm=intra,
                                                                               inter_node_algorithm=inter)])
        comm.locality = Locality(hosts)
        out = {numel: _run_all_four("hierarchical", inputs[numel], "sum", world_size, comm.rank)(comm)
               for numel in numels}
        comm.close()
        return out

    results = run_threads(world_size, rank_fn)
    for numel in numels:
        _check_all_four([out[numel] for out in results], inputs[numel], "sum", f"hosts {hosts} n={numel}")


def _random(world_size, numel, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(world_size)]


@pytest.mark.parametrize("world_size", [3, 4, 5, 6])
def test_ring_and_halving_doubling_chunks_are_their_all_reduce_bits(world_size):
    """Random float32 (sums round): ring's reduce-scatter chunk is bitwise its AllReduce's (the same hops),
    halving_doubling's its long path's (the same butterfly, folds included); close to the float64 sum."""
    numel = 1001
    inputs = _random(world_size, numel)
    reference = torch.stack([tensor.double() for tensor in inputs]).sum(0)

    def rank_fn(comm):
        out = {}
        for algorithm in ("ring", "halving_doubling"):
            chunk = gradsync.reduce_scatter(inputs[comm.rank].clone(), algorithm=algorithm, group=comm)
            whole = gradsync.all_reduce(inputs[comm.rank].clone(), algorithm=algorithm, group=comm)
            out[algorithm] = chunk, whole
        return out

    with selected_path(Variant("halving_doubling", short_message_bytes=0)):
        results = run_threads(world_size, rank_fn)
    for rank, out in enumerate(results):
        for algorithm, (chunk, whole) in out.items():
            assert_bitwise_equal(chunk, torch.tensor_split(whole, world_size)[rank], f"{algorithm} rank {rank}")
            torch.testing.assert_close(chunk.double(), torch.tensor_split(reference, world_size)[rank],
                                       rtol=1e-5, atol=1e-5)


def test_shm_arena_and_copy_paths_give_the_same_bits():
    """A buffer in the shared arena (zero copy) and one outside: the same reduce-scatter bits (random
    float32), and all-gathers that restore every chunk."""
    world_size, numel = 4, 4099
    inputs = _random(world_size, numel, seed=11)

    def rank_fn(comm):
        in_arena = collectives_api.shared_buffer(comm, 4 * numel, "shm").view(torch.float32)
        in_arena.copy_(inputs[comm.rank])
        outside = inputs[comm.rank].clone()
        a, b = reduce_scatter_flat(in_arena, comm, algorithm="shm")
        reduce_scatter_flat(outside, comm, algorithm="shm")
        mine = in_arena[a:b].clone()
        in_arena.zero_()
        in_arena[a:b] = mine
        all_gather_flat(in_arena, comm, algorithm="shm")
        outside.zero_()
        outside[a:b] = mine
        all_gather_flat(outside, comm, algorithm="shm")
        return mine, outside[a:b].clone(), in_arena.clone(), outside.clone()

    results = run_threads(world_size, rank_fn)
    gathered = torch.cat([mine for mine, _, _, _ in results])
    for rank, (mine, copied, in_arena, outside) in enumerate(results):
        assert_bitwise_equal(mine, copied, f"rank {rank}: arena vs copy-through chunk")
        assert_bitwise_equal(in_arena, gathered, f"rank {rank}: all_gather in the arena")
        assert_bitwise_equal(outside, gathered, f"rank {rank}: all_gather through the regions")


SHAPE_MISMATCHES = {
    "reduce_scatter-numel": (lambda odd: torch.ones(5 if odd else 4),
                             lambda tensor, comm, algorithm: gradsync.reduce_scatter(tensor, algorithm=algorithm,
                                                                                     group=comm)),
    "all_gather-dtype": (lambda odd: torch.ones(4, dtype=torch.float64 if odd else torch.float32),
                         lambda tensor, comm, algorithm: gradsync.all_gather(tensor, algorithm=algorithm,
                                                                             group=comm)),
}


@pytest.mark.parametrize("algorithm", CARRIERS)
def test_mismatched_shape_or_dtype_raises_on_every_rank(algorithm):
    """One rank's odd numel (reduce_scatter) or dtype (all_gather): CollectiveMismatchError on every rank,
    inputs untouched, and the next call works."""
    world_size, odd_rank = 3, 2

    def rank_fn(comm):
        out = {}
        for kind, (make, call) in SHAPE_MISMATCHES.items():
            tensor = make(comm.rank == odd_rank) * (comm.rank + 2)
            before = tensor.clone()
            exc, _ = capture(lambda: call(tensor, comm, algorithm))
            follow_up = gradsync.reduce_scatter(torch.full((6,), comm.rank + 1.0), algorithm=algorithm, group=comm)
            out[kind] = exc, tensor, before, follow_up
        return out

    for rank, out in enumerate(run_threads(world_size, rank_fn)):
        for kind, (exc, tensor, before, follow_up) in out.items():
            assert isinstance(exc, CollectiveMismatchError), f"rank {rank} {kind}: {exc!r}"
            assert_bitwise_equal(tensor, before, f"rank {rank} {kind}: input after the failed call")
            assert_bitwise_equal(follow_up, torch.full((2,), 6.0), f"rank {rank} {kind}: follow-up")


TREE_WORDS = {"tree": "algorithm 'tree' has no {what}: a tree reduces to one root; choose one of ring, halving_doubling",
              "double_binary_tree": "algorithm 'double_binary_tree' has no {what}: each tree reduces to one root; "
                                    "choose one of ring, halving_doubling"}


@pytest.mark.parametrize("tree", sorted(TREE_WORDS))
def test_tree_is_refused_on_every_rank_in_one_line(tree):
    """Every rank asking tree (or double_binary_tree): ValueError everywhere; one rank asking it: ValueError
    there and CollectiveMismatchError naming it elsewhere; the in-place pair: ValueError (even alone). The
    group stays usable."""
    world_size, odd_rank = 3, 1
    calls = {"reduce_scatter": lambda comm, name: gradsync.reduce_scatter(torch.ones(4), algorithm=name, group=comm),
             "all_gather": lambda comm, name: gradsync.all_gather(torch.ones(4), algorithm=name, group=comm)}

    def rank_fn(comm):
        out = {}
        for what, call in calls.items():
            out[what, "all"] = capture(lambda: call(comm, tree))[0]
            out[what, "one"] = capture(lambda: call(comm, tree if comm.rank == odd_rank else "ring"))[0]
        out["reduce_scatter", "flat"] = capture(lambda: reduce_scatter_flat(torch.ones(4), comm, algorithm=tree))[0]
        out["all_gather", "flat"] = capture(lambda: all_gather_flat(torch.ones(4), comm, algorithm=tree))[0]
        out["follow-up"] = gradsync.reduce_scatter(torch.ones(3), group=comm)
        return out

    for rank, out in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(out.pop("follow-up"), torch.full((1,), 3.0), f"rank {rank} follow-up")
        for (what, who), exc in out.items():
            expected = ValueError if who != "one" or rank == odd_rank else CollectiveMismatchError
            assert type(exc) is expected, f"rank {rank} {what} {who}: {exc!r}"
            assert TREE_WORDS[tree].format(what=what) in str(exc) and "\n" not in str(exc), f"rank {rank}: {exc}"
            if expected is CollectiveMismatchError:
                assert f"rank {odd_rank} rejected the call" in str(exc), str(exc)
    alone = Communicator(gradsync.ThreadWorld(1).transport(0))
    for call in (reduce_scatter_flat, all_gather_flat):
        with pytest.raises(ValueError, match="has no"):
            call(torch.ones(4), alone, algorithm=tree)


TIMEOUT_S = 0.3
SILENT_CASES = {"ring": Variant("ring"), "halving_doubling": Variant("halving_doubling"),
                "hierarchical-rpn1": Variant("hierarchical", ranks_per_node=1), "shm": Variant("shm"),
                "native": Variant("native")}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", sorted(SILENT_CASES))
def test_silent_rank_in_the_payload_is_named_within_the_timeout(name):
    """After one call together, the last of 3 ranks stays away: the in-place reduce_scatter (no layout
    check, so the silence is met in the algorithm's own exchanges) raises CollectiveTimeoutError naming a
    peer within timeout+2 s on every other rank, and some rank names the silent one."""
    variant, world_size = SILENT_CASES[name], 3
    silent = world_size - 1

    def rank_fn(comm):
        reduce_scatter_flat(torch.ones(301), comm, algorithm=variant.algorithm)
        if comm.rank == silent:
            return None, 0.0
        return capture(lambda: reduce_scatter_flat(torch.ones(301), comm, algorithm=variant.algorithm,
                                                   timeout=TIMEOUT_S))

    outcomes = run_variant(variant, world_size, rank_fn, timeout_s=TIMEOUT_S + 10)
    for rank, (exc, elapsed_s) in enumerate(outcomes[:silent]):
        assert isinstance(exc, CollectiveTimeoutError), f"rank {rank}: {exc!r}"
        assert elapsed_s <= TIMEOUT_S + 2, f"rank {rank} took {elapsed_s:.2f} s"
        assert exc.peer not in (rank, None) and f"peer rank {exc.peer}" in str(exc), str(exc)
    assert any(exc.peer == silent for exc, _ in outcomes[:silent]), [str(exc) for exc, _ in outcomes[:silent]]


def test_timeouts_and_bad_arguments_are_checked_before_any_data_moves():
    """A bad timeout or a bool tensor on one rank: its own error there, CollectiveMismatchError elsewhere,
    quickly (the layout check carries the rejection)."""
    world_size, bad = 3, 0

    def rank_fn(comm):
        is_bad = comm.rank == bad
        return (capture(lambda: gradsync.reduce_scatter(torch.ones(4), timeout=-1.0 if is_bad else None,
                                                        algorithm="halving_doubling", group=comm)),
                capture(lambda: gradsync.all_gather(torch.ones(4, dtype=torch.bool) if is_bad else torch.ones(4),
                                                    algorithm="shm", group=comm)))

    for rank, outcomes in enumerate(run_threads(world_size, rank_fn, collective_timeout_s=5)):
        for (exc, elapsed_s), bad_type in zip(outcomes, (ValueError, TypeError)):
            assert type(exc) is (bad_type if rank == bad else CollectiveMismatchError), f"rank {rank}: {exc!r}"
            assert elapsed_s < 2, f"rank {rank} waited {elapsed_s:.2f} s"


def test_halving_doubling_folds_hand_each_even_rank_its_own_chunk():
    """p = 6 (a core of 4; ranks 0 and 2 fold into 1 and 3): the payload bytes each rank sends are the
    scheme's, counted here: a folding rank sends its whole vector; core rank c (real rank 1, 3, 4, 5)
    sends the other half of the core's chunks at distance 2, its partner's chunk at distance 1, and a
    folded pair's odd rank its partner's own chunk back."""
    world_size, numel = 6, 602
    chunks = chunk_bounds(numel, world_size)

    def rank_fn(comm):
        before = comm.stats.bytes_sent
        reduce_scatter_flat(torch.ones(numel), comm, algorithm="halving_doubling")
        return comm.stats.bytes_sent - before

    sizes = [chunks[1][1] - chunks[0][0], chunks[3][1] - chunks[2][0]] + [b - a for a, b in chunks[4:]]
    halving = [sizes[2] + sizes[3], sizes[2] + sizes[3], sizes[0] + sizes[1], sizes[0] + sizes[1]]
    partner = [sizes[1], sizes[0], sizes[3], sizes[2]]
    unfold = [chunks[0][1] - chunks[0][0], chunks[2][1] - chunks[2][0], 0, 0]
    expected = [numel, 0, numel, 0, 0, 0]
    for core_rank, member in enumerate((1, 3, 4, 5)):
        expected[member] = halving[core_rank] + partner[core_rank] + unfold[core_rank]
    assert run_threads(world_size, rank_fn) == [4 * count for count in expected]


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_auto_picks_per_size_from_the_collectives_own_formulas(collective):
    """``auto`` resolves per size to what the cost model's formulas for that collective predict fastest,
    never tree; the call records the pick (``auto (name)``)."""
    from gradsync.collectives import auto
    from gradsync.collectives.validate import resolve_algorithm

    def rank_fn(comm):
        comm.learn_locality()
        picks = {nbytes: resolve_algorithm(comm, nbytes, "auto", collective=collective)
                 for nbytes in (64, 2**16, 2**22)}
        call = getattr(gradsync, collective)
        call(torch.ones(2**14), algorithm="auto", group=comm)
        return picks, gradsync.flight_records(comm)[-1]["algorithm"]

    for picks, label in run_threads(4, rank_fn):
        for nbytes, pick in picks.items():
            assert pick == auto.choose(nbytes, 4, 4, shm_available=True, collective=collective) != "tree"
        assert label.startswith("auto (") and "tree" not in label, label


def test_every_algorithm_carries_both_or_says_why_it_has_neither():
    """The registry as data: each AllReduce algorithm has a reduce-scatter and an all-gather, or a reason
    in NO_REDUCE_SCATTER (tree's), never both and never one of the pair alone."""
    from gradsync.collectives import registry

    carriers = set(registry.REDUCE_SCATTER)
    assert carriers == set(registry.ALL_GATHER)
    assert carriers | set(registry.NO_REDUCE_SCATTER) == set(registry.ALL_REDUCE)
    assert not carriers & set(registry.NO_REDUCE_SCATTER)
