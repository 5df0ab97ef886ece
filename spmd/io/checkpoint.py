"""Checkpoints: Orbax CheckpointManager, async and atomic, restored onto any mesh.

Layout: `<run-dir>/checkpoints/<step>/{state,meta}`. `state` is the train state pytree
(params, optimizer state, step); `meta` is JSON: the data position, the seed, and the resolved
config, mesh and rules of the run that wrote it. Orbax writes a step into
`<step>.orbax-checkpoint-tmp-*` and renames it when complete, so only committed steps are ever
listed or restored.

Restoring passes a target of `ShapeDtypeStruct`s carrying the *new* run's shardings: each device
reads just the chunks of its own shards (TensorStore), whatever mesh, rules, device count or
process count wrote the checkpoint.

There is no random state beyond the seed: parameters are initialised from the seed, and the data
position is `consumed_samples` (the batch at step s starts at sample
`consumed_samples + (s - step) * global_batch_size` of the seed's shuffled order).
"""

import contextlib
import hashlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from orbax.checkpoint._src.metadata import array_metadata_store

from spmd.assembly.config import CheckpointConfig
from spmd.core.errors import UserError, stderr_parked
from spmd.training import transform

SUBDIR = "checkpoints"
TMP_MARK = ".orbax-checkpoint-tmp"
META_VERSION = 1

# Orbax logs routine progress (and read-only notices) as absl warnings, and a failed background
# save as several error tracebacks; the CLI's stderr is for our own lines and the one `error:`
# that SaveError and UserError become.
absl_logging.set_verbosity(absl_logging.FATAL)


def _quiet_closed_loops() -> None:
    """When a background save fails, Orbax closes its asyncio loop while TensorStore is still
    completing the other writes; each completion then raises "Event loop is closed" in a native
    callback, which Python reports as unraisable (a traceback per array). The failure itself
    reaches us through check_for_errors and becomes one SaveError line, so those echoes are
    dropped; every other unraisable exception is reported as before."""
    previous = sys.unraisablehook
    if getattr(previous, "spmd_quiet", False):
        return

    def hook(unraisable):
        if (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        ):
            return
        previous(unraisable)

    hook.spmd_quiet = True
    sys.unraisablehook = hook


_quiet_closed_loops()  # failed reads of a damaged checkpoint echo the same way


class SaveError(UserError):
    """A checkpoint could not be written (disk full, permissions): training stops, exit code 3."""

    exit_code = 3


