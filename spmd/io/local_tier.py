"""The local checkpoint tier: each process's own shards of the train state, every few steps, in
host memory (`/dev/shm/...`) or on a local disk, and copies of them held by peer processes.

A storage checkpoint (spmd.io.checkpoint) costs a write of the whole state to shared storage, so
runs take one every few hundred steps, and a lost host costs every process the steps since then
plus a read of the whole state. The local tier is taken every `checkpoint.local_every` steps:
each process copies the shards it holds to its host's memory and writes them beside itself, and
with `checkpoint.replicas = R` sends them to the R processes after it (process p's shards go to
p+1, ..., p+R, modulo the process count: another host whenever there are hosts), which write
them too. The copies travel as a collective permute over one device per process (the network
the job already uses), never through shared storage.

On disk, under `<local_dir>/<run name>-<hash of its path>/process-<p>/`:

    own/<step>/shards.bin          this process's shards: a JSON header (the step, the layout,
                                   every shard's array, index and offset, the step's metadata as
                                   a storage checkpoint has it) and the bytes
    own/<step>/commit.json         its size and sha256, and the layout and run id again
    peer-<q>/<step>/...            the same for process q's shards

A step is written into `<step>.tmp-<pid>` and renamed when complete; each directory keeps its
newest two steps, so a save cut short leaves a complete one everywhere (every process finished
step k's writes before any passes the collective of step k+1's save).

Restoring (`LocalTier.restore`) happens before the run reads storage: the processes exchange what
their tiers hold (one small all-gather) and pick the newest step newer than storage's newest
that is complete - every process's shards held somewhere, by itself or a peer, written for the
same devices, mesh and run. Whoever provides shards checks them against their sha256 first (a
copy that fails is treated as missing, and the choice is made again); shards held only by a peer
are sent to their owner; the restored state is then checked against the array checksums saved
in its metadata, as a storage restore is. Where the mesh or process count changed, or no step is
complete, storage is read, resharded as always.

Why not Orbax's emergency checkpoint managers: they are experimental ("do not use without
specific approval"), they replicate along a replica axis of the mesh (a data-parallel copy of
the whole state on another slice), which an FSDP layout over every device does not have, and they
save one state item, without the metadata every tier here carries (the data position, the spike
history, the goodput ledger, the checksums).
"""

import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import shutil
import time

import jax
import numpy as np

from spmd.core.errors import UserError, log
from spmd.io import checkpoint as ckpt

FORMAT = 1
KEEP = 2
DATA, COMMIT = "shards.bin", "commit.json"
CHUNK = 64 << 20  # the most bytes one collective permute moves per process
RUN_ID = ".run-id"  # in the run directory: the local tier holds steps of this run only


def base_dir(local_dir: str, run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's local tier lies under `local_dir`: one directory per run directory."""
    run = run_dir.resolve()
    return (
        pathlib.Path(local_dir).expanduser()
        / f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:8]}"
    )


def run_id(run_dir: pathlib.Path, create: bool = False) -> str | None:
    """The run's identity: a run directory deleted and made again is another run, whose local
    tier must not restore the old one's steps."""
    path = run_dir / RUN_ID
    value = path.read_text().strip() if path.is_file() else ""
    if len(value) == 16 or not create:
        return value if len(value) == 16 else None
    # Written in place, never under a temporary name: the other processes are listing the run
    # directory now (spmd.run.prepare_run_dir); a write cut short is made again next time.
    value = os.urandom(8).hex()
    path.write_text(value)
    return value


def layout(tree) -> str:
    """A digest of which slice of every array each device holds, by device id and process: equal
    digests mean every process needs exactly the shards it saved."""
    parts = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        indices = x.sharding.devices_indices_map(tuple(x.shape))
        held = sorted((d.id, d.process_index, _slices(ix, x.shape)) for d, ix in indices.items())
        parts.append([ckpt.array_key(path), list(x.shape), str(x.dtype), held])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _slices(index, shape) -> list[list[int]]:
    """[[start, stop] per dimension] of a shard's index (slices)."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


# ---------------------------------------------------------------------------------------------
# one process's shards as bytes


def pack(state, meta: dict, step: int, layout_digest: str, rid: str | None) -> np.ndarray:
    """This process's shards of `state` (each distinct slice once) and the step's metadata, as
    one byte array: an 8-byte header length, a JSON header, the shards' bytes."""
    shards = []
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        seen = set()
        for s in x.addressable_shards:
            ix = json.dumps(_slices(s.index, x.shape))
            if ix not in seen:
                seen.add(ix)
                shards.append((ckpt.array_key(path), x, ix, s.data))
    for *_, data in shards:
        data.copy_to_host_async()
    entries, blobs, offset = [], [], 0
    for key, x, ix, data in shards:
        host = np.ascontiguousarray(np.asarray(data))
        entries.append({"key": key, "shape": list(x.shape), "dtype": str(x.dtype), "index": json.loads(ix),
                        "offset": offset, "nbytes": host.nbytes})  # fmt: skip
        blobs.append(host.reshape(-1).view(np.uint8))
        offset += host.nbytes
    header = json.dumps({
        "format": FORMAT, "step": step, "process": jax.process_index(), "processes": jax.process_count(),
        "layout": layout_digest, "run_id": rid, "entries": entries, "meta": meta,
    }).encode()  # fmt: skip
    out = np.empty(8 + len(header) + offset, np.uint8)
    out[:8] = np.frombuffer(len(header).to_bytes(8, "little"), np.uint8)
    out[8 : 8 + len(header)] = np.frombuffer(header, np.uint8)
    position = 8 + len(header)
    for blob in blobs:
        out[position : position + blob.size] = blob
        position += blob.size
    return out


