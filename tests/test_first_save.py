"""The first save costs what every later one does: at the first optimizer step (when the state's size is known) a
rank prepares, in a thread of its own, the host memory its first save copies into (memfd segments with their pages
faulted in on CPUs; pinned blocks on GPUs); its writer process still starts at the first save. On the first GPU run the first save held
training 1.6 s for 3 GiB of state and later ones 0.06 s: the difference was that memory."""

from __future__ import annotations

import torch

from cluster.checkpoint.snapshot import SegmentPool, capture
from cluster.checkpoint.staged import PREPARE_SHARE, StagedCheckpoints
from cluster.context import WorkerContext


def model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def step(model, optimizer):
    model(torch.randn(8, 64)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_into(pool: SegmentPool, model, optimizer, path: str):
    """What a save copies (the model's and optimizer's state, as Accelerate's save_state writes them), into ``pool``."""
    return capture(lambda: torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path),
                   shared=True, pool=pool)


def test_the_first_save_copies_into_memory_prepared_at_the_first_step(tmp_path):
    ctx = WorkerContext(world_rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    checkpoints = StagedCheckpoints(str(tmp_path / "staging"), None, lambda *a, **k: None, context=ctx,
                                    node_dir=str(tmp_path), background=True)
    try:
        model, optimizer = model_and_optimizer()
        assert checkpoints.prepared is None  # nothing before the state exists
        step(model, optimizer)
        assert checkpoints.prepared is not None and checkpoints._writer.pid is None  # the writer waits for a save
        checkpoints.prepared.join(timeout=60)
        snap = save_into(checkpoints._segments, model, optimizer, str(tmp_path / "state.pt"))
        pool = checkpoints._segments
        # every tensor of the state (4 parameters, 4 x 2 Adam moments, 4 step counters) came prepared
        assert (pool.taken, pool.made) == (16, 0), (pool.taken, pool.made)
        assert snap.nbytes == sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 + 4 * 4
        snap.release()
        sizes_at = checkpoints.prepared
        step(model, optimizer)  # once: a second step prepares nothing more
        assert checkpoints.prepared is sizes_at
        assert checkpoints._first_step is None  # and its hook is gone, not called on every step after (#58)
    finally:
        if checkpoints._first_step is not None:
            checkpoints._first_step.remove()
        checkpoints._writer.close()


def test_without_it_the_first_save_makes_every_segment_itself(tmp_path):
    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    pool = SegmentPool()
    save_into(pool, model, optimizer, str(tmp_path / "state.pt")).release()
    assert (pool.taken, pool.made) == (0, 16)
    save_into(pool, model, optimizer, str(tmp_path / "state.pt")).release()  # the second: what the first kept
    assert (pool.taken, pool.made) == (16, 16)


def test_a_state_over_the_bound_is_not_prepared_and_says_so(tmp_path, monkeypatch, capfd):
    import cluster.checkpoint.staged as checkpoints_module

    monkeypatch.setattr(checkpoints_module, "_available_bytes", lambda: 100_000)  # a node with 100 kB to spare
    ctx = WorkerContext(world_rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2, num_nodes=2)
    checkpoints = StagedCheckpoints(str(tmp_path / "staging"), None, lambda *a, **k: None, context=ctx,
                                    node_dir=str(tmp_path), background=True)
    try:
        model, optimizer = model_and_optimizer()
        step(model, optimizer)
        assert checkpoints.prepared is None
        checkpoints._first_step.remove()
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 + 4 * 4
        assert (f"raylaunch: rank 3: the first save's {total / 2**20:.1f} MiB of host memory is not prepared ahead "
                f"(over {100_000 * PREPARE_SHARE / 2 / 2**20:.1f} MiB") in capfd.readouterr().err
    finally:
        checkpoints._writer.close()
