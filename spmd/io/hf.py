"""Hugging Face checkpoints in and out, for every model family with an HF adapter (spmd.core.family:
HFAdapter), as `transformers` saves them (`config.json` + safetensors, one file or shards with an
index).

The family says how each of our parameters is stored (`HFTensor`: which HF tensor(s), whether the
HF matrix is transposed, how our trailing axes group into HF's, which part of a fused tensor it
is); this module reads and writes them. Reading one device's shard of a parameter reads only the
rows and columns it covers from the memory-mapped file (`safe_open(...).get_slice`), so host
memory holds one shard at a time, and each process reads only what its own devices hold
(`jax.make_array_from_callback`).
"""

import concurrent.futures
import contextlib
import json
import math
import os
import pathlib
import re
import threading
from collections.abc import Callable

import jax
import numpy as np

from spmd.core import family as family_lib
from spmd.core.errors import UserError, check_writable
from spmd.core.family import HFTensor
from spmd.data import tokenizer as tokenizer_lib
from spmd.parallel.sharding import path_str
from spmd.training import transform

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Copied from an HF directory into the run dir on import, and out again on export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # transformers writes the chat template here (it wins over the config's)
)


def architecture(hf: dict, source: str) -> tuple[str, family_lib.ModelFamily]:
    """An HF config's architecture and the model family whose adapter reads it, or an error
    naming the architectures we read."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else ""
    if not arch:  # an older config: by its model_type
        for name in family_lib.builtin():
            adapter = family_lib.find(name).hf
            arch = next(
                (
                    a
                    for a, t in (adapter.architectures if adapter else {}).items()
                    if t == hf.get("model_type")
                ),
                "",
            )
            if arch:
                break
    family = family_lib.for_architecture(arch) if arch else None
    if family is None:
        raise UserError(
            f"{source}: architecture {arch or hf.get('model_type')!r} is not supported; "
            f"import takes {', '.join(family_lib.architectures())}"
        )
    expected = family.hf.architectures[arch]
    if hf.get("model_type", expected) != expected:
        raise UserError(
            f"{source}: architectures says {arch} (model_type {expected!r}) but model_type is "
            f"{hf['model_type']!r}; the config contradicts itself, so which model it is cannot be told"
        )
    return arch, family


def model_fields(hf: dict, source: str) -> dict:
    """The fields of the model family's config for an HF config.json (the family that reads its
    architecture), or an error naming what it cannot express."""
    _, family = architecture(hf, source)
    return adapter(family).model_fields(hf, source)


def adapter(family: family_lib.ModelFamily) -> family_lib.HFAdapter:
    if family.hf is None:
        raise UserError(
            f"model family {family.name!r} has no Hugging Face mapping; it cannot be imported or exported"
        )
    return family.hf


def hf_names(t: HFTensor, shape: tuple[int, ...]):
    """(stacked index, HF name) for every HF tensor behind one of our parameters."""
    for idx in np.ndindex(*shape[: t.stacked]):
        yield idx, t.name(*idx)


# --- reading safetensors -----------------------------------------------------------------------


# safetensors dtypes that hold weights as numbers we can cast exactly enough (the parameter dtype).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class Weights:
    """The tensors of an HF directory: one model.safetensors or the shards an index names. Only
    the headers are read here; each read maps its file, copies the asked-for block out and unmaps
    it, so the file's pages do not stay in this process's memory."""

    def __init__(self, hf_dir: pathlib.Path):
        self.dir = hf_dir
        index = hf_dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, UnicodeDecodeError) as e:
                raise UserError(f"{index} is not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (hf_dir / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise UserError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX}")
        self.where, self.shapes, self.dtypes = {}, {}, {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise UserError(f"{index} names the shard {name}, which is missing from {hf_dir}")
            try:
                with self._open(name) as handle:
                    slices = {k: handle.get_slice(k) for k in handle.keys()}
                    shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
                    dtypes = {k: v.get_dtype() for k, v in slices.items()}
            except Exception as e:  # noqa: BLE001 — safetensors raises its own error types for bad files
                raise UserError(
                    f"{path} is not a readable safetensors file ({e}); is it truncated?"
                ) from None
            for k, shape in shapes.items():
                self.where[k], self.shapes[k], self.dtypes[k] = name, shape, dtypes[k]
        if weight_map is not None:
            for k, name in weight_map.items():
                if self.where.get(k) != name:
                    raise UserError(f"{index} places {k} in {name}, but that file does not hold it")

    def _open(self, file: str):
        from safetensors import safe_open

        return safe_open(str(self.dir / file), framework="numpy")

    def read(self, name: str, t: HFTensor, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        with self._open(self.where[name]) as handle:
            return t.read(handle.get_slice(name), shape, index)


def check_tensors(
    weights: Weights, hf: family_lib.HFAdapter, cfg, shapes: dict[str, tuple[int, ...]]
) -> None:
    """Before anything is read: every tensor the model config `cfg` needs is present with the shape
    it implies, and every tensor in the files is one we map (or the family knows to skip)."""
    used = set()
    for path, t in hf.tensors(cfg).items():
        shape = shapes[path]
        want = t.hf_shape(shape[t.stacked :])
        for _, name in hf_names(t, shape):
            if name not in weights.shapes:
                raise UserError(f"{weights.dir}: tensor {name} is missing (needed for our {path})")
            if weights.shapes[name] != want:
                raise UserError(
                    f"{weights.dir}: tensor {name} has shape {list(weights.shapes[name])} but config.json "
                    f"implies {list(want)}; the config does not match the weights"
                )
            if weights.dtypes[name] not in FLOAT_DTYPES:
                raise UserError(
                    f"{weights.dir}: tensor {name} holds {weights.dtypes[name]}, not floating-point weights "
                    f"({', '.join(FLOAT_DTYPES)}); a quantized or damaged checkpoint cannot be imported as it is"
                )
            used.add(name)
    for name in sorted(weights.shapes):
        if name in used or hf.unmapped(cfg, name):
            continue
        raise UserError(f"{weights.dir}: tensor {name} has no place in this model (an unmapped tensor)")


READ_BUDGET = 1 << 30  # bytes of shards being built at once (one larger shard is always allowed)


class _Budget:
    """Blocks a thread until its bytes fit under the limit (or nothing else is in flight)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def holding(self, n: int):
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            with self.cond:
                self.used -= n
                self.cond.notify_all()