def header_of(payload) -> tuple[dict, int]:
    """(header, offset of the shards' bytes) of a packed payload (bytes, array or memory map)."""
    n = int.from_bytes(bytes(payload[:8]), "little")
    return json.loads(bytes(payload[8 : 8 + n])), 8 + n


def unpack(payload, target) -> dict:
    """The state laid out as `target` (ShapeDtypeStructs with this run's shardings) from this
    process's payload; every device's slice must be in it (layout() said so)."""
    header, start = header_of(payload)
    found = {(e["key"], json.dumps(e["index"])): e for e in header["entries"]}

    def build(path, want):
        key = ckpt.array_key(path)
        arrays = []
        for device, ix in want.sharding.addressable_devices_indices_map(tuple(want.shape)).items():
            e = found.get((key, json.dumps(_slices(ix, want.shape))))
            if e is None or e["dtype"] != str(want.dtype):
                raise LocalTierError(f"{key}: no saved shard for device {device.id}")
            shape = [b - a for a, b in _slices(ix, want.shape)]
            raw = payload[start + e["offset"] : start + e["offset"] + e["nbytes"]]
            host = raw.view(np.dtype(want.dtype)).reshape(shape)  # a view: device_put copies
            sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=want.sharding.memory_kind)
            arrays.append(jax.device_put(host, sharding))
        return jax.make_array_from_single_device_arrays(tuple(want.shape), want.sharding, arrays)

    return jax.tree_util.tree_map_with_path(build, target)


class LocalTierError(Exception):
    """A local step that cannot be used (the caller falls back to the next tier)."""


# ---------------------------------------------------------------------------------------------
# moving bytes between processes


def _process_devices() -> list:
    """One device per process (its lowest id), in process order."""
    first = {}
    for d in jax.devices():
        if d.process_index not in first or d.id < first[d.process_index].id:
            first[d.process_index] = d
    return [first[p] for p in range(jax.process_count())]


_permutes: dict = {}


def _permute_fn(pairs: tuple, chunk: int):
    key = (pairs, chunk)
    if key not in _permutes:
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(_process_devices()), ("process",))
        fn = jax.jit(
            jax.shard_map(
                lambda x: jax.lax.ppermute(x, "process", list(pairs)), mesh=mesh, in_specs=P("process"),
                out_specs=P("process"),
            )
        )  # fmt: skip
        _permutes[key] = (fn, NamedSharding(mesh, P("process")))
    return _permutes[key]


def send(
    payload: np.ndarray | None, pairs: list[tuple[int, int]], sizes: dict[int, int]
) -> np.ndarray | None:
    """One round of transfers: process `src` sends its `payload` to `dst` for each (src, dst) in
    `pairs` (each process sends at most once and receives at most once); `sizes[src]` is what src
    sends. Every process calls it with the same pairs and sizes. Returns what this process
    received (None if nothing)."""
    me, n = jax.process_index(), jax.process_count()
    if not pairs:
        return None
    longest = max(sizes[src] for src, _ in pairs)
    chunk = min(CHUNK, 1 << max(12, (longest - 1).bit_length()))
    fn, sharding = _permute_fn(tuple(sorted(pairs)), chunk)
    device = _process_devices()[me]
    source = next((src for src, dst in pairs if dst == me), None)
    received = np.empty(sizes[source], np.uint8) if source is not None else None
    for begin in range(0, longest, chunk):
        piece = np.zeros((1, chunk), np.uint8)
        if payload is not None and begin < payload.size:
            part = payload[begin : begin + chunk]
            piece[0, : part.size] = part
        x = jax.make_array_from_single_device_arrays((n, chunk), sharding, [jax.device_put(piece, device)])
        out = np.asarray(fn(x).addressable_shards[0].data)[0]
        if received is not None and begin < received.size:
            end = min(received.size, begin + chunk)
            received[begin:end] = out[: end - begin]
    return received