def _manager(
    directory: pathlib.Path,
    cfg: CheckpointConfig | None = None,
    read_only: bool = False,
    partial: bool = False,
):
    """`partial`: the state item read with the PyTree handler, which can restore a subtree (the
    on-disk format is the standard handler's; it wraps the PyTree one). Writers use the PyTree
    handler too, without compression: zstd on float weights saved ~8% of disk and cost 2-6x the
    save time (and CPU that an async save takes from training); readers take either."""
    cfg = cfg or CheckpointConfig()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # retention is Checkpointer.prune's: it knows spikes and eval losses
        enable_async_checkpointing=cfg.async_save,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    if not read_only:
        registry = {"type_handler_registry": _cpu_registry()} if jax.default_backend() == "cpu" else {}
        state = ocp.PyTreeCheckpointHandler(use_compression=False, **registry)
    else:
        state = ocp.PyTreeCheckpointHandler() if partial else ocp.StandardCheckpointHandler()
    handlers = {"state": state, "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory.resolve(), options=options, item_handlers=handlers)


def _cpu_registry() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's handlers, with replica-parallel saving off (as Orbax itself has it on GPU).

    Replica-parallel saving splits a shard that several devices hold among them, each writing its
    part: a compiled slice program per device and array shape. On CPU the devices are one host's
    memory and the process writes all of them anyway, so the split parallelises nothing, and its
    programs cost seconds of compilation at a run's first save. The files written are the same:
    every shard whole, by the replica 0 that holds it."""
    arrays = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
    )
    scalars = ocp.type_handlers.ScalarHandler()
    return ocp.type_handlers.create_type_handler_registry(
        (int, scalars),
        (float, scalars),
        (bytes, scalars),
        (np.number, scalars),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, arrays),
        (str, ocp.type_handlers.StringHandler()),
    )


def run_dir_of(directory: pathlib.Path) -> pathlib.Path:
    """The run directory a checkpoints directory (as `locate` returns it) belongs to: where the
    run's other files (config, tokenizer) lie."""
    return directory.parent if directory.name == SUBDIR else directory


def committed_steps(directory: pathlib.Path) -> list[int]:
    """Steps whose checkpoint finished (renamed from its temporary name)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def kept_checkpoints(directory: pathlib.Path) -> str:
    """What a run stopped by a failed write tells the user it keeps: "the committed checkpoints
    (2, 4) are intact" (or "(none)")."""
    kept = ", ".join(map(str, committed_steps(directory))) or "none"
    return f"the committed checkpoints ({kept}) are intact"


def uncommitted(directory: pathlib.Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name)


def locate(path: str) -> tuple[pathlib.Path, int]:
    """(checkpoints directory, step) for a run-dir, its checkpoints dir, or one step of it."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise UserError(f"checkpoint path {str(p)!r} not found")
    if TMP_MARK in p.name:
        raise UserError(
            f"checkpoint {str(p)!r} was never committed (its save did not finish); pick a committed step"
        )
    if p.name.isdigit() and (p / "state").exists():
        return p.parent, int(p.name)
    directory = p / SUBDIR if (p / SUBDIR).is_dir() else p
    steps = committed_steps(directory)
    if not steps:
        tmp = uncommitted(directory)
        extra = f" (only uncommitted: {', '.join(tmp)})" if tmp else ""
        raise UserError(f"no committed checkpoint under {str(p)!r}{extra}")
    return directory, steps[-1]


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _array_checksum(x) -> jax.Array:
    """Two 32-bit lanes: the wrapping sum over elements of a hash of (bits, flat position). A sum
    does not depend on how the array is split, so the figure is the same on every mesh, device and
    process count, computed where the shards live (one all-reduce of 8 bytes)."""
    # Host-offloaded state (optimizer.offload) is hashed on the device, like the rest.
    x = jax.device_put(x, jax.memory.Space.Device)
    if x.dtype.itemsize == 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    else:
        bits = x.astype(jnp.uint32)
    position, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for d in reversed(range(x.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
        stride *= x.shape[d]
    spread = position * jnp.uint32(0x9E3779B9)
    lanes = tuple(_fmix32(bits ^ _fmix32(spread + jnp.uint32(seed))) for seed in (1, 2))
    # One two-operand reduction: XLA fuses the hashing into it (two separate sums materialised
    # each lane, 2x the array in temporaries).
    sums = jax.lax.reduce(
        lanes, (jnp.uint32(0), jnp.uint32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim))
    )
    return jnp.stack(sums)


@jax.jit
def _checksums(tree):
    return jax.tree.map(_array_checksum, tree)


def checksums(tree) -> dict[str, str]:
    """{array path: 16 hex digits}, identical for the same values on any sharding (see
    _array_checksum). Written into every checkpoint's metadata at save time and checked against
    what every restore and `spmd-ckpt verify` read back."""
    sums = jax.device_get(_checksums(tree))
    return {
        array_key(path): f"{int(v[0]):08x}{int(v[1]):08x}"
        for path, v in jax.tree_util.tree_leaves_with_path(sums)
    }


META_DIGEST = "meta_sha256"


def meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed(meta: dict, state) -> dict:
    """`meta` as every tier saves it with `state`: with its arrays' checksums and its own digest."""
    meta = {**meta, "checksums": checksums(state)}
    meta[META_DIGEST] = meta_digest(meta)
    return meta


# Read checkpoints whose metadata lacks its digest or the arrays' checksums (`--trust-unverified`):
# every checkpoint this version writes has both, so one without them was damaged or made by hand.
_trust_unverified = False


def trust_unverified(on: bool = True) -> None:
    """Let readers load checkpoints that carry no digest or checksums (the caller says so aloud)."""
    global _trust_unverified
    _trust_unverified = on


def unverified(meta: dict) -> list[str]:
    """What `meta` lacks of the integrity record every save writes: its digest, the checksums."""
    return [k for k in (META_DIGEST, "checksums") if not meta.get(k)]


def check_meta(directory: pathlib.Path, step: int, meta: dict, required=()) -> dict:
    """`meta` if it is what was saved for this step (its digest, its step number, the keys the
    caller needs, the checksums of its arrays), else an error saying what is wrong."""
    where = f"checkpoint {directory}/{step}"
    if META_DIGEST in meta and meta[META_DIGEST] != meta_digest(meta):
        raise UserError(
            f"{where}: its metadata was edited or is corrupt (digest mismatch); restore an earlier step"
        )
    if "step" in meta and meta["step"] != step:
        raise UserError(
            f"{where}: its metadata is for step {meta['step']}; the step directory was renamed or copied "
            f"over: restore the step it was written as"
        )
    for key in required:
        if key not in meta or (key != "run" and not isinstance(meta[key], int)):
            raise UserError(f"{where}: its metadata has no valid {key!r}; it was not written by spmd-train")
    if "run" in required and "config" not in meta["run"]:
        raise UserError(f"{where}: its metadata has no run config; it was not written by spmd-train")
    _refuse_unverified(where, meta)
    return meta


def _refuse_unverified(where: str, meta: dict) -> None:
    missing = unverified(meta)
    if missing and not _trust_unverified:
        raise UserError(
            f"{where}: its metadata has no {' and no '.join(missing)}, so what it holds cannot be checked "
            f"(every save writes them: it was damaged or edited); restore another step, or pass "
            f"--trust-unverified to read it unchecked"
        )


def check_checksums(directory: pathlib.Path, step: int, tree, meta: dict) -> None:
    """An error naming the first array whose values differ from what was saved, or that has no
    saved checksum (unless trust_unverified: check_meta has refused a checkpoint without them)."""
    _refuse_unverified(f"checkpoint {directory}/{step}", meta)
    saved = meta.get("checksums") or {}
    for key, value in checksums(tree).items():
        if key not in saved and not _trust_unverified:
            raise UserError(
                f"checkpoint {directory}/{step}: {key} has no checksum in the metadata, so it cannot be "
                f"checked; restore another step, or pass --trust-unverified to read it unchecked"
            )
        if key in saved and saved[key] != value:
            raise UserError(
                f"checkpoint {directory}/{step}: {key} does not match the checksum saved with it "
                f"(saved {saved[key]}, read {value}): its data is corrupt; restore an earlier step "
                f"(--resume-from {directory}/<step>)"
            )


class Checkpointer:
    """Saves a run's checkpoints; one per run, process-wide (every process calls save)."""

    def __init__(self, run_dir: pathlib.Path, cfg: CheckpointConfig):
        self.directory = run_dir / SUBDIR
        self.cfg = cfg
        self.manager = _manager(self.directory, cfg)
        self.last_saved: int | None = self.manager.latest_step()
        self.pending: int | None = None  # the step of the save in flight (or last started)
        self.failed: SaveError | None = None
        # What retention needs of the committed steps: each one's eval loss, and the run's first
        # step with a spike or a non-finite loss (the newest checkpoint before it is kept).
        self.eval_losses: dict[int, float] = {}
        self.first_anomaly: int | None = None
        self.healthy: set[int] = set()  # steps whose loss was healthy (spmd.loop.spikes)
        for step in committed_steps(self.directory):
            with contextlib.suppress(UserError):
                self.note(step, read_meta(self.directory, step))

    def note(self, step: int, meta: dict) -> None:
        """What retention needs of one checkpoint's metadata."""
        if isinstance(meta.get("eval_loss"), (int, float)):
            self.eval_losses[step] = float(meta["eval_loss"])
        if (meta.get("spikes") or {}).get("healthy") is not False:  # older records: no verdict
            self.healthy.add(step)
        anomaly = (meta.get("spikes") or {}).get("first_anomaly")
        if isinstance(anomaly, int):
            self.first_anomaly = anomaly if self.first_anomaly is None else min(self.first_anomaly, anomaly)

    def keep(self, steps: list[int]) -> set[int]:
        """Which of the committed `steps` retention keeps: the newest keep_last, every keep_every-th,
        the keep_best lowest eval losses, the newest step before the first anomaly, and the newest
        step whose loss was healthy (a loss that climbed since never rotates it away)."""
        cfg = self.cfg
        kept = set(steps[-cfg.keep_last :])
        if cfg.keep_every:
            kept |= {s for s in steps if s % cfg.keep_every == 0}
        if cfg.keep_best:
            evaluated = sorted((self.eval_losses[s], s) for s in steps if s in self.eval_losses)
            kept |= {s for _, s in evaluated[: cfg.keep_best]}
        if self.first_anomaly is not None:
            before = [s for s in steps if s < self.first_anomaly]
            kept |= set(before[-1:])
        kept |= set([s for s in steps if s in self.healthy][-1:])
        return kept

    def prune(self, in_flight: int | None = None) -> None:
        """Delete the committed checkpoints retention does not keep (every process calls it)."""
        steps = [s for s in committed_steps(self.directory) if s != in_flight]
        for step in sorted(set(steps) - self.keep(steps)):
            self.manager.delete(step)
            self.eval_losses.pop(step, None)
            self.healthy.discard(step)

    def check(self) -> None:
        """Raise SaveError if a background save has failed (returns at once otherwise)."""
        if self.failed is not None:
            raise self.failed
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 — Orbax re-raises whatever its writer threads hit
            self._fail(self.pending, e)

    def _fail(self, step, e: Exception):
        """Remove what the failed save left, then raise (and remember) one SaveError."""
        import shutil

        if jax.process_index() == 0:
            for name in uncommitted(self.directory):
                shutil.rmtree(self.directory / name, ignore_errors=True)
        self.failed = SaveError(
            f"the checkpoint for step {step} could not be written to {self.directory}: {_cause(e)}; "
            f"training stopped; {kept_checkpoints(self.directory)}"
        )
        raise self.failed from None

    def save(self, step: int, state, meta: dict) -> None:
        self.check()
        if self.last_saved == step:
            return
        meta = sealed(meta, state)
        self.note(step, meta)
        if self.cfg.async_save and jax.devices()[0].platform == "cpu":
            # On an accelerator Orbax copies the arrays to host memory before save() returns. On CPU
            # they already are host memory, so it writes from the live buffers; the next step donates
            # them and must wait for the whole write (several steps' time). A copy frees them.
            state = jax.tree.map(lambda x: x.copy(), state)
        previous, self.pending = self.pending, step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
        except Exception as e:  # noqa: BLE001 — this write failed, or (reported now) the one before it
            earlier = previous is not None and previous not in committed_steps(self.directory)
            self._fail(previous if earlier else step, e)
        self.last_saved = step
        self.prune(in_flight=step if self.cfg.async_save else None)

    def idle(self) -> bool:
        """No save in flight on any process (a continuous save starts now): every process asks
        at the same step, and all get the same answer."""
        busy = self.manager.is_saving_in_progress()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            busy = bool(np.asarray(multihost_utils.process_allgather(np.int32(busy))).any())
        return not busy

    def wait(self) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._fail(self.pending, e)

    def close(self) -> None:
        """Wait for the last save and release the manager. After a failure the manager is left
        open: closing it under a failed save's threads makes them print tracebacks, and the
        command exits next (as _read_state does for a failed read)."""
        if self.failed is None:
            self.wait()
            self.prune()
            self.manager.close()


def read_meta(directory: pathlib.Path, step: int) -> dict:
    manager = _manager(directory, read_only=True)
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 — any failure to read is a broken checkpoint to the user
        _check_still_there(directory, step)
        raise UserError(
            f"checkpoint {directory}/{step} has unreadable metadata ({_first_line(e)}); run spmd-ckpt verify"
        ) from None
    manager.close()
    return check_meta(directory, step, meta)


def saved_arrays(directory: pathlib.Path, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{path: (shape, dtype)} of the saved train state, from Orbax's metadata."""
    manager = _manager(directory, read_only=True)
    try:
        tree = manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001
        _check_still_there(directory, step)
        raise UserError(
            f"checkpoint {directory}/{step} is incomplete or corrupt ({_first_line(e)}); run spmd-ckpt verify"
        ) from None
    manager.close()
    if tree is None:
        raise UserError(f"checkpoint {directory}/{step} has no state; it is incomplete")
    return {
        array_key(path): (tuple(m.shape), str(m.dtype))
        for path, m in jax.tree_util.tree_leaves_with_path(tree)
    }


def array_key(path) -> str:
    """'opt_state/1/0/mu/embed_VD': one spelling for dict keys, sequence indices and NamedTuple fields
    (Orbax's metadata turns NamedTuple fields into dict keys)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def check_compatible(directory: pathlib.Path, step: int, abstract_state, partial: bool = False) -> None:
    """An error naming the first parameter whose saved shape differs from this config's.
    `partial`: `abstract_state` is a subtree (e.g. only the params), so extra saved arrays are fine."""
    saved = saved_arrays(directory, step)
    wanted = {
        array_key(path): (tuple(x.shape), str(x.dtype))
        for path, x in jax.tree_util.tree_leaves_with_path(abstract_state)
    }
    # The parameters first: their names say which part of the model differs (an optimizer-state
    # array of the same parameter would say it less plainly).
    for key, (shape, dtype) in sorted(wanted.items(), key=lambda kv: not kv[0].startswith("params")):
        if key not in saved:
            raise UserError(
                f"checkpoint {directory}/{step} has no array {key} that this config needs; {_differs(key)}"
            )
        if saved[key][0] != shape:
            per_slice = any(k.startswith("sync/") for k in (*saved, *wanted))
            raise UserError(
                f"checkpoint {directory}/{step}: {key} has shape {saved[key][0]} but this config "
                f"needs {shape}; "
                + (
                    "a [sync] state holds a row per slice: resume on as many slices, or start from its "
                    "parameters with --init-from (the replicas, optimizer state and residuals start afresh: "
                    "docs/slices.md)"
                    if per_slice
                    else "use the config the checkpoint was written with"
                )
            )
        if saved[key][1] != dtype and not partial:  # a parameters-only read casts (e.g. --init-from)
            raise UserError(
                f"checkpoint {directory}/{step}: {key} was saved as {saved[key][1]} but this config "
                f"needs {dtype} (model.param_dtype?); resume with the dtype it was written with, or "
                f"start from its parameters with --init-from"
            )
    extra = sorted(set(saved) - set(wanted))
    if extra and not partial:
        raise UserError(
            f"checkpoint {directory}/{step} holds {extra[0]}, which this config does not have; {_differs(extra[0])}"
        )


def _differs(key: str) -> str:
    """What an array present on one side only says about the two configs."""
    if key.startswith("opt_state"):
        return (
            "the optimizer state is laid out by other optimizer settings (optimizer.name, state_dtype, "
            "grad_clip on or off, ...): resume with the settings it was written with, or start from its "
            "parameters with --init-from"
        )
    return "it was written by a different model config (spmd-ckpt inspect names it)"


def restore(directory: pathlib.Path, step: int, target) -> tuple[dict, dict]:
    """(state laid out as `target`, meta); `target` holds ShapeDtypeStructs with the new shardings
    (Trainer.abstract_state). Each device reads only the chunks of its shards."""
    check_compatible(directory, step, target)
    state, meta = _read_state(directory, step, ocp.args.StandardRestore(target), partial=False)
    check_checksums(directory, step, state, meta)
    return state, meta


def restore_params(directory: pathlib.Path, step: int, abstract_params) -> tuple[dict, dict]:
    """(parameters laid out as `abstract_params`, meta): only the parameters are read, never the
    optimizer state (evaluation, sampling, or a fresh optimizer from trained weights). They are
    read in the dtype they were saved in, checked against their checksums, then cast to the
    dtypes `abstract_params` asks for."""
    target = {"params": abstract_params}
    check_compatible(directory, step, target, partial=True)
    saved = saved_arrays(directory, step)
    as_saved = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, saved[array_key(path)][1], sharding=x.sharding), target
    )
    args = ocp.args.PyTreeRestore(
        item=as_saved,
        restore_args=ocp.checkpoint_utils.construct_restore_args(as_saved),
        partial_restore=True,
    )
    state, meta = _read_state(directory, step, args, partial=True)
    check_checksums(directory, step, state, meta)
    params = jax.tree.map(
        lambda x, want: x if x.dtype == want.dtype else x.astype(want.dtype), state["params"], abstract_params
    )
    return params, meta


def restore_weights(directory: pathlib.Path, step: int, abstract_params, fresh, meta: dict | None = None):
    """(the model's weights at a checkpoint, laid out as `abstract_params`, meta): its parameters.
    A run whose model transforms froze part of the model (spmd.training.transform) saved only what
    trained: its weights are those it started from with the trained parameters put back and its
    transforms merged (low-rank adapters folded in). `abstract_params` is the model without
    transforms; `fresh(seed)` draws it from a seed (a run that did not start from a checkpoint)."""
    if meta is None:
        meta = check_meta(directory, step, read_meta(directory, step), ("run",))
    run = meta.get("run", {})
    transforms = transform.of_record(run.get("config", {}))
    if not transforms:
        return restore_params(directory, step, abstract_params)
    start = starting_weights(run, abstract_params, fresh, f"checkpoint {directory}/{step}")
    frozen_dtype = transform.Partition(transforms).frozen_dtype
    if frozen_dtype:  # the frozen weights were held, and trained against, in this dtype
        start = jax.tree.map(lambda x: x.astype(frozen_dtype).astype(x.dtype), start)
    mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
    trained, meta = read_trained(
        directory, step, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    shardings = jax.tree.map(lambda x: x.sharding, abstract_params)
    merged = jax.jit(
        lambda t, w: transform.merged(transform.combine(t, w), transforms), out_shardings=shardings
    )(trained, start)
    return merged, meta


def read_trained(directory: pathlib.Path, step: int, sharding) -> tuple[dict, dict]:
    """(the parameters a checkpoint holds, as saved, each whole with `sharding`, meta): for a run
    that froze part of its model, what trained (low-rank adapters are small, so every device may
    hold them)."""
    saved = {
        k[len("params/") :]: v for k, v in saved_arrays(directory, step).items() if k.startswith("params/")
    }
    tree = {}
    for key, (shape, dtype) in saved.items():
        *parents, name = key.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return restore_params(directory, step, tree)


def restore_model(directory: pathlib.Path, step: int, plan, meta: dict | None = None):
    """`restore_weights` for a plan of a model without transforms (evaluation, sampling, export)."""

    def fresh(seed):  # canonical layer order, as checkpoints hold the weights
        return jax.jit(lambda: plan.canonical_init_params(seed), out_shardings=plan.param_shardings)()

    return restore_weights(directory, step, plan.abstract_params, fresh, meta)


def params_digest(meta: dict) -> str:
    """The identity of a checkpoint's parameters: a digest of their arrays' checksums (the same
    values give the same digest on any mesh)."""
    sums = {k: v for k, v in sorted((meta.get("checksums") or {}).items()) if k.startswith("params/")}
    return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]


def starting_weights(run: dict, abstract_params, fresh, where: str):
    """The weights a run started from (laid out as `abstract_params`), from its checkpoint's `run`
    record: the checkpoint it started from (`init_from`, itself possibly a transformed run: its
    parameters' digest pinned when the run started), else drawn from the seed the run started with
    (pinned in `init_from` too; older records: the config's train.seed). They are what a run's
    frozen parameters (and a preference objective's reference) still are."""
    origin = run.get("init_from") or {}
    if "path" not in origin:
        return fresh(int(origin.get("seed", run["config"].get("train", {}).get("seed", 0))))
    try:
        directory, step = locate(origin["path"])
    except UserError:
        raise UserError(
            f"{where} holds only the parameters its run trained, on frozen weights from {origin['path']}, "
            f"which is gone; restore that checkpoint to its place (the trained parameters alone are not the model)"
        ) from None
    weights, meta = restore_weights(directory, step, abstract_params, fresh)
    if origin.get("digest") and params_digest(meta) != origin["digest"]:
        raise UserError(
            f"{where} was trained on the weights of {origin['path']} with digest {origin['digest']}, but the "
            f"checkpoint there now holds others (digest {params_digest(meta)}): it was replaced; put the original "
            f"back to resume, evaluate or export this run, or start a new run from the new weights with --init-from"
        )
    return weights


def unsaved_of(trainer, meta: dict, where: str) -> dict:
    """The parts of a train state checkpoints do not hold (Trainer.unsaved: the frozen
    parameters, a preference objective's reference model) for a checkpoint with `meta`: from the
    weights its run started from, in the dtypes the trainer holds them in ({} where there are none)."""
    if not trainer.unsaved:
        return {}
    weights = starting_weights(meta.get("run", {}), trainer.abstract_weights, trainer.fresh_weights, where)
    return trainer.unsaved_from(weights)


class Rotated(UserError):
    """A checkpoint deleted while it was being read: a live run's retention rotated it away."""


def _check_still_there(directory: pathlib.Path, step: int) -> None:
    if not (directory / str(step)).exists():
        raise Rotated(
            f"checkpoint {directory}/{step} was deleted while being read (the run's checkpoint retention rotated it "
            f"away); read a newer step (spmd-ckpt inspect {directory.parent} lists them)"
        )


def _read_state(directory: pathlib.Path, step: int, state_args, partial: bool) -> tuple[dict, dict]:
    manager = _manager(directory, read_only=True, partial=partial)
    try:
        with stderr_parked():
            out = manager.restore(
                step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
            )
    except Exception as e:  # noqa: BLE001
        # Not closing the manager: its reader threads may still be failing; the CLI exits now.
        _check_still_there(directory, step)
        raise UserError(
            f"checkpoint {directory}/{step} could not be read ({_first_line(e)}); "
            f"it is corrupt or incomplete: run spmd-ckpt verify, or pass an earlier step to --resume-from"
        ) from None
    manager.close()
    return out["state"], out["meta"]


def verify(directory: pathlib.Path, step: int) -> tuple[int, int, str]:
    """Read every array of one committed step onto one device and check it against the metadata:
    (arrays, bytes) read and what could not be checked ('' when everything was: only under
    trust_unverified can it be more), or an error naming the first array that is unreadable,
    misshapen, not finite or different from its saved checksum."""
    meta = read_meta(directory, step)
    saved_arrays(directory, step)  # readable metadata
    manager = _manager(directory, read_only=True)
    try:
        metadata = manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001
        _check_still_there(directory, step)
        raise UserError(f"checkpoint {directory}/{step} is corrupt: {_first_line(e)}") from None
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    try:
        with stderr_parked():
            state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
                "state"
            ]
    except Exception as e:  # noqa: BLE001 (the manager stays open: see _read_state)
        _check_still_there(directory, step)
        raise UserError(f"checkpoint {directory}/{step} is corrupt: {_first_line(e)}") from None
    manager.close()
    n_bytes = 0
    for (path, m), x in zip(jax.tree_util.tree_leaves_with_path(metadata), jax.tree.leaves(state)):
        x = np.asarray(x)
        if x.shape != tuple(m.shape) or x.dtype != np.dtype(m.dtype):
            raise UserError(
                f"checkpoint {directory}/{step}: {array_key(path)} reads as {x.dtype}{list(x.shape)} "
                f"but its metadata says {m.dtype}{list(m.shape)}"
            )
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise UserError(f"checkpoint {directory}/{step}: {array_key(path)} holds NaN or Inf")
        n_bytes += x.nbytes
    check_checksums(directory, step, state, meta)
    lacking = unverified(meta)
    if _trust_unverified and not lacking:  # arrays the checksums leave out
        lacking = [f"the checksum of {k}" for k in checksums(state) if k not in meta["checksums"]]
    return len(jax.tree.leaves(state)), n_bytes, ", ".join(lacking)


def step_meta(
    step: int, batches, train_cfg, run: dict, goodput: dict | None = None, spikes: dict | None = None
) -> dict:
    """The metadata saved with a step: the data position, the resolved run that wrote it, the
    goodput ledger so far (spmd.loop.goodput: seconds per bucket, carried over restarts) and the loss
    history the spike test judges by (spmd.loop.spikes)."""
    return {
        "version": META_VERSION,
        "step": step,
        "consumed_samples": batches.consumed_samples(step),
        "global_batch_size": train_cfg.global_batch_size,
        "seq_len": train_cfg.seq_len,
        "seed": train_cfg.seed,
        "run": run,
        **({"goodput": goodput} if goodput is not None else {}),
        **({"spikes": spikes} if spikes is not None else {}),
    }


def _cause(e: Exception) -> str:
    """The operating system's reason inside a TensorStore/Orbax error ("No space left on device"),
    else its first line."""
    import re

    m = re.search(r":\s*([A-Z][^:\[\]]*?)\s*\[os_error_code='?\d+", str(e))
    return m.group(1) if m else _first_line(e)


def _first_line(e: Exception) -> str:
    text = str(e).strip().split("See full TensorStore details")[0].strip().splitlines()
    return (text[0].rstrip(" .") if text else type(e).__name__)[:300]
