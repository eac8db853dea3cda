"""The simulator: gradsync's real AllReduce algorithms on a virtual clock over a modelled cluster (docs/simulator.md).

* :func:`simulate_all_reduce` (:mod:`~gradsync.sim.engine`): the event
  simulation, the real algorithm modules on a virtual clock.
* The cost model it prices messages with lives beside the algorithms, in
  :mod:`gradsync.collectives.cost` (formulas, profiles, topology), where
  ``auto`` decides from it; its names are exported here too.
* :mod:`~gradsync.sim.training`: a data-parallel step, from
  :mod:`~gradsync.sim.compute` (6·P·T/(F·MFU), per-layer times; :mod:`~gradsync.sim.measure` times
  one here), :mod:`~gradsync.sim.step` (DataParallel's real buckets, the overlap with backward) and
  :mod:`~gradsync.sim.exchange` (each bucket's AllReduce or compressed two-phase exchange).

The commands and their reports (``gradsync simulate``, ``explain``,
``--reproduce``) are in :mod:`gradsync.bench`.
"""

from gradsync.collectives.cost.formulas import predict_s
from gradsync.collectives.cost.profile import Link, Profile, ShmModel
from gradsync.collectives.cost.profiles import PROFILE_NAMES, get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.sim.cluster import SimulationDeadlock
from gradsync.sim.engine import SIMULATED, SimResult, simulate_all_reduce

__all__ = ["Link", "PROFILE_NAMES", "Profile", "SIMULATED", "ShmModel", "SimResult", "SimulationDeadlock",
           "Topology", "get_profile", "predict_s", "simulate_all_reduce"]
