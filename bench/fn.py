"""The training function every launcher runs in the benchmark (Accelerate only, no Ray).

A 2.1M-parameter MLP on synthetic data, where gradient communication matters.
One run measures everything a launcher is compared on:

- the time of the first optimizer step (``first_step_at``);
- steady step times (wall clock, and the rank's CPU seconds a step, which the machine's other load moves less),
  every launcher reading each batch through the prepared dataloader, one iterator over the steps as users read it
  (under raylaunch its defaults then run between two batches: a snapshot in memory every k steps, ``auto``'s k, the
  count in ``snapshots``), with metrics logged in alternating blocks of ``log_block`` steps (``accelerator.log`` +
  ``session.log`` every step) and not at all, so the cost of metrics is a ratio within one run;
- under raylaunch, the cost of measuring each rank's pace (``cluster/rank/pace.py``) the same way:
  blocks that read the batch through the prepared dataloader (timed) and train the prepared
  DDP model (its all-reduce timed), alternating with blocks that read it through Accelerate's
  own untimed iterator and train an identical model, prepared by Accelerate the same way, without the timing hooks;
- at each step of ``checkpoint_at``, ``session.save`` and Accelerate's plain
  ``save_state`` to local disk, in alternating order (whichever goes first pays
  first-write costs);
- with ``pid_dir``: each rank records its pid and first step in
  ``first_steps.jsonl``; with ``wait_for_kill``, after the last step every rank
  waits there to be killed (the harness kills rank 1), and the restarted world
  runs ``steps_after_restart`` steps: the recovery time is the kill to the
  restarted world's first step; rank 0 marks its steady steps' start and end in
  ``steady.jsonl`` (the harness measures the CPU every other process uses meanwhile).

Rank 0 writes what it measured to ``config["result_path"]`` as JSON before any wait.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
from accelerate import Accelerator

from cluster.runtime import get_session


def _starts(pid_dir: str) -> list[dict]:
    path = os.path.join(pid_dir, "first_steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steady_marker(pid_dir: str | None):
    """Rank 0 writes when its steady steps begin and end (``steady.jsonl``), so the
    harness can measure what the other processes burn meanwhile."""
    def mark(phase: str) -> None:
        if pid_dir:
            with open(os.path.join(pid_dir, "steady.jsonl"), "a") as f:
                f.write(json.dumps({"phase": phase, "at": time.time()}) + "\n")
    return mark


def _held_mb(optimizer) -> float:
    """Parameters and optimizer state this rank holds (its shards under FSDP), in MiB."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(local(t).numel() * local(t).element_size() for t in tensors) / 2**20


