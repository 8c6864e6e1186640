"""Handwritten digits with a small BERT, written with Accelerate's public API only.

scikit-learn's 8x8 digits (1,797 images, shipped with the package) are read as
64-token sequences: each pixel's intensity 0..16 is a token (BERT's position
embeddings tell the places apart), after a [CLS] token whose final state
classifies the image. The loss sits near ln(10) for the first few hundred
steps before it falls; 40 epochs on two workers reach about 0.93 held-out
accuracy in under two minutes on two CPU cores. (Tokens that name place and
intensity together learn sooner but overfit: 0.73 after 12 epochs.) The model is built from a
config, so nothing is downloaded; ``config["name_or_path"]`` loads a saved or
hub model with ``from_pretrained`` instead.

The same file runs under the runner, under ``accelerate launch`` and under
plain ``python -m train_fn.digits``. It imports nothing from Ray.
"""

from __future__ import annotations

import math
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from cluster.runtime import get_session
from train_fn.digits_data import (CLS, NUM_LABELS, Digits, build_model, evaluate, load_data,  # noqa: F401
                                  weights_digest)

DEFAULTS = {
    "seed": 42,
    "epochs": 40,
    "batch_size": 16,  # per device; the global batch is this x world size x accumulation steps
    "lr": 2e-3,
    "weight_decay": 0.01,
    "warmup_ratio": 0.1,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "dropout": 0.1,
    "initializer_range": 0.02,
    "train_samples": None,  # use only the first N training images (tests)
    "checkpoint_every": 0,  # optimizer steps between checkpoints; 0: only at the end
    "name_or_path": None,  # a saved or hub model to start from instead of a config
    "record_samples": False,  # return the training indices this rank saw in epoch 0
    "throttle_s": 0.0,  # sleep after each optimizer step: to watch a demo, or to interrupt one in a test
}
class Progress:
    """The loop position, saved with every checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def train(config: dict) -> dict:
    cfg = {**DEFAULTS, **(config or {})}
    session = get_session()

    # 1. Build. The session applies the job's mixed precision, accumulation
    #    and dataloader settings (even_batches, a seedable sampler).
    accelerator = Accelerator(**session.accelerator_kwargs())
    accelerator.init_trackers("digits", config=cfg)
    set_seed(cfg["seed"])
    train_set, test_set = load_data(cfg["train_samples"])
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    # Its own generator: building an iterator must not draw from the global RNG.
    generator = torch.Generator().manual_seed(cfg["seed"])
    train_dl = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, generator=generator)
    test_dl = DataLoader(test_set, batch_size=64)

    # 2. Prepare: each rank gets its shard; even_batches pads the last batch so
    #    every rank runs the same number of steps (no end-of-epoch hang).
    model, optimizer, train_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, test_dl)
    steps_per_epoch = math.ceil(len(train_dl) / accelerator.gradient_accumulation_steps)
    total_steps = steps_per_epoch * cfg["epochs"]
    from transformers import get_linear_schedule_with_warmup

    # The schedule counts optimizer steps: stepped once per optimizer step below and saved with
    # the checkpoint. (Prepared, Accelerate would step it once per process, a count that no
    # longer matches after the runner resumes at another world size.)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg["warmup_ratio"] * total_steps), total_steps)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.register_for_checkpointing(scheduler)

    # 3. Resume from the latest committed checkpoint, if the runner has one.
    restored = session.restore(accelerator)
    restored_digest = weights_digest(accelerator.get_state_dict(model)) if restored is not None else None
    if restored is not None:
        accelerator.print(f"resumed at step {progress.step}")

    # 4. Loop.
    seen: list[int] = []
    last_saved = restored
    global_batch = cfg["batch_size"] * accelerator.num_processes * accelerator.gradient_accumulation_steps
    step_began = time.perf_counter()
    model.train()
    while progress.step < total_steps:
        epoch, done_in_epoch = divmod(progress.step, steps_per_epoch)
        train_dl.set_epoch(epoch)
        batches = train_dl
        if done_in_epoch:
            batches = accelerator.skip_first_batches(train_dl, done_in_epoch * accelerator.gradient_accumulation_steps)
        running, count = 0.0, 0
        for batch in batches:
            if epoch == 0:
                seen.extend(batch["index"].tolist())
            with accelerator.accumulate(model):
                out = model(input_ids=batch["input_ids"], labels=batch["labels"])
                accelerator.backward(out.loss)
                optimizer.step()
                optimizer.zero_grad()
            running += out.loss.item()
            count += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            progress.step += 1
            loss = accelerator.reduce(torch.tensor(running / count, device=accelerator.device), "mean").item()
            now = time.perf_counter()
            samples_per_s = global_batch / (now - step_began)
            step_began = now
            accelerator.log({"loss": loss, "lr": scheduler.get_last_lr()[0], "epoch": epoch,
                             "samples_per_s": samples_per_s, "total_steps": total_steps}, step=progress.step)
            session.log({"rank_loss": running / count, "samples": count * cfg["batch_size"]}, step=progress.step)
            running, count = 0.0, 0
            # Every checkpoint_every steps, and whenever the spec's checkpoint.every says a save is due
            # (seconds of training, or auto: from what a save costs and how often the run fails).
            due = session.checkpoint_due(accelerator)
            if due or (cfg["checkpoint_every"] and progress.step % cfg["checkpoint_every"] == 0):
                session.save(accelerator, progress.step)
                last_saved = progress.step
            if session.preempted(accelerator):
                # A node got its preemption notice: save within the grace period and stop;
                # the runner restarts from here without using up the restart budget.
                if last_saved != progress.step:
                    session.save(accelerator, progress.step)
                accelerator.end_training()
                return {"preempted_at": progress.step, "steps": progress.step, "rank": accelerator.process_index}
            if cfg["throttle_s"]:
                time.sleep(cfg["throttle_s"])
            if progress.step >= total_steps:
                break

    # 5. Evaluate on held-out images.
    accuracy = evaluate(accelerator, model, test_dl, progress.step)

    # 6. Save the final state (a committed checkpoint under the runner).
    if last_saved != progress.step:
        session.save(accelerator, progress.step)
    weights = weights_digest(accelerator.get_state_dict(model))  # a collective under FSDP: before the end
    accelerator.end_training()
    return {
        "eval_accuracy": accuracy,
        "steps": progress.step,
        "world_size": accelerator.num_processes,
        "rank": accelerator.process_index,
        "weights": weights,
        "restored_step": restored,
        "restored_weights": restored_digest,
        "seen_epoch0": sorted(seen) if cfg["record_samples"] else None,
    }


if __name__ == "__main__":
    result = train({})
    print({k: v for k, v in result.items() if k != "seen_epoch0"})