def _shard_bytes(x) -> int:
    """Bytes of all of this process's shards of x (what building it holds on the host at once)."""
    local = x.sharding.shard_shape(x.shape)
    n_local = len(x.sharding.addressable_devices)
    return math.prod(local) * np.dtype(x.dtype).itemsize * n_local


def load_params(weights: Weights, hf: family_lib.HFAdapter, cfg, abstract_params: dict) -> dict:
    """Our parameters, each built shard by shard on its target sharding from the files."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(abstract_params)}
    mapping = hf.tensors(cfg)
    check_tensors(weights, hf, cfg, {p: tuple(x.shape) for p, x in flat.items()})

    def build(path, x):
        t, shape = mapping[path], tuple(x.shape)
        inner = shape[t.stacked :]

        def shard(index):
            lead = [range(*s.indices(n)) for s, n in zip(index[: t.stacked], shape)]
            blocks = [
                weights.read(t.name(*idx), t, inner, index[t.stacked :]).astype(x.dtype, copy=False)
                for idx in _product(lead)
            ]
            if not t.stacked:
                return blocks[0]
            return np.stack(blocks).reshape([len(r) for r in lead] + list(blocks[0].shape))

        with budget.holding(_shard_bytes(x)):
            return jax.make_array_from_callback(shape, x.sharding, shard)

    # Parameters are read in parallel (the copies and transposes release the GIL; reads from the
    # page cache are memory-bound), with at most READ_BUDGET bytes of shards in flight at once.
    budget = _Budget(READ_BUDGET)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        built = dict(zip(flat, pool.map(lambda item: build(*item), flat.items())))
    return jax.tree_util.tree_map_with_path(lambda p, _: built[path_str(p)], abstract_params)


def hf_tensors(
    hf: family_lib.HFAdapter, cfg, params: dict, dtype
) -> dict[str, tuple[Callable[[], np.ndarray], int]]:
    """HF name -> (a function giving the tensor, its bytes), in HF's order (layer by layer). Each
    call brings only its own layer (and expert) of a stacked parameter to the host, then lays it
    out as HF does (a fused tensor: its parts, each from one of our parameters, put together)."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    parts: dict[str, list] = {}
    for path, t in hf.tensors(cfg).items():
        x = flat[path]
        for idx, name in hf_names(t, tuple(x.shape)):
            parts.setdefault(name, []).append((t.part[1] if t.part else 0, t, x, idx))

    def tensor(pieces):
        pieces = sorted(pieces, key=lambda p: p[0])
        arrays = [t.write(_to_host(x, idx)).astype(dtype, copy=False) for _, t, x, idx in pieces]
        return pieces[0][1].join(arrays)

    out = {
        name: (
            lambda pieces=pieces: tensor(pieces),
            sum(math.prod(x.shape[t.stacked :]) for _, t, x, _ in pieces) * np.dtype(dtype).itemsize,
        )
        for name, pieces in parts.items()
    }
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


