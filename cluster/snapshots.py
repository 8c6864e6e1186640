"""The folders of a run's snapshots in memory on a node (``cluster.checkpoint.memory`` takes them): where they live,
what a node holds, and the parts the driver moves from node to node through the node actors.

On a node, the run's snapshots live under ``<root>/<run key>/<node id>/``:

- ``snap-<step>/``: the files of the node's ranks' parts of the snapshot of ``step``, and ``rank-<r>.json`` per
  rank (its files, their sizes and checksums: xxh3 for the files its writer process wrote): a part is there once
  its json is.
- ``peer/snap-<step>/``: the same, for the ranks of the node this one keeps copies for (a node lost loses its own).
- ``restore-<step>/``: a whole snapshot put together for a restart (links to the parts here, copies of the parts
  fetched from other nodes) with a ``manifest.json`` as a committed checkpoint has, which the ranks load and verify
  as one.
- ``copied-rank-<r>``: the newest step whose copy of rank r's part to the peer the driver saw end, and when
  (``note_copied``): the rank's ``every: auto`` counts its snapshot's work until then.

A part goes from node to node over a TCP connection of its own (``offer_part``: the holder streams its files with
``sendfile``, the other node receives them straight into its files in memory), not through Ray's object store: on
this machine a 576 MiB part took 1.2 s through two raylets' object stores (5.4 s into a node whose store had not held
one yet: a replacement node's, as a restart after a node lost or drained puts its snapshot together), against 0.5 s
over a socket, with a fifth of the sending side's CPU.

After a stop notice a node also writes the parts it holds into a checkpoint's staging folder on the run's storage
(``store_part``), which the driver then commits as any checkpoint.

Plain functions over files: the node actors (``cluster.nodes.node``) call them for the driver (``jobs.driver.memory``),
the ranks to write and prune their own parts. Imports neither Ray nor torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.checksums import checksum_kind, hasher
from cluster.layout import MANIFEST
from cluster.storage_io import CheckpointError, open_uri

__all__ = ["COPY_WINDOW_S", "KEEP", "OFFER_S", "PartOffer", "SnapshotPlan", "assemble", "copied", "drop_run",
           "keep_peer_part", "node_budget_bytes", "note_copied", "offer_part", "part_files", "pin", "prune", "prune_from",
           "snap_name", "snapshot_root", "store_part", "used_bytes", "write_part_json"]

# A rank keeps this many of its newest snapshots (the newest every rank holds may be one behind its own newest).
KEEP = 2
# The niceness of a part's copy to its peer node, on both nodes' threads (a rank's own checkpoint writing runs at 10
# too, ``cluster.checkpoint.lanes``): it yields the cores the nodes' ranks train on.
PEER_COPY_NICE = 10
# ``memory_mb: auto``: the share of the node's memory its snapshots (its own and its peer's) may hold.
AUTO_MEMORY_SHARE = 0.25

_PART = "rank-{rank}.json"
_COPIED = "copied-rank-{rank}"  # ``note_copied``
# A rank's own parts stay at least this long (within the node's bound): its peer's copies of the same step arrive
# within it, and a snapshot is whole on the peer only with both.
COPY_WINDOW_S = 5.0


def snapshot_root() -> str:
    """Where this node keeps snapshots: ``RAYLAUNCH_SNAPSHOT_DIR``, else ``/dev/shm`` (memory) where it can be
    written, else the temporary folder (the page cache: still on the node, but on its disk)."""
    chosen = os.environ.get("RAYLAUNCH_SNAPSHOT_DIR")
    if not chosen:
        chosen = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(chosen, "raylaunch-snapshots")


def memory_bytes() -> int:
    """The memory this node's processes may use: the machine's, or its container's limit (cgroup v2, then v1)
    when lower (a tmpfs's pages count against it)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
        break
    return total


def node_budget_bytes(memory_mb: float | None, root: str) -> int:
    """The bytes this node's snapshots may hold: ``memory_mb``, or (None: ``auto``) a quarter of the node's (or its
    container's) memory; and never more than half the room of the file system holding ``root`` (``/dev/shm`` is also
    what DataLoader workers and NCCL's shared memory use)."""
    if memory_mb is not None:
        budget = int(memory_mb * 2**20)
    else:
        budget = int(memory_bytes() * AUTO_MEMORY_SHARE)
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
        budget = min(budget, (st.f_bavail * st.f_frsize + used_bytes(root)) // 2)
    except OSError:
        pass
    return budget


def used_bytes(folder: str | Path) -> int:
    """Bytes held by the files under ``folder`` (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def snap_name(step: int) -> str:
    return f"snap-{step:08d}"


def _step_of(name: str, prefix: str) -> int | None:
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def _parts(folder: Path) -> dict[int, dict]:
    """rank -> its part's json, for the parts complete in ``folder`` (a ``snap-<step>``)."""
    out = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                part = json.loads((folder / name).read_text())
                out[int(part["rank"])] = part
            except (OSError, ValueError, KeyError):
                continue
    return out


# How long an offered part waits for the node that takes it to connect, and a connection for its next bytes.
OFFER_S = 60.0
_TOKEN_BYTES = 16
_TAKE, _DECLINE = b"1", b"0"


@dataclass(frozen=True)
class PartOffer:
    """A rank's part held on one node, offered to one other node (``offer_part``): where to connect, the one-time
    token the holder checks, the part's json, and its files' sizes in the order they are sent."""

    host: str
    port: int
    token: bytes
    rank: int
    part: bytes
    sizes: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.sizes) + len(self.part)


def _held(node_dir: str, step: int, rank: int) -> list[tuple[Path, dict]]:
    """Where this node holds a rank's part of ``step``: its own folder, then its peer's copy; each with the part's
    json."""
    out = []
    for folder in (Path(node_dir, snap_name(step)), Path(node_dir, "peer", snap_name(step))):
        part = _parts(folder).get(rank)
        if part is not None:
            out.append((folder, part))
    return out


def offer_part(node_dir: str, step: int, rank: int, host: str, background: bool = False) -> PartOffer | None:
    """Offer a rank's part of the snapshot of ``step`` held on this node (its own or its peer's copy) to one other node:
    its files are opened now (a prune meanwhile unlinks them, never truncates them), and a thread listening on
    ``host`` (this node's address) streams them to the first connection that brings the offer's token, or ends after
    ``OFFER_S``; ``background``: at ``PEER_COPY_NICE`` (a copy to the peer, beside training; a restart's is not).
    None when the node no longer holds the part whole."""
    for folder, part in _held(node_dir, step, rank):
        rels = sorted(part["files"])
        files: list[Any] = []
        try:
            for rel in rels:
                files.append(open(folder / rel, "rb"))
        except OSError:
            _close_all(files)
            continue  # pruned meanwhile
        sizes = tuple((rel, os.fstat(f.fileno()).st_size) for rel, f in zip(rels, files))
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.settimeout(OFFER_S)
        token = secrets.token_bytes(_TOKEN_BYTES)
        threading.Thread(target=_serve_part, args=(listener, token, files, background), daemon=True,
                         name=f"raylaunch-part-{step}-{rank}").start()
        return PartOffer(host, listener.getsockname()[1], token, rank, json.dumps(part).encode(), sizes)
    return None


def _serve_part(listener: socket.socket, token: bytes, files: list[Any], background: bool = False) -> None:
    """The offer's thread: the first connection that sends the token (then ``_TAKE``) gets every file, in order."""
    if background:
        _background()
    deadline = time.monotonic() + OFFER_S
    try:
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except OSError:  # (the offer's time is up)
                return
            with conn:
                conn.settimeout(OFFER_S)
                try:
                    asked = _read_exactly(conn, _TOKEN_BYTES + 1)
                except OSError:
                    continue
                if not hmac.compare_digest(asked[:_TOKEN_BYTES], token):
                    continue  # not the node it was offered to: wait for that one
                if asked[_TOKEN_BYTES:] == _TAKE:
                    for f in files:  # (``socket.sendfile``: ``os.sendfile`` waiting on the socket's timeout)
                        if size := os.fstat(f.fileno()).st_size:
                            conn.sendfile(f, 0, size)
                return
    except OSError:  # the other node went meanwhile: it finds its part short and keeps nothing
        return
    finally:
        listener.close()
        _close_all(files)


def _close_all(files: list[Any]) -> None:
    for f in files:
        f.close()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        piece = conn.recv(n - len(out))
        if not piece:
            raise ConnectionError("the connection closed early")
        out += piece
    return out


def _connect(offer: PartOffer, answer: bytes) -> socket.socket:
    try:
        conn = socket.create_connection((offer.host, offer.port), timeout=OFFER_S)
    except OSError as exc:
        raise ConnectionError(f"rank {offer.rank}'s snapshot part could not be fetched from {offer.host}:{offer.port} "
                              f"({exc}): snapshots in memory move between nodes over TCP on a port of the holder's "
                              "choosing, as torch.distributed's rendezvous does; open the ports between the cluster's "
                              "nodes") from None
    conn.sendall(offer.token + answer)
    return conn


def decline(offer: PartOffer | None) -> None:
    """Tell the holder this node will not take the offered part: its thread ends, and its files close, at once."""
    if offer is not None:
        try:
            _connect(offer, _DECLINE).close()
        except OSError:
            pass


def _receive_part(folder: Path, offer: PartOffer) -> None:
    """The offered part's files, received into ``folder`` straight into their pages (each whole under another name,
    then renamed), then its json: the part is there once its json is. Raises ``ConnectionError`` when the stream ends
    short."""
    with _connect(offer, _TAKE) as conn:
        for rel, size in offer.sizes:
            dest = folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.partial")
            with open(tmp, "w+b") as f:
                if size:
                    f.truncate(size)
                    with mmap.mmap(f.fileno(), size) as m:
                        view, got = memoryview(m), 0
                        try:
                            while got < size:
                                n = conn.recv_into(view[got:], size - got)
                                if not n:
                                    raise ConnectionError(f"rank {offer.rank}'s snapshot part ended short in {rel}: "
                                                          f"{got} of {size} bytes")
                                got += n
                        finally:
                            view.release()
            os.replace(tmp, dest)
    tmp = folder / f".rank-{offer.rank}.json.partial"
    tmp.write_bytes(offer.part)
    os.replace(tmp, folder / _PART.format(rank=offer.rank))


def part_files(node_dir: str, step: int, rank: int) -> dict[str, dict] | None:
    """The files of a rank's part of ``step`` held on this node, ``{rel: {"size", its checksum}}``; None when it
    holds none."""
    held = _held(node_dir, step, rank)
    return dict(held[0][1]["files"]) if held else None


# How much of a file ``store_part`` reads at a time (the deadline is looked at between pieces).
_PIECE = 4 << 20


def store_part(node_dir: str, step: int, rank: int, rels: list[str], target_uri: str, until: float) -> dict[str, dict]:
    """Write the files ``rels`` of a rank's part of ``step`` held on this node into ``target_uri`` (a checkpoint's
    staging folder on the run's storage), each checked against the part's own checksum as it is read; returns
    ``{rel: {"size", "sha256"}}``, as a committed checkpoint's manifest lists them (the commit reads nothing back).

    Raises ``FileNotFoundError`` when the node no longer holds the part, ``CheckpointError`` when a file does not
    match its checksum, ``TimeoutError`` when ``until`` (Unix time: the stop notice's deadline) passes first. What it
    wrote then stays in staging, which is never loaded, and nothing is committed."""
    held = _held(node_dir, step, rank)
    if not held:
        raise FileNotFoundError(f"rank {rank}'s part of the snapshot of step {step} is no longer on this node")
    folder, part = held[0]
    fs, base = open_uri(target_uri)
    fs.create_dir(base, recursive=True)
    out: dict[str, dict] = {}
    for rel in rels:
        meta = part["files"][rel]
        dest = f"{base}/{rel}"
        if "/" in rel:
            fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        kind = checksum_kind(meta) or "sha256"
        sha, size = hashlib.sha256(), 0
        check = sha if kind == "sha256" else hasher(kind)  # the node's checksum of it (a snapshot's: xxh3)
        with open(folder / rel, "rb") as src, fs.open_output_stream(dest) as sink:
            while piece := src.read(_PIECE):
                if time.time() > until:
                    raise TimeoutError(f"the deadline passed while {rel} of rank {rank}'s part was written")
                sha.update(piece)
                if check is not sha:
                    check.update(piece)
                size += len(piece)
                sink.write(piece)
        if size != meta["size"] or check.hexdigest() != meta.get(kind):
            raise CheckpointError(f"{rel} of rank {rank}'s part of the snapshot of step {step} does not match its "
                                  "checksum on the node; it is not committed")
        out[rel] = {"size": size, "sha256": sha.hexdigest()}
    return out


def _write_part(folder: Path, offer: PartOffer) -> None:
    """The offered part, received into ``folder``; a part that ends short leaves none of its files."""
    try:
        _receive_part(folder, offer)
    except BaseException:
        for rel, _ in offer.sizes:
            for path in (folder / rel, (folder / rel).with_name(f".{Path(rel).name}.partial")):
                path.unlink(missing_ok=True)
        raise


def keep_peer_part(node_dir: str, step: int, rank: int, offer: PartOffer, budget: int) -> bool:
    """Keep a copy of another node's rank's part (``offer_part``'s) in ``peer/``; older copies of that rank beyond
    ``KEEP`` go. False (nothing kept, the offer declined) when it would take the node past ``budget`` bytes: what
    this node's folder holds (its ranks' parts, its peers' copies, a restore), as its ranks count it. (It counted the
    run's folder, every node's on this machine: simulated nodes share one, and on 2026-12-07 the copies of the
    bench's 576 MiB parts were declined for the other node's parts and a lost node's left there, a node lost resumed
    from storage, a drain's stop from its commit.)"""
    peer = Path(node_dir, "peer")
    prune(peer, rank, KEEP - 1)  # room first: the copies this one replaces
    if used_bytes(node_dir) + offer.nbytes > budget:
        decline(offer)
        return False
    folder = peer / snap_name(step)
    folder.mkdir(parents=True, exist_ok=True)
    failed: list[BaseException] = []

    def receive() -> None:  # (a thread of its own: a thread's niceness cannot be raised again without privileges)
        _background()
        try:
            _write_part(folder, offer)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=receive, daemon=True, name=f"raylaunch-peer-part-{step}-{rank}")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return True


