"""gradsync's layers, top to bottom, as data: the import-direction test and ``make architecture`` read this.

Each row is one line of the drawing in docs/architecture.md: a title, its
units (a subpackage or a top-level module of ``gradsync``) and what the row
holds. A module may import its own package (any package that contains it,
but the root ``gradsync``, which has a row of its own) and any unit below its own: a lower row, or
further right in its own row (``api``, ``forkserver_preload``, ``launch``,
``process_group``, ``rendezvous`` are one row, each above the next).
"""

from __future__ import annotations

ROWS = (
    ("__main__.py", ("__main__",), "``python -m gradsync``"),
    ("cli.py", ("cli",), "gradsync train | bench | simulate | explain | calibrate | debug (argparse only, no logic)"),
    ("bench/", ("bench",), "benchmarks that print tables and write JSON; the simulate, explain and reproduce "
     "commands and their reports"),
    ("sim/", ("sim",), "the event engine: the same algorithm code on a virtual clock over a modelled cluster; "
     "a training step's prediction (see docs/simulator.md)"),
    ("integrations/", ("integrations",), "Lightning strategy, Ray Train, TensorBoard (optional extras)"),
    ("jobs/", ("jobs",), "how a job starts: the option rules, then {local, torchrun, test hosts} x "
     "{static, elastic} -> launcher, and the one worker entry"),
    ("train/", ("train",), "the one Trainer (it asks a membership at step boundaries) and the parameter "
     "server's loop, TrainState, the task (MNIST-1D or the gpt's corpus), models, config and its validation, "
     "metrics, plots, resume"),
    ("elastic/", ("elastic",), "membership: quorum, member, launcher, service, run store, the membership "
     "the Trainer asks, hand-over, checkpoints, samples, fault points, the parameter server's elastic parts "
     "(see docs/elastic.md)"),
    ("__init__.py", ("__init__",), "``import gradsync``: the library's public names, for the application "
     "above and for users"),
    ("parallel/", ("parallel",), "bucketing, the reducer (hooks, overlap), DataParallel and its sharding, "
     "ParameterServer, LocalSGD"),
    ("optim/", ("optim",), "LARS and LAMB: torch optimizers whose trust ratios take whole-parameter norms "
     "(the sharded and exact norms come from parallel/)"),
    ("api.py, launch.py", ("api", "forkserver_preload", "launch", "process_group", "slurm", "rendezvous"),
     "left to right: api (the public calls over the default group), forkserver_preload, launch (workers "
     "through torch's elastic agent), process_group (group set-up), slurm (srun's variables), "
     "rendezvous (the store)"),
    ("compression/", ("compression",), "one compressor per module; error feedback; the two-phase exchange"),
    ("fault/", ("fault",), "checkpoints (atomic, checksummed), hang detection, fault injection, events"),
    ("collectives/", ("collectives",), "all_reduce / reduce_scatter / all_gather / broadcast / all_to_all; one "
     "algorithm per module; the registry; cost/ (formulas, profiles, topology) that auto decides from"),
    ("transport/", ("transport",), "the Transport protocol (isend / irecv -> handle, handle.wait(timeout_s)); "
     "torch_p2p, thread, sub, shm_segment, locality"),
    ("hosts/, debug/", ("hosts", "debug"), "test hosts in network namespaces; the flight recorder and its reader"),
    ("errors.py", ("errors",), "GradsyncError and its subclasses"),
)

PACKAGE = "gradsync"


def unit_of(module: str) -> str:
    """``gradsync.sim.engine`` -> ``sim``; ``gradsync`` (the package's ``__init__``) -> ``__init__``."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        raise ValueError(f"{module!r} is not a module of {PACKAGE}")
    return parts[1] if len(parts) > 1 else "__init__"


RANKS = {unit: (row, column) for row, (_, units, _) in enumerate(ROWS) for column, unit in enumerate(units)}


def rank_of(module: str) -> tuple[int, int]:
    """(row, column) of the module's unit: smaller is higher.

    Raises:
        KeyError: the module's unit is in no row (add it to ``ROWS``).
    """
    unit = unit_of(module)
    if unit not in RANKS:
        raise KeyError(f"{module}: its unit {unit!r} is in no row of tools/layers.py")
    return RANKS[unit]


def may_import(importer: str, imported: str) -> bool:
    """Whether ``importer`` may import ``imported``: a package containing it (not the root), or a unit below
    its own."""
    if imported != PACKAGE and importer.startswith(imported + "."):
        return True
    if unit_of(importer) == unit_of(imported) and unit_of(importer) != "__init__":
        return True
    return rank_of(importer) < rank_of(imported)
