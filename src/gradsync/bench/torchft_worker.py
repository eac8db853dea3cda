"""One torchft replica group (one process) of the torchft peer row: ``python -m gradsync.bench.torchft_worker``.

Started (and restarted after each kill) by :mod:`gradsync.bench.torchft_peer`.
The process trains gradsync's MNIST-1D model with torchft's own fault-tolerant
pieces: a ``Manager`` (quorum through the Lighthouse), ``ProcessGroupGloo``
(reconfigured at each new quorum), torchft's ``DistributedDataParallel`` (its
comm hook AllReduces each bucket through ``Manager.allreduce``, averaged over
the quorum's participants), ``OptimizerWrapper`` (quorum at ``zero_grad``,
``should_commit`` before the step) and ``PGTransport`` (a joiner receives
parameters and Adam state from a live peer over the process group).

Data: step ``s`` (the Manager's committed step count, which a healed joiner
takes from its peer) trains on global batch ``s`` of gradsync's
``--global-batch-size`` order (:mod:`gradsync.train.global_batch`). ``split``
``fixed`` is torchft's ``DistributedSampler`` rule: replica ``i`` always
takes piece ``i`` of ``nproc``, so a missing or healing replica's piece is not
trained that step; ``quorum`` waits for the step's quorum first and takes piece
``participating_rank`` of ``num_participants``.

Every attempted step appends one JSON line to ``--log`` (wall-clock
``time.time()`` seconds): ``step`` (before the attempt), ``committed``,
``participants``, ``participating``, ``errored``, ``quorum_id``, ``piece``,
``pieces``, ``t_start``, ``t_backward`` (the AllReduce returned or failed),
``t_end``, and after a commit ``params_hash`` (of the parameters' bytes). At
``--stop-file``'s step the replica writes ``--final`` (its parameters) and
exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

import torchft.manager as ft_manager
from torchft import _torchft
from torchft.checkpointing.pg_transport import PGTransport
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from gradsync.bench.torchft_metrics import Batches
from gradsync.launch import die_with_launcher
from gradsync.rendezvous import gloo_on_loopback, loopback_store_server
from gradsync.train.config import TrainConfig
from gradsync.train.data import load
from gradsync.train.global_batch import split_contiguous
from gradsync.train.models import build_model
from gradsync.train.setup import make_optimizer, seed_everything


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--data", required=True, help="the .npz of gradsync.train.data.prepare")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("fixed", "quorum"), default="fixed")
    parser.add_argument("--timeout", type=float, default=10.0, help="Manager/Gloo timeout, s")
    parser.add_argument("--quorum-timeout", type=float, default=30.0)
    parser.add_argument("--heartbeat-ms", type=int, default=100)
    parser.add_argument("--log", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--final", required=True)
    return parser.parse_args(argv)


def replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """``(state_dict, load_state_dict)`` callbacks a torchft ``Manager`` heals a replica with: the model's and
    the optimizer's state together."""

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    return state_dict, load_state_dict


