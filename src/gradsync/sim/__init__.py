"""The simulator: gradsync's real AllReduce algorithms on a modelled cluster (DESIGN §1, §7).

* :func:`simulate_all_reduce` (:mod:`~gradsync.sim.engine`): the event
  simulation, the real algorithm modules on a virtual clock.
* :mod:`~gradsync.sim.formulas`: closed-form α-β-γ times of the same
  algorithms, for sizes and world sizes beyond the event simulation.
* :mod:`~gradsync.sim.profile`, :mod:`~gradsync.sim.profiles`: the hardware profiles.
* ``gradsync simulate train`` (:mod:`~gradsync.sim.training`): a data-parallel step, from
  :mod:`~gradsync.sim.compute` (6·P·T/(F·MFU), per-layer times; :mod:`~gradsync.sim.measure` times
  one here), :mod:`~gradsync.sim.step` (DataParallel's real buckets, the overlap with backward) and
  :mod:`~gradsync.sim.exchange` (each bucket's AllReduce or compressed two-phase exchange).

The names load on first use: ``collectives.auto`` imports the cost model
(profiles, formulas) from below the event engine, which itself runs the
collectives, so this package must not import the engine when it is imported.
"""

from importlib import import_module

_NAMES = {
    "SimulationDeadlock": "cluster", "Topology": "topology",
    "SIMULATED": "engine", "SimResult": "engine", "simulate_all_reduce": "engine",
    "Link": "profile", "Profile": "profile", "ShmModel": "profile",
    "PROFILE_NAMES": "profiles", "get_profile": "profiles",
    "predict_s": "formulas",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'gradsync.sim' has no attribute {name!r}")
    return getattr(import_module(f"gradsync.sim.{_NAMES[name]}"), name)
