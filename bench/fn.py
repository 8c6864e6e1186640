"""The training function every launcher runs in the benchmark (Accelerate only, no Ray).

A 2.1M-parameter MLP on synthetic data, where gradient communication matters.
Rank 0 writes what it measured to ``config["result_path"]`` as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
from accelerate import Accelerator

from cluster.runtime import get_session


def train(config: dict) -> dict:
    steps = int(config.get("steps", 60))
    log_every = int(config.get("log_every", 1))
    ckpt_at = set(config.get("checkpoint_at", []))
    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    accelerator.init_trackers("bench", {})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(32, 512), torch.randn(32, 512)
    times, first_step_at, saves, local_saves = [], None, [], []
    for step in range(1, steps + 1):
        began = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if log_every and step % log_every == 0:
            accelerator.log({"loss": loss.item()}, step=step)
            session.log({"rank_loss": loss.item()}, step=step)
        times.append(time.perf_counter() - began)
        if first_step_at is None:
            first_step_at = time.time()
            if config.get("pid_dir"):  # the recovery figure: who started when
                with open(os.path.join(config["pid_dir"], "first_steps.jsonl"), "a") as f:
                    f.write(json.dumps({"rank": accelerator.process_index, "pid": os.getpid(),
                                        "first_step_at": first_step_at}) + "\n")
        if step in ckpt_at:
            t = time.perf_counter()
            session.save(accelerator, step)
            saves.append(time.perf_counter() - t)
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                accelerator.save_state(tmp)
                accelerator.wait_for_everyone()
                local_saves.append(time.perf_counter() - t)
    steady = sorted(times[len(times) // 3:])
    result = {"first_step_at": first_step_at, "steady_step_s": steady[len(steady) // 2],
              "world_size": accelerator.num_processes, "save_s": saves, "local_save_s": local_saves}
    if accelerator.is_main_process and config.get("result_path"):
        with open(config["result_path"], "w") as f:
            json.dump(result, f)
    accelerator.end_training()
    return result


if __name__ == "__main__":  # torchrun / accelerate launch: the config is argv[1] as JSON
    train(json.loads(sys.argv[1]))
