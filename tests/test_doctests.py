"""The examples in the pure modules' docstrings run and are right."""

import doctest

import pytest

import gradsync
from gradsync.bench import allreduce as bench_allreduce
from gradsync.bench import allreduce_options, auto_rows, sweep_collectives
from gradsync.bench import output as bench_output
from gradsync.collectives import auto, chunking, communicator
from gradsync.collectives.cost import topology as cost_topology
from gradsync.parallel import bucketing, debug_checks, debug_findings, exact_sum, local_sgd, micro_shards, staleness
from gradsync.parallel import diloco, fragments, outer_optimizer, ps_ledger
from gradsync.sim import engine as sim_engine
from gradsync.sim import virtual as sim_virtual
from gradsync.train import global_batch, position
from gradsync.transport import locality, sub, thread


@pytest.mark.parametrize("module", [gradsync, auto, bench_allreduce, allreduce_options, auto_rows, sweep_collectives,
                                    bench_output, chunking, communicator, bucketing,
                                    debug_checks, debug_findings, exact_sum, global_batch, local_sgd, micro_shards, ps_ledger,
                                    diloco, fragments, outer_optimizer,
                                    staleness, position, locality, sub, thread, sim_engine, cost_topology, sim_virtual],
                         ids=lambda m: m.__name__)
def test_doctests_pass(module):
    """Every >>> example in the module gives the output it shows."""
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0
