"""Training functions for tests. Like train_fn/, they import nothing from Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from cluster.runtime import get_session

ENV_KEYS = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "NODE_RANK", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU", "GLOO_SOCKET_IFNAME"]


def probe(config: dict) -> dict:
    """What a rank sees: its environment, Accelerate's view of the world, a collective, the objects its garbage
    collector scans and those frozen where it forked."""
    import gc

    accelerator = Accelerator(**get_session().accelerator_kwargs())
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index)]), "sum").item()
    return {
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "sum_of_ranks": total,
        "torch_threads": torch.get_num_threads(),
        # the spec's accelerate section, as the Accelerator holds it
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "even_batches": accelerator.even_batches,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "gc_frozen": gc.get_freeze_count(),
        "gc_tracked": len(gc.get_objects()),
    }


def fail_on_all_ranks(config: dict) -> None:
    # Every rank past the rendezvous before any raises: gloo's init can return on rank 0 while rank 1 still
    # connects, and rank 0's exit then fails rank 1's init instead ("Connection closed by peer").
    Accelerator(**get_session().accelerator_kwargs()).wait_for_everyone()
    raise ValueError(f"bad batch shape {config.get('shape', '(3, 4)')}")


class _Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class _SlowItems(torch.utils.data.Dataset):
    """A dataset whose every item takes ``sleep_s`` to read: an input pipeline that cannot keep up."""

    def __init__(self, data, sleep_s: float) -> None:
        self.data, self.sleep_s = data, sleep_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        import time

        time.sleep(self.sleep_s)
        return self.data[i]


def steady(config: dict) -> dict:
    """A small regression that takes ``step_s`` a step and checkpoints every ``every`` steps.

    Each rank writes ``<pid_dir>/rank-<R>.pid`` (attempt, pid) when it starts, so tests can
    kill or stop it from outside. With ``fail_at``, rank 1 raises at that step in attempt 1; with
    ``slow_rank``, that rank sleeps ``slow_s`` more before every step; with ``slow_data_rank``,
    that rank's dataset sleeps ``slow_data_s`` in every ``__getitem__``.
    """
    import time
    from pathlib import Path

    from torch.utils.data import DataLoader, TensorDataset

    session = get_session()
    if config.get("user_tensorboard"):  # the user's own tracker beside the runner's
        accelerator = Accelerator(**session.accelerator_kwargs(
            log_with=["tensorboard", session.tracker()], project_dir=config["user_tensorboard"]))
    else:
        accelerator = Accelerator(**session.accelerator_kwargs())
    accelerator.init_trackers("steady", {k: v for k, v in config.items() if v is not None})
    pid_dir = Path(config["pid_dir"])
    pid_dir.mkdir(parents=True, exist_ok=True)
    attempt = session.payload.attempt if session.payload else 0
    pid_file = pid_dir / f"rank-{accelerator.process_index}.pid"
    pid_file.with_suffix(".tmp").write_text(f"{attempt} {os.getpid()}")
    pid_file.with_suffix(".tmp").replace(pid_file)  # whole or absent: a test may read it at any moment
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.arange(8.0) + 1
    data = TensorDataset(x, y)
    if accelerator.process_index == config.get("slow_data_rank"):
        data = _SlowItems(data, config["slow_data_s"])
    dl = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    hidden = config.get("hidden")  # a bigger checkpoint: 10 x hidden parameters
    # dropout between the layers: a resume that does not put the random states back where they were shows
    dropout = [torch.nn.Dropout(config["dropout"])] if config.get("dropout") else []
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), *dropout, torch.nn.Linear(hidden, 1)) if hidden \
        else torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.01))
    model, opt, dl = accelerator.prepare(model, opt, dl)
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)
    restored = session.restore(accelerator)
    total = config["steps"]
    saves = []  # seconds each periodic session.save held training
    saved_at = []  # when each began (time.time())
    while progress.step < total:
        for xb, yb in dl:
            if accelerator.process_index == config.get("slow_rank"):
                time.sleep(config["slow_s"])  # a straggler: slow data on one rank, every step
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            progress.step += 1
            accelerator.log({"loss": loss.item()}, step=progress.step)
            session.log({"rank_loss": loss.item()}, step=progress.step)
            due = session.checkpoint_due(accelerator)  # checkpoint.every, when the spec sets it
            if progress.step % config["every"] == 0 or due:
                began = time.perf_counter()
                saved_at.append(time.time())
                session.save(accelerator, progress.step)
                saves.append(time.perf_counter() - began)
            if progress.step == config.get("fail_at") and attempt == 1 and accelerator.process_index == 1:
                raise RuntimeError(f"injected failure at step {progress.step}")
            if config.get("cooperative") and session.preempted(accelerator):
                session.save(accelerator, progress.step)  # within the grace period
                return {"restored_step": restored, "steps": progress.step, "preempted_at": progress.step}
            time.sleep(config.get("step_s", 0.05))
            if progress.step >= total:
                break
    import hashlib

    weights = hashlib.sha256(b"".join(t.detach().numpy().tobytes()
                                      for t in accelerator.unwrap_model(model).state_dict().values())).hexdigest()
    return {"restored_step": restored, "steps": progress.step, "save_s": saves, "saved_at": saved_at,
            "cwd": os.getcwd(), "weights": weights}


def litter_then_fail(config: dict) -> dict:
    """Attempt 1 leaves half a checkpoint where its session stages them (a crash mid-save),
    notes that folder in ``config["note"]`` and fails; later attempts report whether what it
    left is still there."""
    from pathlib import Path

    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    note = Path(config["note"])
    if session.payload.attempt == 1:
        part = Path(session.payload.staging_uri) / "checkpoint-00000005"
        part.mkdir(parents=True, exist_ok=True)
        (part / f"random_states_{accelerator.process_index}.pkl").write_bytes(b"half a pickle")
        if accelerator.is_main_process:
            note.write_text(str(part))
        accelerator.wait_for_everyone()  # both halves are there before anyone fails
        raise RuntimeError("crashed in the middle of a save")
    left = Path(note.read_text())
    return {"earlier_staging_left": left.exists()}


def hang_in_collective(config: dict) -> None:
    """Rank 1 never reaches the all-reduce rank 0 waits in (a hung collective)."""
    import time

    accelerator = Accelerator(**get_session().accelerator_kwargs())
    if accelerator.process_index == 1:
        time.sleep(600)
    accelerator.reduce(torch.tensor([1.0]), "sum")


def ends_training_with_a_gather_in_flight(config: dict) -> dict:
    """Calls ``end_training()`` (which destroys the group) with its DDP model alive and an all_gather of its own
    still running on gloo's threads, then returns: the model's Reducer is freed as the function returns."""
    import torch.distributed as dist

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    size = config.get("elements", 4_000_000)
    outputs = [torch.zeros(size) for _ in range(accelerator.num_processes)]
    dist.all_gather(outputs, torch.ones(size), async_op=True)  # not waited for
    del outputs  # gloo's thread now holds the last reference to these tensors' Python objects
    accelerator.end_training()
    return {"type": type(model).__name__}


class _SlowOnRank1:
    """A dataset whose rank-1 copy blocks in ``__getitem__`` once ``block_at`` items were read."""

    def __init__(self, rank: int, block_at: int) -> None:
        self.rank, self.block_at, self.read = rank, block_at, 0

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int):
        import time

        self.read += 1
        if self.rank == 1 and self.read > self.block_at:
            time.sleep(3600)  # a stuck read: network storage, a deadlocked worker
        return torch.ones(2)


def hang_in_data(config: dict) -> dict:
    """Rank 1 blocks in its data loading; rank 0 waits for it in an all_reduce."""
    accelerator = Accelerator(**get_session().accelerator_kwargs())
    data = _SlowOnRank1(accelerator.process_index, config.get("block_at", 3))
    for i in range(len(data)):
        batch = data[i]
        accelerator.reduce(batch.to(accelerator.device), "sum")  # NCCL reduces on the GPU
    return {}


def hostile_outputs(config: dict) -> dict:
    """Everything a careless training function hands the runner at once: metrics named like
    a row's own keys, numbers no float holds, huge text, thousands of keys, a line of
    ``line_mb`` megabytes, a progress bar of carriage returns only, and a return value
    that is not data (a lock, a cycle)."""
    import sys
    import threading

    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    rank = accelerator.process_index
    for step in (1, 2):
        session.log({"step": 999, "rank": 42, "loss": 1.0 / step, "nan": float("nan"), "inf": float("inf"),
                     "huge_int": 10**400, "text": "x" * 5_000_000}, step=step)
    session.log({f"k{i}": i for i in range(5000)}, step=3)
    chunk = "z" * 2**20
    for _ in range(int(config.get("line_mb", 100))):
        sys.stdout.write(chunk)
    sys.stdout.write("\nafter the long line\n")
    for i in range(200_000):
        sys.stderr.write(f"\r{i // 2000}%|bar|")
    sys.stdout.flush()
    sys.stderr.flush()
    accelerator.wait_for_everyone()
    cycle: dict = {"rank": rank}
    cycle["self"] = cycle
    return {"lock": threading.Lock(), "cycle": cycle, "rank": rank}


def diverges(config: dict) -> dict:
    """Rank R logs ``score`` as (R + 1)/step for steps 1-4, then NaN, infinity and minus infinity at
    steps 5-7: a run whose loss blew up."""
    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    for step, value in enumerate([1.0, 0.5, 1 / 3, 0.25, float("nan"), float("inf"), float("-inf")], start=1):
        session.log({"score": value * (accelerator.process_index + 1)}, step=step)
    accelerator.wait_for_everyone()
    return {"rank": accelerator.process_index}


def sabotage_storage(config: dict) -> dict:
    """Rank 0 puts a file where the run's checkpoints folder goes, then every rank saves:
    storage that changes under the driver (a user, a cleanup job) while the run goes on."""
    from pathlib import Path

    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    del model
    run_dir = Path(session.payload.staging_uri).parent.parent
    if accelerator.is_main_process:
        import shutil

        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        (run_dir / "checkpoints").write_text("not a folder")
    accelerator.wait_for_everyone()
    session.save(accelerator, 5)
    return {"saved": True}


def env_probe(config: dict) -> dict:
    """What the job's environment gave this rank: a plain variable, a secret (by its hash: a
    return value is written to result.json), and an extra package when asked; prints the
    secret, which the runner must mask."""
    import hashlib
    import importlib

    Accelerator(**get_session().accelerator_kwargs())
    secret = os.environ.get(config.get("secret", ""), "")
    print(f"the secret is {secret}", flush=True)
    out = {"var": os.environ.get(config.get("var", ""), None),
           "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(),
           "rank_env": os.environ.get("RANK")}
    if config.get("package"):
        module = importlib.import_module(config["package"])
        out["package_file"] = module.__file__
    return out


def elastic(config: dict) -> dict:
    """The digits example's recipe on a small regression, for resizes: a seedable sampler,
    ``set_epoch`` every epoch, the batches already seen skipped, the step counted in optimizer
    steps. Logs the sample ids each rank used in each optimizer step (``ids``) and returns the
    final loss on the whole data set. With ``gate`` and ``gate_step``, a world of one rank waits
    after that step until the file ``gate`` exists (up to 120 s)."""
    import math
    import time
    from pathlib import Path

    from torch.utils.data import DataLoader, TensorDataset

    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    pid_dir = Path(config["pid_dir"])
    pid_dir.mkdir(parents=True, exist_ok=True)
    attempt = session.payload.attempt if session.payload else 0
    (pid_dir / f"rank-{accelerator.process_index}.pid").write_text(f"{attempt} {os.getpid()}")
    torch.manual_seed(0)
    n = config.get("samples", 128)
    x = torch.randn(n, 8)
    y = x @ torch.arange(8.0) + 1 + 0.1 * torch.randn(n)
    dl = DataLoader(TensorDataset(torch.arange(n), x, y), batch_size=config.get("batch_size", 8), shuffle=True,
                    generator=torch.Generator().manual_seed(0))
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.02))
    model, opt, dl = accelerator.prepare(model, opt, dl)
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)
    restored = session.restore(accelerator)
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(dl) / accumulation)
    total = steps_per_epoch * config.get("epochs", 4)
    while progress.step < total:
        epoch, done = divmod(progress.step, steps_per_epoch)
        dl.set_epoch(epoch)
        batches = accelerator.skip_first_batches(dl, done * accumulation) if done else dl
        ids: list[int] = []
        for idx, xb, yb in batches:
            ids += idx.tolist()
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            session.log({"ids": ids, "rank_loss": loss.item(), "epoch": epoch}, step=progress.step)
            ids = []
            if progress.step % config["every"] == 0:
                session.save(accelerator, progress.step)
            time.sleep(config.get("step_s", 0.05))
            if accelerator.num_processes == 1 and progress.step == config.get("gate_step"):
                # a test holds the one-node phase here until it opens the gate (the node is back)
                gate, until = Path(config["gate"]), time.monotonic() + 120
                while not gate.exists() and time.monotonic() < until:
                    time.sleep(0.05)
            if progress.step >= total:
                break
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(accelerator.unwrap_model(model)(x).squeeze(-1), y).item()
    return {"restored_step": restored, "steps": progress.step, "final_loss": final,
            "world_size": accelerator.num_processes, "accumulation": accumulation}


def _wait_for_commit(session, step: int, timeout_s: float = 120.0) -> None:
    """Until the driver has committed the checkpoint of ``step`` (``latest.json`` on the run's storage, a local
    folder or an object store, names it or a later one); raises after ``timeout_s``."""
    import json
    import time

    from cluster.layout import CHECKPOINTS, LATEST, run_of_staging
    from cluster.storage_io import open_uri

    fs, staging = open_uri(session.payload.staging_uri)
    latest = f"{run_of_staging(staging)}/{CHECKPOINTS}/{LATEST}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with fs.open_input_stream(latest) as f:
                if json.loads(f.read())["step"] >= step:
                    return
        except (OSError, ValueError, KeyError):  # not written yet, or being replaced
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the checkpoint of step {step} was not committed within {timeout_s:g} s ({latest})")


def sharded(config: dict) -> dict:
    """An MLP trained through ``session.save``/``restore`` with whatever strategy the spec chose.

    Deterministic data (seeded by step and rank), ``steps`` optimizer steps, a checkpoint every
    ``every``; with ``fail_at`` rank 1 dies at that step in attempt 1 (after the checkpoint).
    Returns digests of the full weights and optimizer state (gathered: collectives on every rank),
    as loaded and at the end, and how many parameters this rank holds.
    """
    import hashlib

    from accelerate.utils import set_seed
    from torch.distributed.tensor import DTensor

    from cluster.rank.sharding import shard_info

    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    set_seed(0)
    width = int(config.get("width", 64))
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def digest() -> dict:
        h_model, h_opt = hashlib.sha256(), hashlib.sha256()
        for name, p in model.named_parameters():
            h_model.update(name.encode() + full(p.detach()).cpu().contiguous().numpy().tobytes())
            for key, value in sorted(optimizer.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    h_opt.update(key.encode() + full(value).cpu().contiguous().numpy().tobytes())
        return {"model": h_model.hexdigest()[:16], "optimizer": h_opt.hexdigest()[:16]}

    restored = session.restore(accelerator)
    loaded = digest() if restored is not None else None
    rank, world = accelerator.process_index, accelerator.num_processes
    while progress.step < int(config["steps"]):
        gen = torch.Generator().manual_seed(progress.step * 100 + rank)
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen) + 0.01 * torch.randn(8, 4)  # the global RNG: restored or seeded
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        session.log({"loss": loss.item()}, step=progress.step)
        if progress.step % int(config["every"]) == 0:
            session.save(accelerator, progress.step)
            if config.get("fail_at") == progress.step and rank == 1 and session.payload.attempt == 1:
                _wait_for_commit(session, progress.step)  # dies after the commit, as the test means
                os._exit(7)
    info = shard_info(model)
    # The whole model as a user saves it at the end (a collective: every rank; rank 0 gets it all).
    gathered = accelerator.get_state_dict(model) if config.get("gather") else {}
    whole = hashlib.sha256(b"".join(k.encode() + v.cpu().contiguous().numpy().tobytes()
                                    for k, v in sorted(gathered.items()))).hexdigest()[:16] if gathered else None
    return {"rank": rank, "world_size": world, "distributed_type": str(accelerator.distributed_type),
            "gathered": whole,
            "model_class": type(model).__name__, "local_params": info.local_params,
            "total_params": info.total_params, "restored_step": restored, "loaded": loaded, "final": digest(),
            "rng_seed": torch.initial_seed(), "mixed_precision": accelerator.mixed_precision}


def fsdp_undone(config: dict) -> dict:
    """Asked for FSDP, builds its Accelerator as an Accelerate that does not take its FSDP path would:
    without the strategy the runner set, so ``prepare`` wraps the model for plain DDP."""
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_USE_FSDP", "FSDP_"))]:
        del os.environ[key]
    accelerator = Accelerator(**get_session().accelerator_kwargs())
    accelerator.prepare(torch.nn.Linear(4, 4))
    return {"trained_unsharded": True}


GPU_KEYS = ["CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "NCCL_SOCKET_IFNAME",
            "GLOO_SOCKET_IFNAME", "ACCELERATE_USE_CPU", "TORCH_NCCL_TRACE_BUFFER_SIZE"]


def gpu_probe(config: dict) -> dict:
    """What a rank on a GPU node was given, and nothing it worked out itself."""
    return {k: os.environ.get(k) for k in GPU_KEYS}


def _slow_background_writes(delay_s: float, marks: Path) -> None:
    """Storage that takes ``delay_s`` for every file a checkpoint's background write makes with torch.save or
    safetensors (in the rank's thread, or handed to its writer process), and
    ``<marks>/returned-a<attempt>-r<rank>-s<step>`` written once ``session.save`` returns: its text says this
    rank's pid and whether its files were on storage by then."""
    import threading
    import time

    from cluster.checkpoint.writer import CheckpointWriter

    session = get_session()
    real_torch_save, real_save, real_write = torch.save, session.save, CheckpointWriter.write

    def torch_save(obj, f, *args, **kwargs):
        if threading.current_thread().name.startswith("raylaunch-checkpoint-"):
            time.sleep(delay_s)
        return real_torch_save(obj, f, *args, **kwargs)

    def write(self, writes, *args, **kwargs):  # the writer process's files, each as slow
        time.sleep(delay_s * len(writes))
        return real_write(self, writes, *args, **kwargs)

    CheckpointWriter.write = write

    def save(accelerator, step):
        out = real_save(accelerator, step)
        rank = accelerator.process_index
        written = (Path(out) / f"random_states_{rank}.pkl").exists()
        writer = session._checkpoints._writer.pid  # the process writing this save's tensors, if any
        marks.mkdir(parents=True, exist_ok=True)
        mark = marks / f"returned-a{session.payload.attempt}-r{rank}-s{step}"
        mark.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid(), "written": written, "writer": writer,
                                                        "writer_nice": writer and os.getpriority(os.PRIO_PROCESS,
                                                                                                 writer)}))
        mark.with_suffix(".tmp").replace(mark)
        return out

    torch.save, session.save = torch_save, save