def loopback_manager_server():
    """torchft 0.2.0's Manager binds its ManagerServer to ``[::]:port``; this factory binds loopback instead."""
    def factory(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[1]
        return _torchft.ManagerServer(**{**kwargs, "bind": f"127.0.0.1:{port}"})

    return factory


def ft_ddp_class():
    """torchft's DistributedDataParallel with a comm hook that survives a failed AllReduce.

    torchft 0.2.0's hook asserts ``fut._fut`` after ``work.wait()``; when the
    AllReduce fails (a peer was killed) ``_ManagedWork.wait`` reports the error
    to the Manager and returns False before it sets ``_fut``, so the assertion
    kills the survivor too. Here the bucket is returned unreduced instead: the
    Manager has the error, so ``should_commit`` is False and the step is retried.
    """
    class SurvivingDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            inner = getattr(future, "_fut", future)  # a _DummyWork's future is already a done Future
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    return SurvivingDDP


def build(args: argparse.Namespace):
    """The replica: (manager, ddp model, wrapped optimizer, plain model, store) (torchft objects)."""
    torch.set_num_threads(1)
    seed_everything(args.seed)  # the same initial parameters in every replica (init_sync also heals step 0)
    model = build_model(args.model)
    config = TrainConfig(model=args.model, optimizer=args.optimizer, lr=args.lr)
    optimizer = make_optimizer(model.parameters(), config)
    timeout = timedelta(seconds=args.timeout)
    store = loopback_store_server("127.0.0.1", 0, None, timeout, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))

    state_dict, load_state_dict = replica_state(model, optimizer)
    ft_manager.ManagerServer = loopback_manager_server()
    manager = ft_manager.Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        use_async_quorum=args.split == "fixed", timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout), connect_timeout=timeout, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}", hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=args.heartbeat_ms), checkpoint_transport=transport)
    ddp = ft_ddp_class()(manager, model)
    return manager, ddp, OptimizerWrapper(manager, optimizer), model, store


def read_stop(path: str) -> int | None:
    try:
        return int(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def train(args: argparse.Namespace) -> None:
    gloo_on_loopback("127.0.0.1")
    data = load(Path(args.data))
    batches = Batches(len(data.y_train), args.global_batch_size, args.seed)
    manager, ddp, optimizer, model, store = build(args)
    with open(args.log, "a", buffering=1) as log:
        log.write(json.dumps({"event": "started", "replica": args.replica, "pid": os.getpid(),
                              "time": time.time()}) + "\n")
        while True:
            stop = read_stop(args.stop_file)
            if stop is not None and manager.current_step() >= stop:
                break
            log.write(json.dumps(attempt_step(args, manager, ddp, optimizer, data, batches)) + "\n")
    torch.save({"step": manager.current_step(), "pid": os.getpid(), "model": model.state_dict()}, args.final)
    manager.shutdown(wait=False)
    del store


def attempt_step(args, manager, ddp, optimizer, data, batches) -> dict:
    """One try at a step: quorum, forward/backward on this replica's piece, AllReduce, should_commit."""
    t_start = time.time()
    optimizer.zero_grad()  # starts the quorum (async with split "fixed")
    if args.split == "quorum":
        rank = manager.participating_rank()  # waits for the quorum (and heals a joiner first)
        piece, pieces = (rank if rank is not None else 0), max(manager.num_participants(), 1)
    else:
        piece, pieces = args.replica, args.nproc
    step = manager.current_step()
    indices = split_contiguous(batches(step), pieces)[piece]
    loss = F.cross_entropy(ddp(data.x_train[indices]), data.y_train[indices])
    loss.backward()  # torchft's comm hook: Manager.allreduce per bucket
    t_backward = time.time()
    step = manager.current_step()  # a healed joiner took its peer's step in the quorum
    record = {"replica": args.replica, "step": step, "participants": manager.num_participants(),
              "participating": manager.is_participating(), "errored": manager.errored() is not None,
              "quorum_id": manager._quorum_id, "piece": piece, "pieces": pieces, "loss": loss.item(),
              "t_start": t_start, "t_backward": t_backward}
    optimizer.step()  # should_commit (this replica group alone: no error, enough participants), then Adam
    record["committed"] = manager.current_step() == step + 1
    if record["committed"]:
        record["params_hash"] = params_hash(ddp.module)
    record["t_end"] = time.time()
    return record


def params_hash(model: torch.nn.Module) -> str:
    """A digest of the parameters' bytes (equal digests: bitwise-equal replicas, but for a 2**-64 chance)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.blake2b(flat.numpy().tobytes(), digest_size=8).hexdigest()


def main(argv=None) -> None:
    train(parse_args(argv))


def serve(argv: list[str], output: str) -> None:
    """Entry of a replica forked from the launcher's forkserver: output to ``output``, dies with the launcher."""
    die_with_launcher()
    with open(output, "a") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    main(argv)


if __name__ == "__main__":
    main()
