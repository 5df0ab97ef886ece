"""One place assembles a run: config -> mesh -> platform choices (spmd.assembly.policy) -> rules -> sharding
plan -> trainer.

Every command, script and test builds its run with `assemble`; nothing else chains these steps.
The variants the commands need are arguments, not copies:

- `optimizer=False` (spmd-eval, spmd-sample): no optimizer state is built and a checkpoint restores
  only its parameters (`spmd.io.checkpoint.restore_params`);
- `decoding=True` (spmd-sample): the rules for KV-cache decoding (`Rules.for_decoding`), validated
  for one position per step;
- abstract use (spmd-dryrun, spmd-plan, --print-sharding) needs no flag: building a Setup allocates
  nothing; only `trainer.init_state()` or a restore does.

JAX must already know its devices (host-device count, `jax.distributed`) when this runs.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax

from spmd.assembly import policy
from spmd.assembly.config import Config, apply_overrides, load_config
from spmd.core.errors import UserError
from spmd.core.mesh import axes_size, build_mesh, platform_of
from spmd.core.rules import Rules, load_rules
from spmd.parallel import memory
from spmd.parallel import sharding as sharding_lib
from spmd.parallel.slices import slow_axes
from spmd.platform import hostmem
from spmd.training import transform
from spmd.training.trainer import Trainer, build_eval_step, build_trainer


@dataclasses.dataclass(frozen=True)
class Setup:
    cfg: Config  # with every platform choice made (model.attention_impl concrete)
    requested: Config  # as given (model.attention_impl may be "auto"): what runs record and resume
    mesh: jax.sharding.Mesh
    choices: policy.Choices
    rules: Rules  # the family's logical names defaulted (and decoding) applied
    plan: sharding_lib.ShardingPlan
    trainer: Trainer | None  # None when assembled with optimizer=False
    # which parameters train and which are frozen (spmd.training.transform: the model transforms)
    partition: transform.Partition = transform.Partition()
    mesh_spec: str = ""  # the flags it came from, recorded in config.json and checkpoints
    dcn_mesh_spec: str = ""

    @property
    def family(self):
        """The model family this run builds: the config's, with its model transforms applied
        (spmd.core.family.ModelFamily; `cfg.model_family` is the family as configured)."""
        return self.plan.family

    @property
    def attention(self) -> str:
        """What attention runs as, for the log (e.g. "auto -> chunked (O(T) memory)")."""
        return self.choices.describe_attention()

    @functools.cached_property
    def eval_step(self):
        """Jitted (params, batch) -> (summed cross-entropy, counted tokens)."""
        if self.trainer is not None:
            return self.trainer.eval_step
        return build_eval_step(self.cfg, self.plan, self.choices)

    def with_choices(self, **changes) -> "Setup":
        """This run with platform choices replaced (spmd.assembly.policy.Choices fields), its steps rebuilt:
        how a benchmark or test compares two values of one choice, e.g. `fused_loss`."""
        choices = dataclasses.replace(self.choices, **changes)
        trainer = (
            build_trainer(self.cfg, self.plan, choices, self.partition) if self.trainer is not None else None
        )
        return dataclasses.replace(self, choices=choices, trainer=trainer)

    def batches(self, held_out: bool | None = None):
        """The run's data (spmd.data.loader.Batches), laid out for this mesh and these rules; `held_out`:
        whether held-out batches will be drawn (default: train.eval_every > 0)."""
        from spmd.data.loader import make_batches

        return make_batches(self.cfg, self.plan.batch_sharding, held_out)

    def to_json(self) -> dict:
        """Config (as given), platform choices, mesh, rules and devices as config.json and
        checkpoint metadata record them."""
        device = jax.devices()[0]
        return {
            "config": self.requested.to_json(),
            "resolved": self.choices.to_json(),
            "mesh": {"spec": self.mesh_spec, "dcn_spec": self.dcn_mesh_spec, "shape": dict(self.mesh.shape)},
            "rules": self.rules.to_json(),
            "devices": {
                "count": jax.device_count(),
                "processes": jax.process_count(),
                "platform": device.platform,
                "kind": device.device_kind,
            },
        }


def before_jax_starts(
    config: str | Config | None, overrides: Sequence[str] = (), *, may_relaunch: bool = False
) -> Config | None:
    """What a run sets up in the process before JAX starts: `cpu.host_heap` (spmd/platform/hostmem.py;
    with `may_relaunch`, a command run from its command line, the process may be replaced by the
    same command under tbbmalloc). Commands call it first; bad input is left for assemble to report.
    `config=None`: a command that reads its config from a checkpoint once JAX runs (spmd-sample,
    spmd-eval) gets cpu.host_heap's default. Returns the config (None where it is not known yet, or
    is bad)."""
    if config is None:
        hostmem.prepare(policy.CpuConfig.host_heap, may_relaunch)  # the field's default
        return None
    try:
        cfg = (
            load_config(config, overrides) if isinstance(config, str) else apply_overrides(config, overrides)
        )
    except UserError:
        return None
    hostmem.prepare(cfg.cpu.host_heap, may_relaunch)
    return cfg


def assemble(
    config: str | Config,
    mesh: str = "",
    rules: str | Rules = "fsdp",
    *,
    overrides: Sequence[str] = (),
    dcn_mesh: str = "",
    devices=None,
    optimizer: bool = True,
    decoding: bool = False,
    batch_size: int | None = None,
) -> Setup:
    """Validate everything a run needs and resolve every sharding, allocating nothing.

    `config`: a preset name, a TOML path or a Config (e.g. one saved in a checkpoint), then
    `overrides` (`section.key=value`). `mesh`/`dcn_mesh`: the --mesh/--dcn-mesh flags, over
    `devices` (default: all). `rules`: a preset, a path or Rules. `batch_size` replaces the global
    batch (and runs it as one microbatch); 0 means the smallest batch the mesh splits evenly.
    Bad input raises UserError naming what to fix.
    """
    requested = (
        load_config(config, overrides) if isinstance(config, str) else apply_overrides(config, overrides)
    )
    device_mesh = build_mesh(mesh, dcn_mesh, devices)
    # Every platform choice made here, once, for the mesh's devices (compile-only TPU devices in a
    # dry-run, whatever this host is); the model and the steps get the concrete values.
    choices = policy.resolve(requested, platform_of(device_mesh), device_mesh.devices.flat[0].device_kind)
    cfg = dataclasses.replace(
        requested, model=dataclasses.replace(requested.model, attention_impl=choices.attention)
    )
    # The slow axes [sync] syncs across, named (the --dcn-mesh axes unless sync.axes says).
    sync_axes = slow_axes(cfg.sync, device_mesh.shape, dcn_mesh)
    cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, axes=",".join(sync_axes)))
    memory.check(cfg, device_mesh)
    family = cfg.model_family
    longest = family.figures(cfg.model, cfg.train.seq_len).max_positions
    if longest is not None and cfg.train.seq_len > longest:
        raise UserError(
            f"train.seq_len ({cfg.train.seq_len}) is longer than the {longest} positions model family "
            f"{family.name} takes (model.max_positions); shorten train.seq_len"
        )
    resolved = load_rules(rules, family.logical_axes) if isinstance(rules, str) else rules
    resolved = resolved.with_defaults(family.logical_axes)
    if decoding:
        resolved = resolved.for_decoding()
    if batch_size is not None:
        B = batch_size or axes_size(device_mesh.shape, resolved.mapping.get("batch", ()))
        batch = {"global_batch_size": B, "microbatches": 1}
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **batch))
        requested = dataclasses.replace(requested, train=dataclasses.replace(requested.train, **batch))
    transforms = transform.active(cfg)  # e.g. low-rank adapters beside the targeted weights
    for t in transforms:
        family = t.family(family)
    plan = sharding_lib.plan(
        family,
        cfg.model,
        device_mesh,
        resolved,
        cfg.train.sequences,
        1 if decoding else cfg.train.seq_len,  # decoding feeds one position per step
        cfg.train.microbatches,
        cfg.pipeline,
        lowering=choices.lowering,
        objective=cfg.train.objective,
    )
    for t in transforms:
        t.check(plan)
    partition = transform.Partition(transforms)
    return Setup(
        cfg=cfg,
        requested=requested,
        mesh=device_mesh,
        choices=choices,
        rules=resolved,
        plan=plan,
        trainer=build_trainer(cfg, plan, choices, partition) if optimizer else None,
        partition=partition,
        mesh_spec=mesh,
        dcn_mesh_spec=dcn_mesh,
    )