def digits_slow_writes(config: dict) -> dict:
    """The digits example on storage whose checkpoint writes are slow (``write_delay_s`` a file)."""
    from train_fn.digits import train

    config = dict(config)
    _slow_background_writes(config.pop("write_delay_s"), Path(config.pop("marks")))
    return train(config)


def sharded_slow_writes(config: dict) -> dict:
    """``sharded`` on storage whose checkpoint writes are slow (``write_delay_s`` a file)."""
    config = dict(config)
    _slow_background_writes(config.pop("write_delay_s"), Path(config.pop("marks")))
    return sharded(config)


def two_quick_saves(config: dict) -> dict:
    """Two saves one right after the other on slow storage: how long each held training."""
    import time

    _slow_background_writes(config["write_delay_s"], Path(config["marks"]))
    session = get_session()
    accelerator = Accelerator(**session.accelerator_kwargs())
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(torch.randn(4, 256)).sum())
    opt.step()
    held = []
    for step in (1, 2):
        began = time.perf_counter()
        session.save(accelerator, step)
        held.append(time.perf_counter() - began)
    return {"held_s": held}


def only_reads(config: dict) -> dict:
    """Iterates a prepared DataLoader whose every item is slow to read (``item_s``) for ``batches`` batches, and
    does nothing else: no step logged, no checkpoint, not a call to the runner (its pace is still measured)."""
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator()  # under the runner, with the spec's accumulation
    data = _SlowItems(TensorDataset(torch.arange(256.0)), config["item_s"])
    dl = accelerator.prepare(DataLoader(data, batch_size=4))
    # ``train``: a model trained on the batches too, an optimizer step at each synced one (still no step logged)
    model = optimizer = None
    if config.get("train"):
        model = torch.nn.Linear(1, 1)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    read = 0
    while read < config["batches"]:
        for (x,) in dl:
            read += 1
            if model is not None:
                with accelerator.accumulate(model):
                    accelerator.backward(model(x[:, None]).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
            if read >= config["batches"]:
                break
    return {"batches": read}


def dcp_captured(rank: int, world: int, port: int, base: str) -> None:
    """One rank of a 2-process gloo group: an FSDP2 model's state saved with DCP directly and through
    ``cluster.checkpoint.snapshot.capture`` (nothing on disk until the snapshot is written, after the model changed), then the
    same shard file on both sides and the captured checkpoint loaded back into the state it was saved from."""
    import filecmp

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from cluster.checkpoint.snapshot import capture

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))
    fully_shard(model)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(f"{base}/direct"))
    snap = capture(lambda: dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(f"{base}/held")))
    assert not list(Path(base, "held").glob("*")), "DCP wrote files during the capture"
    dist.barrier()  # both ranks looked before either writes (the folder is shared: a fast rank's write is no leak)
    saved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on before the files are written
    snap.write()
    dist.barrier()
    assert filecmp.cmp(f"{base}/direct/__{rank}_0.distcp", f"{base}/held/__{rank}_0.distcp", shallow=False)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{base}/held"))
    assert all(torch.equal(state["model"][k].to_local(), v) for k, v in saved.items())
    dist.destroy_process_group()
    # End as the product's ranks do (forkserver children: ``os._exit``), not through the interpreter's finalization,
    # where a gloo thread still joinable aborts the process now and then ("terminate called without an active
    # exception", SIGABRT after this function returned: CI, 2026-12-03; pytorch/pytorch#179291).
    import sys

    sys.stderr.flush()
    os._exit(0)