def _background() -> None:
    """This thread at ``PEER_COPY_NICE``: a peer copy's 576 MiB stream (its page faults, its copy into the node's
    memory) runs on the cores the node's ranks train on, and yields them (Linux: one thread's niceness)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PEER_COPY_NICE)
    except (OSError, AttributeError):
        pass


def note_copied(node_dir: str | Path, rank: int, step: int) -> None:
    """The driver saw the copy of a rank's part of ``step`` to its peer end (kept or not): noted in the part's own
    node's folder, with this node's time, for the rank's ``auto`` (``cluster.checkpoint.memory``: its snapshot's work
    ends there); a newer step's note replaces an older one's.

    >>> import tempfile; d = tempfile.mkdtemp(); note_copied(d, 1, 8); copied(d, 1)[0], copied(d, 0)
    (8, None)
    """
    folder = Path(node_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{_COPIED.format(rank=rank)}.partial"
    tmp.write_text(f"{step} {time.time()!r}")
    os.replace(tmp, folder / _COPIED.format(rank=rank))


def copied(node_dir: str | Path, rank: int) -> tuple[int, float] | None:
    """(step, when) of the newest copy to its peer noted of a rank's part (``note_copied``); None before any."""
    try:
        step, at = Path(node_dir, _COPIED.format(rank=rank)).read_text().split()
        return int(step), float(at)
    except (OSError, ValueError):
        return None


