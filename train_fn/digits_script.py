"""Handwritten digits with a small BERT, as an ``accelerate launch`` script in the shape of Accelerate's and
transformers' ``*_no_trainer`` examples: argparse, ``main()``, ``save_state`` every N steps into
``<output_dir>/step_<n>``, and ``--resume_from_checkpoint`` read back by folder name.

    accelerate launch --cpu --num_processes 2 train_fn/digits_script.py --epochs 3
    raylaunch launch --num_processes 2 train_fn/digits_script.py --epochs 3

It has no line of raylaunch or Ray: under ``raylaunch launch`` its ``accelerator.log`` reaches the run's
metrics, its ``save_state`` becomes a committed checkpoint, and after a restart it gets
``--resume_from_checkpoint <folder>`` like any other run of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from digits_data import build_model, evaluate, load_data, weights_digest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small BERT on scikit-learn's digits with Accelerate.")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=16, help="per device")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--train_samples", type=int, default=None, help="use only the first N training images")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--checkpointing_steps", type=int, default=0, help="save_state every N optimizer steps (0: at the end)")
    p.add_argument("--output_dir", default="digits-output")
    p.add_argument("--resume_from_checkpoint", default=None, help="a folder save_state wrote (step_<n>)")
    p.add_argument("--throttle_s", type=float, default=0.0, help="sleep after each optimizer step")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    train_set, test_set = load_data(args.train_samples)
    model = build_model({"name_or_path": None, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 128, "dropout": args.dropout, "initializer_range": 0.02})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_dl = DataLoader(test_set, batch_size=64)
    steps_per_epoch = math.ceil(math.ceil(len(train_dl) / accelerator.num_processes) / args.gradient_accumulation_steps)
    max_steps = steps_per_epoch * args.epochs
    from transformers import get_linear_schedule_with_warmup

    # As the examples do: the prepared scheduler steps once per process each optimizer step.
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * max_steps) * accelerator.num_processes,
                                                max_steps * accelerator.num_processes)
    model, optimizer, train_dl, test_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, test_dl, scheduler)
    steps_per_epoch = math.ceil(len(train_dl) / accelerator.gradient_accumulation_steps)
    max_steps = steps_per_epoch * args.epochs

    completed_steps, starting_epoch, resume_batches = 0, 0, 0
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).replace("step_", ""))
        starting_epoch = completed_steps // steps_per_epoch
        resume_batches = (completed_steps % steps_per_epoch) * accelerator.gradient_accumulation_steps

    for epoch in range(starting_epoch, args.epochs):
        model.train()
        batches = train_dl
        if epoch == starting_epoch and resume_batches:
            batches = accelerator.skip_first_batches(train_dl, resume_batches)
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0], "epoch": epoch,
                             "total_steps": max_steps}, step=completed_steps)
            if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if args.throttle_s:
                time.sleep(args.throttle_s)

    accuracy = evaluate(accelerator, model, test_dl, completed_steps)
    if not args.checkpointing_steps or completed_steps % args.checkpointing_steps:
        accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
    digest = weights_digest(accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"steps": completed_steps, "eval_accuracy": accuracy, "weights": digest,
                       "world_size": accelerator.num_processes}, f)
    accelerator.print(f"weights {digest}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