def allgather_json(obj) -> list:
    """Every process's `obj` (JSON), in process order: two small all-gathers."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[: int(k)])) for row, k in zip(every, sizes)]


def rounds(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`pairs` split into rounds in which each process sends at most once and receives at most once."""
    out: list[list[tuple[int, int]]] = []
    for src, dst in pairs:
        for r in out:
            if all(src != s and dst != d for s, d in r):
                r.append((src, dst))
                break
        else:
            out.append([(src, dst)])
    return out


# ---------------------------------------------------------------------------------------------
# the tier


@dataclasses.dataclass
class Restored:
    state: dict
    meta: dict
    step: int
    source: str  # "local" (every process its own copy) or "peer" (some from a peer's copy)
    peers: dict  # {owner: holder} for the shards that came from a peer
    seconds: float


class LocalTier:
    """One process's side of the local tier of a run (every process makes one)."""

    def __init__(self, local_dir: str, run_dir: pathlib.Path, replicas: int):
        self.base = base_dir(local_dir, run_dir)
        self.run_dir, self.replicas = run_dir, replicas
        self.me, self.n = jax.process_index(), jax.process_count()
        self.root = self.base / f"process-{self.me}"
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-tier")
        self.pending: concurrent.futures.Future | None = None
        self.warned: set[str] = set()
        self.blocking: list[float] = []  # seconds each save kept the loop waiting
        self.payload_bytes = 0  # the last save's bytes (this process's shards and metadata)
        self.rid: str | None = None  # the run's id (adopt)
        self.layout: str | None = None  # the saved state's layout digest (layout()), once known

    # -- checks and set-up ------------------------------------------------------------------

    @staticmethod
    def check(local_dir: str, replicas: int, processes: int) -> list[str]:
        """Lines for the log (one note on a single process); an error for what cannot work."""
        if replicas > processes - 1:
            raise UserError(
                f"checkpoint.replicas = {replicas} but the job has {processes} process(es): each process's local "
                f"shards can have at most {processes - 1} peer cop{'y' if processes == 2 else 'ies'}; lower "
                f"checkpoint.replicas"
            )
        return (
            ["one process: no peer holds a copy of its local checkpoints (checkpoint.replicas needs 2+)"]
            if processes == 1
            else []
        )

    def check_writable(self) -> None:
        """Make this process's directory; an error if it cannot be written (before the run writes
        anything anywhere)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            raise UserError(
                f"checkpoint.local_dir {str(self.base.parent)!r} cannot be written ({e.strerror}); give a directory "
                f"this user can write on every host (host memory such as /dev/shm/<name>, or a local disk)"
            ) from None

    def adopt(self, rid: str | None, step: int) -> None:
        """This process's directory now belongs to run `rid` (the run directory's id, made when
        it was), starting at `step`: what another run of the same directory left (an --overwrite,
        a directory deleted and made again), what a killed save left, and steps after `step` (a
        future that --resume-from went back from) are removed."""
        self.rid = rid
        self.discard_after(step)
        marker = self.root / RUN_ID
        if not marker.is_file() or marker.read_text().strip() != rid:
            for held in self.root.iterdir():
                if held.is_dir():
                    shutil.rmtree(held, ignore_errors=True)
            marker.write_text(rid or "")
        for held in self.root.glob("*/*"):
            if ".tmp-" in held.name:
                shutil.rmtree(held, ignore_errors=True)

    def discard_after(self, step: int) -> None:
        """Remove the local steps after `step` (the run went back to it: a rollback), so that no
        restore meets the abandoned trajectory."""
        self.wait()
        for directory in self.root.iterdir() if self.root.is_dir() else ():
            for held in committed(directory):
                if held > step:
                    shutil.rmtree(directory / str(held), ignore_errors=True)

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state, meta: dict) -> None:
        """Save `step`: copy this process's shards to host memory, send them to the peers, and
        hand the writes to a background thread (collectives: every process calls it)."""
        t0 = time.perf_counter()
        self.wait()  # step k's writes end before step k+1's collective: see the module doc
        meta = ckpt.sealed(meta, state)
        self.layout = self.layout or layout(state)  # a run's shardings do not change
        payload = pack(state, meta, step, self.layout, self.rid)
        copies = []
        if self.replicas and self.n > 1:
            from jax.experimental import multihost_utils

            sizes = np.asarray(multihost_utils.process_allgather(np.int64(payload.size))).ravel()
            for k in range(1, self.replicas + 1):
                pairs = [(p, (p + k) % self.n) for p in range(self.n)]
                got = send(payload, pairs, {p: int(sizes[p]) for p in range(self.n)})
                copies.append(((self.me - k) % self.n, got))
        self.pending = self.writer.submit(self._write_all, step, payload, copies)
        self.blocking.append(time.perf_counter() - t0)
        self.payload_bytes = payload.size

    def _write_all(self, step: int, payload: np.ndarray, copies: list) -> None:
        self._write(self.root / "own", step, payload)
        for owner, data in copies:
            self._write(self.root / f"peer-{owner}", step, data)

    def _write(self, directory: pathlib.Path, step: int, payload: np.ndarray) -> None:
        header, _ = header_of(payload)
        tmp = directory / f"{step}.tmp-{os.getpid()}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            write_file(tmp / DATA, payload)
            commit = {"format": FORMAT, "step": step, "nbytes": int(payload.size),
                      "sha256": hashlib.sha256(memoryview(payload)).hexdigest(), "layout": header["layout"],
                      "run_id": header["run_id"], "process": header["process"]}  # fmt: skip
            (tmp / COMMIT).write_text(json.dumps(commit))
            final = directory / str(step)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in committed(directory)[:-KEEP]:
            shutil.rmtree(directory / str(old), ignore_errors=True)

    def wait(self) -> None:
        """Wait for the writes in flight; a failed one (a full disk) is a warning, once per cause:
        the storage tier goes on."""
        if self.pending is None:
            return
        future, self.pending = self.pending, None
        try:
            future.result()
        except OSError as e:
            cause = e.strerror or str(e)
            if cause not in self.warned:
                self.warned.add(cause)
                log(
                    f"warning: a local checkpoint could not be written to {self.root} ({cause}); training and "
                    f"storage checkpoints go on, and restores use what the tiers still hold"
                )

    def close(self) -> None:
        self.wait()
        self.writer.shutdown()

    # -- restoring ---------------------------------------------------------------------------

    def inventory(self, rid: str | None) -> dict:
        """{"own": {step: [nbytes, layout, sha256]}, "copies": {owner: {step: ...}}} of the
        committed steps of this run whose files are whole (checked by size; sha256 later)."""
        out = {"own": {}, "copies": {}}
        if rid is None or not self.root.is_dir():
            return out
        for directory in sorted(self.root.iterdir()):
            if directory.name == "own":
                held = out["own"]
            elif directory.name.startswith("peer-") and directory.name[5:].isdigit():
                held = out["copies"].setdefault(directory.name[5:], {})
            else:
                continue
            for step in committed(directory):
                commit = read_commit(directory / str(step))
                if commit is not None and commit["run_id"] == rid:
                    held[str(step)] = [commit["nbytes"], commit["layout"], commit["sha256"]]
        return out

    def restore(self, target, newer_than: int, notes: list[str]) -> Restored | None:
        """The newest complete local step newer than `newer_than` (storage's newest, -1 for
        none), laid out as `target`; None where there is none (`notes` say why, when a step was
        there but could not be used). Every process calls it."""
        t0 = time.perf_counter()
        want = layout(target)
        rid = run_id(self.run_dir)
        inventories = allgather_json(self.inventory(rid))
        bad: set[tuple[int, int, int]] = set()  # (holder, owner, step) that failed their sha256
        loaded: dict[int, np.ndarray] = {}  # {owner: its shards of the chosen step}, read and checked here
        other_layout = sorted(
            {int(s) for inv in inventories for held in [inv["own"], *inv["copies"].values()]
             for s, (_, lay, _) in held.items() if lay != want and int(s) > newer_than}
        )  # fmt: skip
        while True:
            choice = plan(inventories, want, self.n, newer_than, bad)
            if choice is None:
                if other_layout:
                    notes.append(
                        f"local checkpoints (step {other_layout[-1]}) were written for another mesh, rules or process "
                        f"count: not used"
                    )
                return None
            step, holders = choice
            # what this process provides: its own shards, and the copies it holds that others need
            provide = [owner for owner, holder in holders.items() if holder == self.me]
            ok = {owner: self._load(owner, step, loaded) is not None for owner in provide}
            verdicts = allgather_json({str(k): v for k, v in ok.items()})
            failed = [(holders[int(o)], int(o), step) for v in verdicts for o, fine in v.items() if not fine]
            if not failed:
                break
            bad |= set(failed)
            for holder, owner, s in failed:
                if holder == self.me:
                    notes.append(
                        f"warning: the local copy of process {owner}'s shards of step {s} failed its sha256: not used"
                    )
        mine = loaded.get(self.me) if holders[self.me] == self.me else None
        peers = {owner: holder for owner, holder in holders.items() if holder != owner}
        for group in rounds([(holder, owner) for owner, holder in sorted(peers.items())]):
            source = next((src for src, dst in group if dst == self.me), None)
            sending = next((dst for src, dst in group if src == self.me), None)
            payload = loaded.get(sending)
            sizes = {src: entry(inventories, src, dst, step)[0] for src, dst in group}
            got = send(payload, group, sizes)
            if source is not None:
                mine = got
        received = holders[self.me] != self.me  # what was read here, _load has checked
        if received and (
            hashlib.sha256(memoryview(mine)).hexdigest()
            != entry(inventories, holders[self.me], self.me, step)[2]
        ):
            raise UserError(
                f"local checkpoint of step {step}: process {self.me}'s shards arrived damaged; restart the job"
            )
        header, _ = header_of(mine)
        meta = header["meta"]
        where = self.root / "own"
        problem = ""
        try:
            ckpt.check_meta(where, step, meta)
            state = unpack(mine, target)
        except (UserError, LocalTierError) as e:
            problem = str(e)
        problems = [p for p in allgather_json(problem) if p]  # every process takes the same way
        if not problems:
            try:  # global checksums: the same verdict on every process
                ckpt.check_checksums(where, step, state, meta)
            except UserError as e:
                problems = [str(e)]
        if problems:
            notes.append(
                f"warning: the local checkpoint of step {step} cannot be used ({problems[0]}): restoring from storage"
            )
            return None
        return Restored(state, meta, step, "peer" if peers else "local", peers, time.perf_counter() - t0)

    def _path(self, owner: int, step: int) -> pathlib.Path:
        return self.root / ("own" if owner == self.me else f"peer-{owner}") / str(step)

    def _load(self, owner: int, step: int, loaded: dict) -> np.ndarray | None:
        """`owner`'s shards of `step` as held here, read once and checked against their sha256
        (kept in `loaded` for the transfers); None where they cannot be read or fail."""
        commit = read_commit(self._path(owner, step))
        try:
            data = np.fromfile(self._path(owner, step) / DATA, np.uint8)
        except OSError:
            return None
        if commit is None or hashlib.sha256(memoryview(data)).hexdigest() != commit["sha256"]:
            return None
        loaded[owner] = data
        return data


def entry(inventories: list[dict], holder: int, owner: int, step: int) -> list:
    """[nbytes, layout, sha256] of `owner`'s shards of `step` as `holder` listed them."""
    inv = inventories[holder]
    held = inv["own"] if holder == owner else inv["copies"][str(owner)]
    return held[str(step)]