def train(config: dict) -> dict:
    steps = int(config.get("steps", 60))
    block = int(config.get("log_block", 10))
    ckpt_at = list(config.get("checkpoint_at", []))
    pid_dir = config.get("pid_dir")
    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    accelerator.init_trackers("bench", {})
    rank = accelerator.process_index
    restarted = bool(pid_dir) and any(s["rank"] == rank for s in _starts(pid_dir))
    if restarted:
        steps = int(config.get("steps_after_restart", 5))
    torch.manual_seed(0)
    if config.get("model") == "digits_bert":  # the transformers example's model, on a real batch
        from train_fn.digits import DEFAULTS, build_model, load_data

        model = build_model({**DEFAULTS, "dropout": 0.0})
        images = load_data(None)[0]
        x, y = images.tokens[:32].to(accelerator.device), images.labels[:32].to(accelerator.device)
    elif config.get("model") == "gpt2_small":  # GPU mode: a step of 20 ms or more, GPT-2 small's shape, from a config
        from transformers import GPT2Config, GPT2LMHeadModel

        layers, seq = int(config.get("layers", 12)), int(config.get("seq", 512))  # smaller: a CPU rehearsal
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=seq, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0))
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, model.config.vocab_size, (8, seq), generator=g).to(accelerator.device)
        y = x
    elif config.get("model") == "tiny_mlp":  # a step of 1-3 ms on a CPU (a GPU step's regime: fixed costs show)
        model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))
        x, y = torch.randn(8, 128).to(accelerator.device), torch.randn(8, 128).to(accelerator.device)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 512))
        x, y = torch.randn(32, 512).to(accelerator.device), torch.randn(32, 512).to(accelerator.device)
    import copy

    twin = copy.deepcopy(model)  # the same weights, for the blocks without pace measurement
    if config.get("pace_swap"):
        # The two objects' roles swapped (the bench does so every other raylaunch run): what the object that was made
        # first, or its memory, does to a step then falls on either side of the pace ratio alike, and cancels in its
        # median over the runs; what raylaunch attaches to the model it prepares does not.
        model, twin = twin, model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Each rank's every batch from the prepared loader is the same x and y, one for each step: the loop reads one pass
    # of it as users do (one iterator over the steps), so what raylaunch does between two batches of an iterator
    # (a snapshot in memory every few steps, the stop notices' agreement: cluster/rank/pace.py) is on the step too.
    n = accelerator.num_processes * steps
    data = torch.utils.data.TensorDataset(x.cpu().repeat(n, *[1] * (x.dim() - 1)), y.cpu().repeat(n, *[1] * (y.dim() - 1)))
    loader = torch.utils.data.DataLoader(data, batch_size=len(x))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    paced = session.under_runner  # the runner measures data_wait and sync_wait; others do not
    if paced:
        # The twin prepared as the model is (Accelerate's DDP, its AcceleratedOptimizer), by an Accelerator of its own
        # (its save_state and raylaunch's snapshots see only the model) through prepare_model and prepare_optimizer,
        # which raylaunch's pace hooks skip: only the measurement differs between the blocks. A plain DDP and AdamW
        # twin read the pace's cost as 1.066x (make bench BENCH_FULL=1, 2026-12-06) where bench.step_costs read 17 us.
        twins = Accelerator(**session.accelerator_kwargs())
        twin = twins.prepare_model(twin)
        twin_optimizer = twins.prepare_optimizer(torch.optim.AdamW(twin.parameters(), lr=1e-4))
        untimed = type(loader).__iter__.__wrapped__  # Accelerate's own iterator, without the clock

    # Every launcher reads each step's batch through the prepared loader (the same step code everywhere, #58); under
    # raylaunch the blocks without pace measurement read it through Accelerate's own iterator, unwrapped, and take
    # the snapshots that come due in them as the wrapped iterator would (so both kinds of block pay for snapshots).
    iterators: dict[bool, object] = {}

    def batch(timed: bool, steps_taken: int):
        if not timed:
            from cluster.rank import pace

            if steps_taken >= pace.SNAPSHOT_AT[0]:
                pace.SNAPSHOT[0](steps_taken)
        for _ in range(2):
            if timed not in iterators:
                iterators[timed] = iter(loader) if timed else untimed(loader)
            try:
                return next(iterators[timed])
            except StopIteration:
                del iterators[timed]
        raise RuntimeError("the prepared loader yields no batch")

    def compute_loss(net, xb, yb):
        if config.get("model") == "digits_bert":
            return net(input_ids=xb, labels=yb).loss
        if config.get("model") == "gpt2_small":  # bf16 autocast under every launcher alike
            with torch.autocast(accelerator.device.type, dtype=torch.bfloat16):
                return net(input_ids=xb, labels=yb).loss
        # .float(): under FSDP2 in bf16/fp16 Accelerate returns the model's outputs in that precision (DDP and FSDP1
        # return float32), and the GPU's mse_loss backward refuses a bf16 input against float32 targets.
        return torch.nn.functional.mse_loss(net(xb).float(), yb)

    logged, quiet, first_step_at, saves, local_saves, cpu = [], [], None, [], [], []
    # when the steady steps began: the window's time a step counts the saves' holds between them and what runs after
    # them (a background write, the snapshots in memory that begin at the first save)
    window_began: float | None = None
    with_pace, without_pace = [], []
    mark = _steady_marker(pid_dir if rank == 0 and not restarted else None)
    for step in range(1, steps + 1):
        if step == steps // 4 + 1:
            mark("begin")
            window_began = time.perf_counter()
        log = block > 0 and (step // block) % 2 == 0
        # pace blocks of 2 x log_block steps, in the order paced, unpaced, unpaced, paced (ABBA), so a drift of the
        # machine over the run falls on both alike; each holds as many logged steps as quiet ones
        timed = not paced or block <= 0 or (step // (2 * block)) % 4 in (0, 3)
        net, opt = (model, optimizer) if timed else (twin, twin_optimizer)
        began, cpu_began = time.perf_counter(), time.process_time()
        loss = compute_loss(net, *batch(timed, step - 1))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if log:
            # The tensor, not loss.item(): .item() waits for the GPU under any launcher; a tensor is read off the
            # device by the session's own thread, so the blocks measure what logging itself adds
            accelerator.log({"loss": loss.detach()}, step=step)
            session.log({"rank_loss": loss.detach()}, step=step)
        took = time.perf_counter() - began
        cpu.append((step, time.process_time() - cpu_began))  # the rank's every thread: gloo's, the launcher's
        (logged if log else quiet).append((step, took))
        (with_pace if timed else without_pace).append((step, took))
        if first_step_at is None:
            first_step_at = time.time()
            if pid_dir:
                with open(os.path.join(pid_dir, "first_steps.jsonl"), "a") as f:
                    f.write(json.dumps({"rank": rank, "pid": os.getpid(), "first_step_at": first_step_at,
                                        "restarted": restarted}) + "\n")
        if step in ckpt_at:
            session_first = ckpt_at.index(step) % 2 == 0
            for which in (("session", "local") if session_first else ("local", "session")):
                accelerator.wait_for_everyone()
                t = time.perf_counter()
                if which == "session":
                    session.save(accelerator, step)
                    saves.append(time.perf_counter() - t)
                else:
                    with tempfile.TemporaryDirectory() as tmp:
                        accelerator.save_state(tmp)
                        accelerator.wait_for_everyone()
                        local_saves.append(time.perf_counter() - t)

    mark("end")
    window_s = time.perf_counter() - window_began if window_began is not None else None

    def steady(times: list[tuple[int, float]]) -> float | None:
        warm = [t for s, t in times if s > steps // 4]
        return statistics.median(warm) if warm else None

    result = {"first_step_at": first_step_at, "steady_step_s": steady(logged + quiet), "held_mb": _held_mb(optimizer),
              "steady_cpu_s": steady(cpu),
              "window_step_s": window_s / (steps - steps // 4) if window_s is not None else None,
              "steady_logged_s": steady(logged), "steady_quiet_s": steady(quiet),
              "steady_paced_s": steady(with_pace) if paced else None,
              "steady_unpaced_s": steady(without_pace) if paced else None,
              "world_size": accelerator.num_processes, "save_s": saves, "local_save_s": local_saves,
              # snapshots in memory this rank took (raylaunch: its default, every k optimizer steps, k its `auto`'s)
              "snapshots": getattr(session.snapshots, "taken", None), "snapshot_every": getattr(session.snapshots, "interval", None),
              "snapshots_beside": getattr(session.snapshots, "beside", None),
              "restarted": restarted}
    if config.get("step_times"):  # each steady step's wall seconds, for a closer look at a save's wake
        result["step_times"] = sorted(logged + quiet)
    if rank == 0 and config.get("result_path") and not restarted:
        with open(config["result_path"], "w") as f:
            json.dump(result, f)
    if config.get("wait_for_kill") and not restarted:
        deadline = time.time() + 120
        while time.time() < deadline:  # the harness kills rank 1; the launcher ends the rest
            time.sleep(0.05)
        raise RuntimeError("wait_for_kill: nobody killed rank 1 within 120 s")
    accelerator.end_training()
    return result


if __name__ == "__main__":  # torchrun / accelerate launch: the config is argv[1] as JSON
    train(json.loads(sys.argv[1]))