def _to_host(x: jax.Array, idx: tuple[int, ...]) -> np.ndarray:
    """x[idx] on the host. An array on one CPU device is host memory already (a view, no copy);
    elsewhere the slice is cut where x lives, so only it crosses to the host (gathered from every
    process when x spans several)."""
    if len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu":
        return np.asarray(x)[idx]
    part = x[idx] if idx else x
    if part.is_fully_addressable:
        return np.asarray(part)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(part, tiled=True))


def natural_key(name: str):
    """model.layers.10 after model.layers.9."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _product(ranges):
    return [()] if not ranges else [(i, *rest) for i in ranges[0] for rest in _product(ranges[1:])]


# --- whole directories -------------------------------------------------------------------------


def _read_json(path: pathlib.Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a JSON object")
    return doc


def empty_destination(path: pathlib.Path, flag: str, overwrite: bool = False) -> None:
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a file; give a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(f"{flag} {str(path)!r} already holds files; give a new directory")
    check_writable(path, flag)


def sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def publish(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    """Move a finished temporary directory into place (process 0), so a failure leaves nothing."""
    import shutil

    if jax.process_index() == 0:
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    sync_processes(f"published {dest}")


def temporary(dest: pathlib.Path) -> pathlib.Path:
    """A fresh temporary directory beside `dest` (one name for all processes: a shared filesystem)."""
    import shutil

    tmp = dest.parent / f".{dest.name}.tmp"
    if jax.process_index() == 0:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    sync_processes(f"made {tmp}")
    return tmp


# A Hugging Face Hub repository id, "org/name" (a local directory of that name wins).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# What import reads of a Hub repository: configs, weights, tokenizer.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model"]


def from_hub(repo_id: str) -> pathlib.Path:
    """The local snapshot of a Hub repository (huggingface_hub's cache: downloaded if missing and
    the network and HF_HUB_OFFLINE allow; HF_HOME / HF_HUB_CACHE say where the cache is)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise UserError(
            f"{repo_id!r} is not a local directory, nor in the Hugging Face cache, and cannot be downloaded "
            f"(offline or HF_HUB_OFFLINE set); download it first (huggingface-cli download {repo_id}) or give its directory"
        ) from None
    except GatedRepoError:
        raise UserError(
            f"Hugging Face repository {repo_id!r} is gated: accept its terms and log in (HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(f"Hugging Face repository {repo_id!r} not found (or private: set HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise UserError(f"downloading {repo_id!r} from the Hugging Face Hub failed: {e}") from None
    except HFValidationError:
        raise UserError(
            f"{repo_id!r} is not a local directory, nor a valid Hugging Face repository id (org/name: letters, digits, "
            f"'-', '_', '.'; no '..', no '-' or '.' at either end); give the model's directory or its Hub id"
        ) from None
    except OSError as e:  # the network, a full cache disk
        raise UserError(
            f"downloading {repo_id!r} from the Hugging Face Hub failed ({e}); give its directory"
        ) from None


def import_hf(
    hf_dir: str,
    run_dir: str,
    mesh: str = "fsdp=-1",
    rules: str = "fsdp",
    overrides=(),
    dcn_mesh: str = "",
    overwrite: bool = False,
) -> dict:
    """Write a run dir holding an HF model: config.toml (which `--config` takes), config.json, the
    tokenizer files, and checkpoints/0 with the parameters only (no optimizer state) laid out for
    `mesh` x `rules`. Everything is validated before anything is written; the run dir appears
    whole or not at all."""
    import shutil

    from spmd.assembly.config import CheckpointConfig, Config, apply_overrides, to_toml
    from spmd.assembly.setup import assemble
    from spmd.io.checkpoint import META_VERSION, Checkpointer

    src = pathlib.Path(hf_dir).expanduser()
    if not src.is_dir() and not src.exists() and HUB_ID.fullmatch(hf_dir):
        src = from_hub(hf_dir)
    if not src.is_dir():
        raise UserError(
            f"Hugging Face directory {str(src)!r} not found (a Hub repository id looks like org/name)"
        )
    if not (src / CONFIG).is_file():
        raise UserError(f"{src} has no {CONFIG}; give the directory save_pretrained wrote")
    hf = _read_json(src / CONFIG)
    arch, family = architecture(hf, str(src / CONFIG))
    mapping = adapter(family)
    generation = _read_json(src / GENERATION_CONFIG) if (src / GENERATION_CONFIG).is_file() else None
    dest = pathlib.Path(run_dir).expanduser()
    empty_destination(dest, "--run-dir", overwrite)
    base = Config(name=dest.name, model=family.config_cls(**mapping.model_fields(hf, str(src / CONFIG))))
    cfg = apply_overrides(base, overrides)
    weights = Weights(src)
    setup = assemble(cfg, mesh, rules, dcn_mesh=dcn_mesh, optimizer=False)
    params = load_params(weights, mapping, setup.cfg.model, setup.plan.abstract_params)

    run = {
        **setup.to_json(),
        "hf": {
            "source": str(src.resolve()),
            "architecture": arch,
            "config": hf,
            "generation_config": generation,
        },
    }
    # The tokenizer that ships with the weights is the run's: a fine-tune on data prepared with
    # another is refused (spmd.data.tokenizer.check_agrees).
    shipped = next((src / n for n in ("tokenizer.json", "tokenizer.model") if (src / n).is_file()), None)
    if shipped is not None:
        try:
            run["tokenizer"] = tokenizer_lib.record(tokenizer_lib.load(str(shipped)))
        except Exception:  # noqa: BLE001 — a file the tokenizers library cannot read: nothing recorded
            pass
    meta = {
        "version": META_VERSION,
        "step": 0,
        "consumed_samples": 0,
        "global_batch_size": cfg.train.global_batch_size,
        "seq_len": cfg.train.seq_len,
        "seed": cfg.train.seed,
        "params_only": True,
        "run": run,
    }
    tmp = temporary(dest)
    writer = Checkpointer(tmp, CheckpointConfig(async_save=False))
    writer.save(0, {"params": params}, meta)
    writer.close()
    copied = []
    if jax.process_index() == 0:
        (tmp / "config.toml").write_text(to_toml(cfg))
        (tmp / "config.json").write_text(json.dumps(run, indent=2))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
                copied.append(name)
    publish(tmp, dest)
    n_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return {"architecture": arch, "config": cfg, "tensors": len(weights.shapes), "bytes": n_bytes,
            "tokenizer": copied}  # fmt: skip


def exported(path: str, step: int | None):
    """(checkpoint directory, step, meta, run config) of what an export reads: `path`'s latest
    committed step, or `step`."""
    from spmd.assembly.config import config_from_json
    from spmd.io import checkpoint as ckpt

    directory, latest = ckpt.locate(path)
    if step is not None:
        if step not in ckpt.committed_steps(directory):
            raise UserError(f"no committed checkpoint for step {step} in {directory}")
        latest = step
    meta = ckpt.check_meta(directory, latest, ckpt.read_meta(directory, latest), ("run",))
    return directory, latest, meta, config_from_json(meta["run"]["config"])


def export_hf(
    path: str,
    out: str,
    step: int | None = None,
    dtype: str | None = None,
    mesh: str = "fsdp=-1",
    rules: str = "fsdp",
    max_shard_bytes: int = 5 * 10**9,
    merge: bool = False,
) -> dict:
    """Write an HF directory (config.json, generation_config.json, safetensors shards of at most
    `max_shard_bytes` with their index, the run's tokenizer) from a checkpoint on any mesh.
    Tensors are written in `dtype` (default: the parameters' own). A run with model transforms
    (spmd.training.transform) is exported merged (always; `merge` says it was asked for, and
    refuses a run without any)."""
    import shutil

    from safetensors.numpy import save_file

    from spmd.assembly.setup import assemble
    from spmd.io import checkpoint as ckpt

    directory, latest, meta, cfg = exported(path, step)
    if merge and not transform.active(cfg):
        raise UserError(
            f"--merge: {directory}/{latest} has no model transform to merge (its config turns none on, "
            f"e.g. no adapters); export it without --merge"
        )
    origin = meta["run"].get("hf") or meta["run"].get("init_from", {}).get("hf") or {}
    mapping = adapter(cfg.model_family)
    arch = mapping.export_architecture(cfg.model, origin.get("config"))
    dtype = dtype or cfg.model.param_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if max_shard_bytes < 1:
        raise UserError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    dest = pathlib.Path(out).expanduser()
    empty_destination(dest, "--out")
    config = mapping.hf_config(cfg.model, arch, origin.get("config"), cfg.train.seq_len, dtype)
    mapping.tensors(cfg.model)  # raises for what HF cannot express, before anything is read

    setup = assemble(transform.plain(cfg), mesh, rules, optimizer=False, batch_size=0)
    params, _ = ckpt.restore_model(directory, latest, setup.plan, meta)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    named = hf_tensors(mapping, cfg.model, params, np_dtype)

    shards, current, size = [], [], 0
    for name, (_, n_bytes) in named.items():
        if current and size + n_bytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n_bytes
    shards.append(current)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    tmp = temporary(dest)
    is_main = jax.process_index() == 0
    weight_map, total = {}, 0
    for file, names in zip(files, shards):
        if jax.process_count() > 1:  # every process takes part in each gather, in one order
            arrays = {n: named[n][0]() for n in names}
        else:
            with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                arrays = dict(zip(names, pool.map(lambda n: named[n][0](), names)))
        if is_main:
            try:
                save_file(arrays, str(tmp / file), metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001 — SafetensorError or OSError: a full disk, a quota
                shutil.rmtree(tmp, ignore_errors=True)
                raise UserError(
                    f"writing {file} into {out!r} failed ({str(e)[:200]}); nothing was written: free space or "
                    f"choose another --out"
                ) from None
            (tmp / file).chmod(0o644)  # safetensors writes through a private temporary file
        for n in names:
            weight_map[n] = file
            total += arrays[n].nbytes
        del arrays
    if is_main:
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        generation = origin.get("generation_config") or {
            k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None
        }
        (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        run_dir = ckpt.run_dir_of(directory)
        for name in TOKENIZER_FILES:
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, tmp / name)
    sync_processes(f"wrote {tmp}")
    publish(tmp, dest)
    note = mapping.export_note(cfg.model)
    return {"architecture": arch, "step": latest, "files": files, "tensors": len(named), "bytes": total,
            "capacity_note": note}  # fmt: skip
