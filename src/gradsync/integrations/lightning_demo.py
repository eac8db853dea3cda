"""A small seeded LightningModule fit with GradsyncStrategy or Lightning's DDPStrategy: the tests' and a bench's run.

``python -m gradsync.integrations.lightning_demo --strategy gradsync,ddp --devices 2 --epochs 3 --out DIR``
fits a 2-layer MLP (regression, MSE) on fixed random data once per strategy named, in turn, in the same
processes (Lightning's subprocess launcher starts them for the first fit; later fits reuse the group), and rank
0 writes ``DIR/<strategy>.pt``: ``{"state": the module's state_dict, "global_step", "seconds" (the fit's
wall time), "bucket_collectives" (gradsync: the DataParallel bucket collectives this rank issued during the
fit, from ``gradsync.flight_records()``), "samples"}``. ``--steps N`` stops after N optimizer steps (a bench
times a fixed number of steps with either strategy). ``--package pytorch_lightning`` uses the separate package;
``--fabric`` fits the same network through Lightning Fabric (:func:`fabric_fit`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

FEATURES, HIDDEN, OUTPUTS = 16, 32, 4
_CLASSES: dict[str, type] = {}


def dataset(samples: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``samples`` fixed random inputs (float32, ``[samples, 16]``) and targets (``[samples, 4]``) of a noisy
    linear map; the same on every rank for a seed."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    weight = torch.randn(FEATURES, OUTPUTS, generator=generator)
    targets = inputs @ weight + 0.1 * torch.randn(samples, OUTPUTS, generator=generator)
    return torch.utils.data.TensorDataset(inputs, targets)


def module_class(package: str = "lightning") -> type:
    """The demo LightningModule class over ``lightning.pytorch`` ("lightning") or ``pytorch_lightning``."""
    if package not in _CLASSES:
        if package == "lightning":
            import lightning.pytorch as pl
        elif package == "pytorch_lightning":
            import pytorch_lightning as pl
        else:
            raise ValueError(f"unknown package {package!r}; choose lightning or pytorch_lightning")

        class DemoModule(pl.LightningModule):
            """MLP 16 -> 32 -> 4 (tanh), MSE loss; SGD with momentum or Adam."""

            def __init__(self, seed: int = 0, optimizer: str = "sgd", lr: float = 0.05, manual: bool = False):
                super().__init__()
                torch.manual_seed(seed)
                self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                               torch.nn.Linear(HIDDEN, OUTPUTS))
                self.optimizer_name, self.lr = optimizer, lr
                self.automatic_optimization = not manual

            def forward(self, inputs):
                return self.net(inputs)

            def training_step(self, batch, batch_idx):
                inputs, targets = batch
                loss = torch.nn.functional.mse_loss(self(inputs), targets)
                if self.automatic_optimization:
                    return loss
                optimizer = self.optimizers()  # manual optimization: backward and step here
                self.manual_backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                return loss.detach()

            def validation_step(self, batch, batch_idx):
                inputs, targets = batch
                self.log("val_loss", torch.nn.functional.mse_loss(self(inputs), targets), sync_dist=True)

            def configure_optimizers(self):
                if self.optimizer_name == "adam":
                    return torch.optim.Adam(self.parameters(), lr=self.lr / 10)
                return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

        name = f"DemoModule_{package}"
        DemoModule.__name__ = DemoModule.__qualname__ = name
        globals()[name] = DemoModule  # picklable by name (the spawn launcher pickles the module)
        _CLASSES[package] = DemoModule
    return _CLASSES[package]


def __getattr__(name: str):  # a spawned child unpickling DemoModule_<package> builds the class first
    for package in ("lightning", "pytorch_lightning"):
        if name == f"DemoModule_{package}":
            return module_class(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_strategy(name: str, args, package: str):
    """``"gradsync"`` (GradsyncStrategy with ``args``' options) or ``"ddp"`` (Lightning's DDPStrategy)."""
    if name == "ddp":
        strategies = __import__("lightning.pytorch" if package == "lightning" else "pytorch_lightning",
                                fromlist=["strategies"]).strategies
        return strategies.DDPStrategy(start_method=args.start_method)
    if package == "lightning":
        from gradsync.integrations.lightning import GradsyncStrategy
    else:
        from gradsync.integrations.pytorch_lightning import GradsyncStrategy
    return GradsyncStrategy(algorithm=args.algorithm, compression=args.compression, bucket_cap_mb=args.bucket_cap_mb,
                            shard=args.shard, start_method=args.start_method)


def fit(name: str, args, out: Path) -> None:
    """One fit with strategy ``name``; rank 0 writes ``out/<name>.pt`` (see the module's docstring)."""
    pl = __import__("lightning.pytorch" if args.package == "lightning" else "pytorch_lightning",
                    fromlist=["Trainer"])
    model = module_class(args.package)(seed=args.seed, optimizer=args.optimizer, manual=args.manual)
    loader = torch.utils.data.DataLoader(dataset(args.samples), batch_size=args.batch_size, shuffle=False)
    callbacks = []
    if args.checkpoint_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0))
    logger = pl.loggers.CSVLogger(args.csv_dir, name=name) if args.csv_dir else False
    trainer = pl.Trainer(strategy=make_strategy(name, args, args.package), accelerator="cpu", devices=args.devices,
                         max_epochs=args.epochs, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=args.clip, logger=logger, callbacks=callbacks,
                         enable_checkpointing=bool(args.checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=2 if args.validate else 0,
                         log_every_n_steps=1)
    first = _bucket_seq()
    started = time.perf_counter()
    validation = torch.utils.data.DataLoader(dataset(args.samples // 2, seed=1), batch_size=args.batch_size) \
        if args.validate else None
    trainer.fit(model, loader, validation, ckpt_path=args.resume)
    seconds = time.perf_counter() - started
    if trainer.global_rank == 0:
        result = {"state": {key: value.clone() for key, value in model.state_dict().items()},
                  "global_step": trainer.global_step, "seconds": seconds, "samples": args.samples,
                  "bucket_collectives": _bucket_count(first) if name == "gradsync" else None}
        torch.save(result, out / f"{name}.pt")


def fabric_fit(name: str, args, out: Path) -> None:
    """The same fit through Lightning Fabric (``--fabric``): ``fabric.setup``, ``no_backward_sync`` for the
    accumulated micro-batches, ``clip_gradients``, and ``fabric.save`` / ``fabric.load`` for ``--checkpoint-dir``
    (saved after every epoch as ``last.ckpt``) and ``--resume``; rank 0 writes ``out/<name>.pt``."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    if name == "ddp":
        strategy = DDPStrategy(start_method=args.start_method)
    else:
        from gradsync.integrations.fabric import GradsyncStrategy
        strategy = GradsyncStrategy(algorithm=args.algorithm, compression=args.compression,
                                    bucket_cap_mb=args.bucket_cap_mb, shard=args.shard, start_method=args.start_method)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=args.devices)
    fabric.launch()
    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS))
    optimizer = (torch.optim.Adam(net.parameters(), lr=0.005) if args.optimizer == "adam"
                 else torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    model, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(args.samples), batch_size=args.batch_size))
    state = {"model": model, "optimizer": optimizer, "epoch": 0, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    first = _bucket_seq()
    started = time.perf_counter()
    for epoch in range(state["epoch"], args.epochs):
        for index, (inputs, targets) in enumerate(loader):
            last = (index + 1) % args.accumulate == 0
            with fabric.no_backward_sync(model, enabled=not last):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                fabric.backward(loss / args.accumulate)
            if last:
                if args.clip:
                    fabric.clip_gradients(model, optimizer, max_norm=args.clip)
                optimizer.step()
                optimizer.zero_grad()
                state["step"] += 1
        state["epoch"] = epoch + 1
        if args.checkpoint_dir:
            fabric.save(Path(args.checkpoint_dir) / "last.ckpt", state)
    seconds = time.perf_counter() - started
    if name == "gradsync":
        strategy.gradsync_model.wait_for_parameters()  # a sharded step's all-gather
    if fabric.global_rank == 0:
        result = {"state": {"net." + key: value.detach().clone() for key, value in net.state_dict().items()},
                  "global_step": state["step"], "seconds": seconds, "samples": args.samples,
                  "bucket_collectives": _bucket_count(first) if name == "gradsync" else None}
        torch.save(result, out / f"{name}.pt")


def _bucket_seq() -> int:
    """The sequence number of gradsync's last collective so far (-1: none, or gradsync not initialised)."""
    import gradsync

    if not gradsync.is_initialized():
        return -1
    records = gradsync.flight_records()
    return records[-1]["seq"] if records else -1


def _bucket_count(after: int) -> int | None:
    """How many DataParallel bucket collectives this rank issued after sequence number ``after``."""
    import gradsync

    if not gradsync.is_initialized():  # the spawn launcher's main process: its children fit
        return None
    return sum(1 for record in gradsync.flight_records()
               if record["seq"] > after and str(record.get("label") or "").startswith("bucket"))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gradsync.integrations.lightning_demo", description=__doc__)
    parser.add_argument("--strategy", default="gradsync,ddp", help="comma-separated: gradsync, ddp (fit in turn)")
    parser.add_argument("--package", default="lightning", choices=("lightning", "pytorch_lightning"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=-1, help="stop after this many optimizer steps (-1: epochs)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--compression", default=None)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--shard", default="none")
    parser.add_argument("--start-method", default="popen")
    parser.add_argument("--checkpoint-dir", default=None, help="ModelCheckpoint(save_last=True) here")
    parser.add_argument("--resume", default=None, help="Trainer.fit(ckpt_path=...)")
    parser.add_argument("--csv-dir", default=None, help="a CSVLogger here")
    parser.add_argument("--manual", action="store_true", help="the Trainer with manual optimization")
    parser.add_argument("--validate", action="store_true", help="a validation loop each epoch (val_loss, sync_dist)")
    parser.add_argument("--fabric", action="store_true", help="fit through Lightning Fabric instead of the Trainer")
    parser.add_argument("--out", required=True, help="rank 0 writes <strategy>.pt here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.strategy.split(","):
        if name not in ("gradsync", "ddp"):
            print(f"unknown strategy {name!r}; choose gradsync, ddp", file=sys.stderr)
            return 2
        (fabric_fit if args.fabric else fit)(name, args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