def trainer(config: dict) -> dict:
    """transformers' Trainer in a function (tests/trainer_script.py's): resumed with the one line docs/launch.md
    gives, ``trainer.train(resume_from_checkpoint=get_session().checkpoint_folder())``."""
    from trainer_script import main

    return main(list(config["argv"]), resume=get_session().checkpoint_folder())


def step_calls(config: dict) -> dict:
    """What raylaunch's own code does on a training step: an MLP trained with a prepared loader, DDP model, optimizer
    and scheduler, logging every step through ``accelerator.log`` (the defaults on: pace, sync_wait, data_wait,
    metrics); after ``warm`` steps, ``steps`` more under ``sys.setprofile``, counting the Python calls made into
    files of raylaunch's packages. Returns the calls a step, by function."""
    import collections
    import sys

    import cluster

    ours = os.path.dirname(os.path.dirname(os.path.abspath(cluster.__file__)))
    packages = tuple(os.path.join(ours, p) + os.sep for p in ("cluster", "jobs"))
    accelerator = Accelerator(**get_session().accelerator_kwargs())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(packages):
            calls[f"{os.path.relpath(frame.f_code.co_filename, ours)}:{frame.f_code.co_name}"] += 1

    warm, steps = int(config.get("warm", 20)), int(config.get("steps", 20))
    for step, (x, y) in enumerate(loader, start=1):
        if step == warm + 1:
            sys.setprofile(profile)
            threading_profile = __import__("threading").setprofile
            threading_profile(None)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        if step == warm + steps:
            sys.setprofile(None)
            break
    return {"calls": {k: v / steps for k, v in sorted(calls.items())},
            "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def digits_snapshot_during_save(config: dict) -> dict:
    """``digits_dies``, whose rank 0 in attempt 1 writes its first snapshot (the first after the save of step 20: none
    is taken before a save, nor while one is being written) only once the save of step 40 has returned, a save that
    came while that snapshot's files were being written, and no sooner than ``write_s`` after it began; and never ends
    the write of that save, whose commit does not land before rank 1 dies."""
    import threading
    import time

    import cluster.checkpoint.snapshot as snapshot_module
    from cluster.checksums import SNAPSHOT_CHECKSUM

    config = dict(config)
    write_s = config.pop("write_s")
    session = get_session()
    attempt = session.payload.attempt if session.payload else 0
    if attempt == 1 and int(os.environ.get("RANK", "0")) == 0:
        saved_40, gated = threading.Event(), []
        real_write, real_save = snapshot_module.Snapshot.write, session.save

        def write(self, writer=None, hash_files=False, durable=False, **kw):
            # the first snapshot's files (a save's are sha256; the snapshot written beside the save of step 20, from
            # its capture, is not the one this gates)
            beside_save = any(f"{os.sep}snap-00000020{os.sep}" in w.path for w in self.writes)
            if hash_files == SNAPSHOT_CHECKSUM and not gated and not beside_save:
                gated.append(time.monotonic())
                saved_40.wait(120)
                time.sleep(max(0.0, gated[0] + write_s - time.monotonic()))
            elif hash_files != SNAPSHOT_CHECKSUM and saved_40.is_set():  # the save of step 40's
                time.sleep(600)
            return real_write(self, writer, hash_files, durable, **kw)

        def save(accelerator, step):
            out = real_save(accelerator, step)
            if step == 40:
                saved_40.set()
            return out

        snapshot_module.Snapshot.write, session.save = write, save
    return digits_dies(config)


def digits_dies_before_commit(config: dict) -> dict:
    """``digits_dies``, whose rank ``die_rank`` in attempt 1 never ends writing its part of the checkpoint of step
    ``held`` to storage (so that commit never lands) before it dies."""
    import time

    import cluster.checkpoint.snapshot as snapshot_module
    import cluster.checkpoint.staged as staged_module
    from cluster.layout import checkpoint_name

    config = dict(config)
    held = checkpoint_name(config.pop("held"))
    session = get_session()
    attempt = session.payload.attempt if session.payload else 0
    if attempt == 1 and int(os.environ.get("RANK", "0")) == config["die_rank"]:
        real_write, real_commit = snapshot_module.Snapshot.write, staged_module._Write._commit_from

        def write(self, writer=None, hash_files=False, durable=False, **kw):
            if hash_files == "sha256" and any(f"{os.sep}{held}{os.sep}" in w.path for w in self.writes):
                time.sleep(600)  # the save's own files; the snapshot beside it (xxh3) is written first
            return real_write(self, writer, hash_files, durable, **kw)

        def commit_from(self, sources):  # the save's files copied from the snapshot beside it
            if os.path.basename(self.target.rstrip(os.sep)) == held:
                time.sleep(600)
            return real_commit(self, sources)

        snapshot_module.Snapshot.write = write
        staged_module._Write._commit_from = commit_from
    return digits_dies(config)


def digits_dies(config: dict) -> dict:
    """``train_fn.digits``, whose rank ``die_rank`` kills itself (SIGKILL, as the OOM killer would) in attempt 1, in
    the middle of its optimizer step number ``die_at`` (before that step's end: the last whole step is the one
    before). With ``stall_at``, every rank of attempt 1 waits in that optimizer step until it is stopped (a test
    acts on the cluster while no step is taken and nothing is committed)."""
    import signal
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train_fn.digits import train

    session = get_session()
    if config.get("uncooperative"):  # a function that never asks session.preempted: a stop notice is raylaunch's
        session.preempted = lambda accelerator: False
    attempt = session.payload.attempt if session.payload else 0
    dies = int(os.environ.get("RANK", "0")) == config["die_rank"]
    if attempt == 1 and (dies or config.get("stall_at")):
        taken = [0]

        def hook(optimizer, args, kwargs) -> None:
            taken[0] += 1
            if dies and taken[0] == config["die_at"]:
                os.kill(os.getpid(), signal.SIGKILL)
            if taken[0] == config.get("stall_at"):  # every rank waits there until the attempt is stopped
                time.sleep(300)

        register_optimizer_step_post_hook(hook)
    return train({k: v for k, v in config.items() if k not in ("die_at", "die_rank", "uncooperative", "stall_at")})


def resumes_epoch(config: dict) -> dict:
    """A shuffled prepared loader of 24 batches a rank, a commit at step 6; in attempt 1 rank 1 fails at step 9 (the
    commit landed: it waits for its upload first). Attempt 2 resumes the epoch as ``resume`` says: ``again`` iterates
    the loader from its first batch (a function that forgot to skip), ``skip`` through ``skip_first_batches``,
    ``manual`` skips the batches itself. Each rank writes the batches it trains on (their first sample's index), a
    line each, to ``<out>/seen-<attempt>-<rank>``."""
    import time

    from torch.utils.data import DataLoader, TensorDataset

    session = get_session()
    attempt = session.payload.attempt if session.payload else 0
    accelerator = Accelerator(**session.accelerator_kwargs())
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    n = 24 * 4 * accelerator.num_processes
    dl = DataLoader(TensorDataset(torch.arange(n), torch.randn(n, 4)), batch_size=4, shuffle=True)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    step = session.restore(accelerator) or 0
    mode = config["resume"] if step else "again"
    batches = accelerator.skip_first_batches(dl, step) if mode == "skip" else dl
    for i, (index, x) in enumerate(batches):
        if mode == "manual" and i < step:
            continue
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        with open(os.path.join(config["out"], f"seen-{attempt}-{accelerator.process_index}"), "a") as f:
            f.write(f"{int(index[0])}\n")
        if step == 6:
            session.save(accelerator, step)
            session.wait_for_upload()
        if attempt == 1 and step == 9 and accelerator.process_index == 1:
            time.sleep(1.0)  # the driver commits step 6 (both ranks reported it)
            raise RuntimeError("rank 1 fails at step 9 (on purpose)")
        if step == 12:
            break
    return {"step": step}


def ranks_init_apart(config: dict) -> dict:
    """Each rank initialises its model its own way (seeded by its rank and attempt), as DDP's first broadcast makes
    right. A commit at step 2; with ``fail``, rank 1 fails at step 3 of attempt 1 (the commit landed first); attempt 2
    restores it when ``restore`` says so, else starts over. Trains to step 4. Returns digests of the parameters just
    after ``prepare``, after the restore (or its absence) and at the end."""
    import hashlib
    import time

    session = get_session()
    attempt = session.payload.attempt if session.payload else 1
    accelerator = Accelerator(**session.accelerator_kwargs())
    rank = accelerator.process_index
    torch.manual_seed(rank + 10 * attempt)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    def digest() -> str:
        state = accelerator.unwrap_model(model).state_dict()
        return hashlib.sha256(b"".join(state[k].detach().cpu().numpy().tobytes() for k in sorted(state))).hexdigest()

    prepared = digest()
    step = (session.restore(accelerator) or 0) if config["restore"] else 0
    restored = digest()
    x = torch.arange(32.0).reshape(4, 8) / 32
    while step < 4:
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if attempt == 1 and step == 2:
            session.save(accelerator, step)
            session.wait_for_upload()
        if config["fail"] and attempt == 1 and step == 3 and rank == 1:
            time.sleep(1.0)  # the driver commits step 2 (both ranks reported it)
            raise RuntimeError("rank 1 fails at step 3 (on purpose)")
    return {"prepared": prepared, "restored": restored, "trained": digest(), "attempt": attempt}
