"""One replica group (one process) of ``bench modes``' torchft DiLoCo row: ``python -m gradsync.bench.torchft_diloco_worker``.

Started by :mod:`gradsync.bench.torchft_diloco`. Trains what gradsync's
``--mode local-sgd`` rank ``--replica`` of ``--nproc`` trains (the same
seeded model, the same per-rank samples in the same order, AdamW and its
cosine schedule from gradsync's ``TrainConfig``, a straggler's sleep) with
torchft's own pieces: a ``Manager`` (synchronous quorum through the
Lighthouse, every replica in every quorum), ``ProcessGroupGloo``
(torchft's CPU recommendation) and ``torchft.local_sgd.DiLoCo`` (the
whole model one fragment, outer ``SGD(nesterov=True)``), which AllReduces the
pseudo-gradients through ``Manager.allreduce`` every ``--sync-every`` steps.

Before the first step every replica joins one quorum and AllReduces a
4-byte tensor (a start barrier, not counted); after the last step one
more of torchft's own rounds (``prepare_sync`` / ``perform_sync``) takes
the steps since the last sync, as gradsync's DiLoCo ends with one outer
round. Writes ``--result`` (JSON): ``train_s`` (first step to last, wall),
``steps``, ``samples`` (this replica's), ``allreduce_nbytes`` (bytes of the
tensors it handed to ``Manager.allreduce``, the barrier's excluded),
``allreduces``, ``commits`` and, on replica 0, ``test_accuracy`` and
``test_loss`` of its final parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch

import torchft.manager as ft_manager
from torchft.checkpointing.pg_transport import PGTransport
from torchft.local_sgd import DiLoCo
from torchft.process_group import ProcessGroupGloo

from gradsync.bench.torchft_worker import loopback_manager_server, replica_state
from gradsync.launch import die_with_launcher
from gradsync.rendezvous import gloo_on_loopback, loopback_store_server
from gradsync.train.config import TrainConfig
from gradsync.train.data import load
from gradsync.train.forward_backward import epoch_micro_batches
from gradsync.train.position import StepPlan
from gradsync.train.setup import (make_optimizer, make_scheduler, seed_everything, straggle, straggler_factor,
                                  threads_per_worker)
from gradsync.train.task import make_model, position_counts, sample_loss


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--config", required=True, help="gradsync TrainConfig fields, JSON")
    parser.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--data", required=True, help="the .npz of gradsync.train.data.prepare")
    parser.add_argument("--timeout", type=float, default=60.0, help="Manager/Gloo timeout, s")
    parser.add_argument("--result", required=True)
    return parser.parse_args(argv)


class CountingManager:
    """Counts the bytes of every tensor handed to ``Manager.allreduce`` (the pseudo-gradients)."""

    def __init__(self, manager):
        self.manager, self.nbytes, self.calls = manager, 0, 0
        self._allreduce = manager.allreduce
        manager.allreduce = self.allreduce

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs):
        self.nbytes += tensor.numel() * tensor.element_size()
        self.calls += 1
        return self._allreduce(tensor, *args, **kwargs)


def build_manager(args, config: TrainConfig, model, optimizer, nproc: int):
    """The replica group's Manager (synchronous quorum, all ``nproc`` replicas) and its store."""
    timeout = timedelta(seconds=args.timeout)
    store = loopback_store_server("127.0.0.1", 0, None, timeout, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timeout)

    state_dict, load_state_dict = replica_state(model, optimizer)
    ft_manager.ManagerServer = loopback_manager_server()
    manager = ft_manager.Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=nproc,
        use_async_quorum=False, init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}", hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")))
    return manager, store


def train(args: argparse.Namespace) -> dict:
    config = TrainConfig(**json.loads(args.config))
    nproc, rank = config.nproc, args.replica
    gloo_on_loopback("127.0.0.1")
    torch.set_num_threads(threads_per_worker(nproc))
    data = load(Path(args.data))
    plan = StepPlan(len(data.y_train), nproc, config.epochs, config.batch_size, config.accumulate, None)
    seed_everything(config.seed)  # as gradsync's trainer: the same initial model in every replica
    model = make_model(config)
    optimizer = make_optimizer(model.parameters(), config)
    scheduler = make_scheduler(optimizer, config, plan.steps_per_epoch * config.epochs)
    outer = torch.optim.SGD(model.parameters(), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True)
    manager, store = build_manager(args, config, model, optimizer, nproc)
    manager.start_quorum()  # the start barrier: every replica in the first quorum
    manager.allreduce(torch.zeros(1)).wait()
    manager.should_commit()
    counter = CountingManager(manager)
    factor = straggler_factor(config, rank)
    steps = 0
    with DiLoCo(manager, [model], optimizer, outer, sync_every=config.sync_every, backup_device=torch.device("cpu"),
                pin_memory=False) as diloco:
        started = time.perf_counter()
        for epoch in range(config.epochs):
            model.train()
            for micro_batches in epoch_micro_batches(config, len(data.y_train), None, epoch, 0, rank, nproc):
                compute_started = time.perf_counter()
                for indices in micro_batches:
                    loss = sample_loss(model(data.x_train[indices]), data.y_train[indices]) / len(micro_batches)
                    loss.backward()
                straggle(factor, time.perf_counter() - compute_started)
                optimizer.step()  # DiLoCo's hook: every sync_every steps, quorum, AllReduce, outer step
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                steps += 1
        train_s = time.perf_counter() - started
        final_round(diloco, manager)
    result = {"replica": rank, "steps": steps, "samples": steps * config.batch_size * config.accumulate,
              "train_s": train_s, "allreduce_nbytes": counter.nbytes, "allreduces": counter.calls,
              "commits": manager.current_step()}
    if rank == 0:
        result.update(score(model, data))
    manager.shutdown(wait=False)
    del store
    return result


def final_round(diloco: DiLoCo, manager) -> None:
    """torchft's own round of every fragment over the steps since its last sync (none if there were none)."""
    if diloco._local_step == 0:
        return
    manager.start_quorum()
    for fragment in diloco._fragments:
        fragment.prepare_sync()
        fragment.perform_sync()
    diloco._local_step = 0


@torch.no_grad()
def score(model: torch.nn.Module, data) -> dict:
    """Test accuracy and mean loss of ``model`` per position on the whole test split (as gradsync's evaluation)."""
    model.eval()
    loss_sum, correct, positions = position_counts(model(data.x_test), data.y_test)
    return {"test_accuracy": correct / positions, "test_loss": loss_sum / positions}


def main(argv=None) -> None:
    die_with_launcher()
    args = parse_args(argv)
    result = train(args)
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
