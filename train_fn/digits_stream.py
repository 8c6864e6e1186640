"""The digits BERT again, trained from a stream of parquet shard files that is never loaded whole.

What changes from ``train_fn/digits.py`` is the data: the training images are written once as
``shards`` parquet files of equal size (shuffled when written: a stream is read in order), and read
with Hugging Face ``datasets`` in streaming mode, an ``IterableDataset``. The job's spec
(``jobs/examples/digits-stream.yaml``) sets ``dispatch_batches: false`` so that ``prepare``
gives each rank its own shard files (shards >= ranks), and ``use_stateful_dataloader: true`` so
that every checkpoint holds each rank's position in its files: a run killed mid-epoch resumes
the stream where it stopped, no sample repeated or skipped.

Equal shards matter: each rank runs as many steps as its files hold batches, and DDP needs every
rank to run the same number (a rank with one batch more would wait in its all-reduce forever).

Runs under the runner, under ``accelerate launch`` and under ``python -m train_fn.digits_stream``.
It imports nothing from Ray.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from cluster.runtime import get_session
from train_fn.digits import DEFAULTS as DIGITS, build_model, evaluate, load_data, weights_digest

DEFAULTS = {
    **DIGITS,
    "epochs": 20,
    "data_dir": os.path.join(tempfile.gettempdir(), "raylaunch-data", "digits-parquet"),
    "shards": 8,  # files; at least the number of ranks, and a multiple of it
    "checkpoint_every": 50,
}


def write_shards(folder: str, shards: int, train_samples: int | None) -> list[str]:
    """The training images as ``shards`` parquet files of equal size, once (a second call reads the folder)."""
    import datasets

    paths = [os.path.join(folder, f"train-{k:05d}-of-{shards:05d}.parquet") for k in range(shards)]
    if all(os.path.exists(p) for p in paths):
        return paths
    train, _ = load_data(train_samples)
    n = len(train) - len(train) % shards  # equal shards: every rank gets as many batches
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:n].tolist()
    ds = datasets.Dataset.from_dict({"input_ids": train.tokens[order].tolist(), "labels": train.labels[order].tolist()})
    os.makedirs(folder, exist_ok=True)
    for k, path in enumerate(paths):
        tmp = f"{path}.{os.getpid()}.tmp"
        ds.shard(num_shards=shards, index=k, contiguous=True).to_parquet(tmp)
        os.replace(tmp, path)  # a reader never sees half a file
    return paths


class Position:
    """Where the loop is: epoch and optimizer step (the stream's own position is the dataloader's)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.step = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def train(config: dict) -> dict:
    import datasets

    cfg = {**DEFAULTS, **(config or {})}
    session = get_session()

    # 1. Build. The spec's dataloader settings come with accelerator_kwargs.
    accelerator = Accelerator(**session.accelerator_kwargs())
    accelerator.init_trackers("digits-stream", config=cfg)
    set_seed(cfg["seed"])
    # One process per machine writes the files (a folder local to each machine, or shared).
    with accelerator.local_main_process_first():
        files = write_shards(cfg["data_dir"], cfg["shards"], cfg["train_samples"])
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")
    _, test_set = load_data(None)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    train_dl = DataLoader(stream, batch_size=cfg["batch_size"])
    test_dl = DataLoader(test_set, batch_size=64)

    # 2. Prepare: with dispatch_batches false and shards >= ranks, each rank reads its own files.
    model, optimizer, train_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, test_dl)
    position = Position()
    accelerator.register_for_checkpointing(position)

    # 3. Resume: the weights, the optimizer and each rank's place in its files.
    restored = session.restore(accelerator)
    if restored is not None:
        accelerator.print(f"resumed at epoch {position.epoch}, step {position.step}")

    # 4. Loop over epochs of the stream; a resumed epoch goes on where the checkpoint was.
    last_saved = restored
    global_batch = cfg["batch_size"] * accelerator.num_processes
    step_began = time.perf_counter()
    model.train()
    while position.epoch < cfg["epochs"]:
        train_dl.set_epoch(position.epoch)
        for batch in train_dl:
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
            position.step += 1
            loss = accelerator.reduce(out.loss.detach(), "mean").item()
            now = time.perf_counter()
            accelerator.log({"loss": loss, "epoch": position.epoch,
                             "samples_per_s": global_batch / (now - step_began)}, step=position.step)
            step_began = now
            if cfg["checkpoint_every"] and position.step % cfg["checkpoint_every"] == 0:
                session.save(accelerator, position.step)
                last_saved = position.step
            if session.preempted(accelerator):
                if last_saved != position.step:
                    session.save(accelerator, position.step)
                accelerator.end_training()
                return {"preempted_at": position.step, "steps": position.step}
            if cfg["throttle_s"]:
                time.sleep(cfg["throttle_s"])
        position.epoch += 1

    # 5. Evaluate on the held-out images (map-style, in memory).
    accuracy = evaluate(accelerator, model, test_dl, position.step)

    # 6. The final state, committed under the runner.
    if last_saved != position.step:
        session.save(accelerator, position.step)
    weights = weights_digest(accelerator.get_state_dict(model))  # a collective under FSDP: before the end
    accelerator.end_training()
    return {"eval_accuracy": accuracy, "steps": position.step, "world_size": accelerator.num_processes,
            "restored_step": restored, "weights": weights}


if __name__ == "__main__":
    print(train({}))