def _steps(base: Path) -> list[int]:
    """The steps of the ``snap-*`` folders in ``base``, oldest first (none when it is not there)."""
    try:
        return sorted(s for s in (_step_of(n, "snap-") for n in os.listdir(base)) if s is not None)
    except OSError:
        return []


def _drop_part(folder: Path, rank: int) -> None:
    """A rank's part in ``folder``: its json first (the part is gone before its files), then the files no other
    rank's part of the folder names; a folder left empty goes."""
    part = _parts(folder).get(rank)
    if part is None:
        return
    (folder / _PART.format(rank=rank)).unlink(missing_ok=True)
    others = {rel for p in _parts(folder).values() for rel in p["files"]}
    for rel in part["files"]:
        if rel not in others:
            (folder / rel).unlink(missing_ok=True)
    _remove_empty(folder)


# The newest step every rank held a part of, as the driver last heard (``pin``), and the steps a rank is still writing
# its part of, in a node's folder: never pruned.
_PIN = "pinned"


def pin(node_dir: str | Path, step: int | None, writing: tuple[int, ...] = ()) -> None:
    """The driver heard every rank's part of ``step``: this node keeps its parts of it (own and peers' copies) until a
    newer one is pinned, however far a faster rank's own snapshots run ahead (a slower rank's write of hundreds of
    MiB took longer than the copy window, and the only snapshot every rank held was pruned). None: nothing pinned
    (a new attempt). ``writing``: the steps a slow rank is still writing its part of (it said so when it took them):
    the parts of those steps here are kept too, for the snapshot to be whole once it is written (a part written over
    seconds, as the model's rank writes hundreds of MiB, found the other ranks' parts of its step, a few KB written
    at once, pruned: the snapshot was never whole)."""
    folder = Path(node_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{_PIN}.partial"
    tmp.write_text(" ".join(str(s) for s in sorted(set(writing) | ({step} if step is not None else set()))))
    os.replace(tmp, folder / _PIN)


def _pinned(node_dir: Path) -> set[int]:
    try:
        return {int(s) for s in (node_dir / _PIN).read_text().split()}
    except (OSError, ValueError):
        return set()


def prune(base: Path, rank: int, keep: int, window_s: float = 0.0) -> None:
    """A rank's parts in ``base``'s ``snap-*`` folders but its newest ``keep``, those written in the last
    ``window_s`` seconds, those of a step this node keeps a peer's copy of (``peer/snap-<step>``: with it, the
    snapshot whole when the peer is lost) and the steps the driver pinned (``pin``); a folder left empty goes. A copy
    to the peer starts once the driver hears of a part (a held poll, up to a second), so a node's own parts stay as
    long as its copies may take to arrive."""
    held = [s for s in _steps(base) if rank in _parts(base / snap_name(s))]
    pinned = set(_steps(base / "peer")) if base.name != "peer" else set()
    pinned |= _pinned(base.parent if base.name == "peer" else base)
    now = time.time()
    for step in held[:max(0, len(held) - keep)]:
        if step in pinned:
            continue
        try:
            if window_s and now - os.stat(base / snap_name(step) / _PART.format(rank=rank)).st_mtime < window_s:
                continue
        except OSError:
            pass
        _drop_part(base / snap_name(step), rank)


def prune_from(base: Path, rank: int, step: int) -> None:
    """A rank's parts of ``step`` and later in ``base``: an earlier attempt's, beyond where this one resumed."""
    for s in _steps(base):
        if s >= step:
            _drop_part(base / snap_name(s), rank)


def _remove_empty(folder: Path) -> None:
    for base, dirs, files in os.walk(folder, topdown=False):
        if not files:
            try:
                os.rmdir(base)
            except OSError:
                pass


@dataclass(frozen=True)
class SnapshotPlan:
    """A snapshot a restart resumes from: its step and world size, and for each rank the nodes (by Ray node id) that
    hold its part."""

    step: int
    world_size: int
    holders: dict[int, tuple[str, ...]]


def assemble(node_dir: str, step: int, world_size: int, attempt: int, fetched: dict[int, PartOffer]) -> str:
    """Put the whole snapshot of ``step`` together in ``restore-<step>/`` on this node: the parts it holds (linked),
    those ``fetched`` from other nodes (written); a ``manifest.json`` as a committed checkpoint's, from the parts'
    own sizes and hashes. Returns the folder. Raises ``FileNotFoundError`` when a rank's part is held nowhere."""
    base = Path(node_dir)
    target = base / f"restore-{step:08d}"
    partial = base / f".restore-{step:08d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    files: dict[str, dict] = {}
    for rank in range(world_size):
        if rank in fetched:
            folder = partial / ".fetched" / str(rank)
            folder.mkdir(parents=True)
            _write_part(folder, fetched[rank])
            part, source = _parts(folder)[rank], folder
        else:
            for source in (base / snap_name(step), base / "peer" / snap_name(step)):
                part = _parts(source).get(rank)
                if part is not None:
                    break
            else:
                raise FileNotFoundError(f"rank {rank}'s part of the snapshot of step {step} is not on this node")
        for rel, meta in part["files"].items():
            if rel in files:
                continue  # a file two ranks wrote (the same content: their hashes are compared when it loads)
            dest = partial / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / rel, dest)
            except OSError:
                shutil.copyfile(source / rel, dest)
            files[rel] = meta
    shutil.rmtree(partial / ".fetched", ignore_errors=True)
    (partial / MANIFEST).write_text(json.dumps({"step": step, "attempt": attempt, "world_size": world_size,
                                                "created": time.time(), "files": files, "snapshot": True}))
    for old in base.glob("restore-*"):
        shutil.rmtree(old, ignore_errors=True)
    partial.rename(target)
    return str(target)


def drop_run(run_dir: str) -> None:
    """Every snapshot of a run on this node (its folder, the folders of other nodes of this machine too)."""
    shutil.rmtree(run_dir, ignore_errors=True)




def write_part_json(folder: str | Path, rank: int, step: int, files: dict[str, dict]) -> None:
    """A rank's part of ``step`` is whole in ``folder``: its json, written last."""
    tmp = Path(folder, f".rank-{rank}.json.partial")
    tmp.write_text(json.dumps({"step": step, "rank": rank, "files": files}))
    os.replace(tmp, Path(folder, _PART.format(rank=rank)))
