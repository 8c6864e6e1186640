"""Training functions for the data tests: Hugging Face datasets read from local files, every rank
recording the sample ids it consumed. Like train_fn/, they import nothing from Ray."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from cluster.runtime import get_session
from train_fn.digits_stream import Position


def write_samples(folder: Path, n: int, shards: int = 1) -> list[Path]:
    """``n`` samples ``{"id": i, "x": [4 floats]}`` as ``shards`` parquet files (and one JSON lines file)."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict({"id": list(range(n)), "x": [[i / n, 1.0, -i / n, 0.5] for i in range(n)]})
    ds.to_json(str(folder / "samples.jsonl"))
    ds.save_to_disk(str(folder / "saved"))
    paths = []
    for k in range(shards):
        paths.append(folder / f"part-{k:05d}.parquet")
        ds.shard(num_shards=shards, index=k, contiguous=True).to_parquet(str(paths[-1]))
    return paths


def _dataset(config: dict):
    """The dataset a spec names: ``source`` is disk, parquet, jsonl or stream (parquet shards)."""
    import datasets

    data = config["data"]
    cache = os.path.join(config["out"], f"hf-cache-{os.environ.get('RANK', '0')}")
    source = config["source"]
    if source == "disk":
        ds = datasets.load_from_disk(os.path.join(data, "saved"))
    elif source in ("parquet", "jsonl"):
        files = sorted(glob.glob(os.path.join(data, "part-*.parquet"))) if source == "parquet" \
            else os.path.join(data, "samples.jsonl")
        ds = datasets.load_dataset("parquet" if source == "parquet" else "json", data_files=files,
                                   split="train", cache_dir=cache)
    else:  # stream: an IterableDataset over the shard files, never loaded whole
        files = sorted(glob.glob(os.path.join(data, "part-*.parquet")))
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return ds.with_format("torch")


def record_ids(config: dict) -> dict:
    """Train a linear model for ``epochs`` epochs; append every batch's ids to ``ids-rank<R>.jsonl``.

    Each line: ``{"attempt", "epoch", "step", "ids"}``. With ``fail_at``, rank 1 raises at that
    step in attempt 1; ``every`` steps a checkpoint; ``step_s`` seconds of sleep a step.
    """
    import time

    from torch.utils.data import DataLoader

    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    attempt = session.payload.attempt if session.payload else 0
    rank = accelerator.process_index
    (out / f"pid-rank{rank}-attempt{attempt}").write_text(str(os.getpid()))
    ds = _dataset(config)
    stream = config["source"] == "stream"
    workers = config.get("num_workers", 0)
    loader_kwargs = {"num_workers": workers, "persistent_workers": workers > 0 and config.get("persistent", True)}
    if not stream:  # a map-style dataset is shuffled by the sampler; a stream is read in order (its files
        loader_kwargs.update(shuffle=True, generator=torch.Generator().manual_seed(0))  # shuffled when written)
    dl = DataLoader(ds, batch_size=config["batch_size"], **loader_kwargs)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    position = Position()
    accelerator.register_for_checkpointing(position)
    restored = session.restore(accelerator)
    children = set()
    log = open(out / f"ids-rank{rank}.jsonl", "a")
    step = position.step
    for epoch in range(position.epoch, config["epochs"]):
        position.epoch = epoch
        dl.set_epoch(epoch)
        for batch in dl:
            if not children.issuperset(now := {p.pid for p in _children()}):
                children |= now  # the dataloader's workers, for the test to check that they end
                (out / f"children-rank{rank}-attempt{attempt}.json").write_text(json.dumps(sorted(children)))
            loss = model(batch["x"].float()).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            position.step = step
            log.write(json.dumps({"attempt": attempt, "epoch": epoch, "step": step,
                                  "ids": batch["id"].tolist()}) + "\n")
            log.flush()
            if config.get("every") and step % config["every"] == 0:
                session.save(accelerator, step)
            if step == config.get("fail_at") and attempt == 1 and rank == 1:
                raise RuntimeError(f"injected failure at step {step}")
            time.sleep(config.get("step_s", 0.0))
        position.epoch = epoch + 1  # a checkpoint after the last batch resumes in the next epoch
    log.close()
    return {"restored": restored, "steps": step, "world": accelerator.num_processes}


def _children():
    import psutil

    return psutil.Process().children(recursive=True)


def workers_as_under_torchrun(config: dict) -> dict:
    """A prepared DataLoader with a worker process and a collate function defined here (a closure: it cannot be
    pickled), as scripts write them: under ``accelerate launch`` its worker is forked and inherits it. Returns the
    rank's multiprocessing start method, the sum of what it trained on and what a SIGTERM does in the worker."""
    import multiprocessing
    import signal

    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator()
    scale = float(config.get("scale", 2.0))
    data = TensorDataset(torch.arange(16, dtype=torch.float32))
    mark = Path(config["out"]) / f"worker-sigterm-{accelerator.process_index}"

    def started(_: int) -> None:  # in the worker: what a SIGTERM does there (DataLoader's shutdown sends one)
        mark.write_text("default" if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else "the rank's")

    loader = accelerator.prepare(DataLoader(data, batch_size=4, num_workers=1, worker_init_fn=started,
                                            collate_fn=lambda rows: torch.stack([r[0] for r in rows]) * scale))
    seen = sum(float(batch.sum()) for batch in loader)
    return {"start_method": multiprocessing.get_start_method(), "seen": seen, "worker_sigterm": mark.read_text()}