def plan(inventories: list[dict], want: str, n: int, newer_than: int, bad=frozenset()):
    """(step, {owner: holder}) for the newest step newer than `newer_than` whose shards every
    process can get (its own copy first, else the first peer holding one), in layout `want`;
    None where there is none. `bad`: (holder, owner, step) copies that failed their sha256."""
    if len(inventories) != n:
        return None
    steps = sorted(
        {int(s) for inv in inventories for held in [inv["own"], *inv["copies"].values()] for s in held},
        reverse=True,
    )
    for step in steps:
        if step <= newer_than:
            break
        holders = {}
        for owner in range(n):
            candidates = [owner] + [(owner + k) % n for k in range(1, n)]
            for holder in candidates:
                inv = inventories[holder]
                held = inv["own"] if holder == owner else inv["copies"].get(str(owner), {})
                listed = held.get(str(step))
                if listed is not None and listed[1] == want and (holder, owner, step) not in bad:
                    holders[owner] = holder
                    break
            else:
                break
        if len(holders) == n:
            return step, holders
    return None


def committed(directory: pathlib.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / COMMIT).is_file())


def read_commit(path: pathlib.Path) -> dict | None:
    """A step directory's commit record, None where it is missing, unreadable or does not match
    the size of its data (a copy cut short, a damaged disk)."""
    try:
        commit = json.loads((path / COMMIT).read_text())
        if (path / DATA).stat().st_size != commit["nbytes"]:
            return None
        return commit
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_file(path: pathlib.Path, payload: np.ndarray) -> None:
    """Write `payload` whole; a disk that fills up raises OSError (ENOSPC)."""
    with open(path, "wb") as f:
        view = memoryview(payload)
        written = 0
        while written < len(view):
            n = f.write(view[written : written + (1 << 26)])
            if not n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            written += n
