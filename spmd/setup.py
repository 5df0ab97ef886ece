"""One place assembles a run: config -> mesh -> rules (with the config's attention overrides) ->
sharding plan -> trainer.

Every command, script and test builds its run with `assemble`; nothing else chains these steps.
The variants the commands need are arguments, not copies:

- `optimizer=False` (spmd-eval, spmd-sample): no optimizer state is built and a checkpoint restores
  only its parameters (`spmd.checkpoint.restore_params`);
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

from spmd import hostmem, memory
from spmd import sharding as sharding_lib
from spmd.config import Config, TrainConfig, apply_overrides, load_config
from spmd.errors import UserError
from spmd.mesh import axes_size, build_mesh, platform_of
from spmd.models import attention
from spmd.models.llama import Decoder
from spmd.rules import Rules, load_rules
from spmd.train import Trainer, build_eval_step, build_trainer


@dataclasses.dataclass(frozen=True)
class Setup:
    cfg: Config
    mesh: jax.sharding.Mesh
    rules: Rules  # attention overrides (and decoding) applied
    plan: sharding_lib.ShardingPlan
    trainer: Trainer | None  # None when assembled with optimizer=False
    attention: str  # what attention runs as, for the log (e.g. "auto -> chunked (O(T) memory)")
    mesh_spec: str = ""  # the flags it came from, recorded in config.json and checkpoints
    dcn_mesh_spec: str = ""

    @functools.cached_property
    def eval_step(self):
        """Jitted (params, batch) -> (summed cross-entropy, counted tokens)."""
        return self.trainer.eval_step if self.trainer is not None else build_eval_step(self.cfg, self.plan)

    def batches(self):
        """The run's data (spmd.data.Batches), laid out for this mesh and these rules."""
        from spmd.data import make_batches

        return make_batches(self.cfg, self.plan.batch_sharding)

    def to_json(self) -> dict:
        """Config, mesh, rules and devices as config.json and checkpoint metadata record them."""
        device = jax.devices()[0]
        return {
            "config": self.cfg.to_json(),
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
) -> None:
    """What a run sets up in the process before JAX starts: `train.host_heap` (spmd/hostmem.py;
    with `may_relaunch`, a command run from its command line, the process may be replaced by the
    same command under tbbmalloc). Commands call it first; bad input is left for assemble to report.
    `config=None`: a command that reads its config from a checkpoint once JAX runs (spmd-sample,
    spmd-eval) gets train.host_heap's default."""
    if config is None:
        hostmem.prepare(TrainConfig.host_heap, may_relaunch)  # the field's default
        return
    try:
        cfg = (
            load_config(config, overrides) if isinstance(config, str) else apply_overrides(config, overrides)
        )
    except UserError:
        return
    hostmem.prepare(cfg.train.host_heap, may_relaunch)


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
    model_cls=Decoder,
) -> Setup:
    """Validate everything a run needs and resolve every sharding, allocating nothing.

    `config`: a preset name, a TOML path or a Config (e.g. one saved in a checkpoint), then
    `overrides` (`section.key=value`). `mesh`/`dcn_mesh`: the --mesh/--dcn-mesh flags, over
    `devices` (default: all). `rules`: a preset, a path or Rules. `batch_size` replaces the global
    batch (and runs it as one microbatch); 0 means the smallest batch the mesh splits evenly.
    Bad input raises UserError naming what to fix.
    """
    cfg = load_config(config, overrides) if isinstance(config, str) else apply_overrides(config, overrides)
    device_mesh = build_mesh(mesh, dcn_mesh, devices)
    platform = platform_of(device_mesh)
    try:
        attention_desc = attention.describe(cfg.model.attention_impl, cfg.train.seq_len, platform)
        model_cfg = cfg.model
        if platform != jax.default_backend():
            # Compile-only devices of another platform (spmd.topology): the model is traced on this
            # host, so it gets the implementation chosen for the devices, not for the host.
            impl = attention.resolve(cfg.model.attention_impl, cfg.train.seq_len, platform)
            model_cfg = dataclasses.replace(cfg.model, attention_impl=impl)
    except ValueError as e:
        raise UserError(str(e)) from None
    memory.check(cfg, device_mesh)
    resolved = (load_rules(rules) if isinstance(rules, str) else rules).with_attention(cfg.attention)
    if decoding:
        resolved = resolved.for_decoding()
    if batch_size is not None:
        B = batch_size or axes_size(device_mesh.shape, resolved.mapping.get("batch", ()))
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, global_batch_size=B, microbatches=1)
        )
    plan = sharding_lib.plan(
        model_cls,
        model_cfg,
        device_mesh,
        resolved,
        cfg.train.global_batch_size,
        1 if decoding else cfg.train.seq_len,  # decoding feeds one position per step
        cfg.train.microbatches,
        cfg.pipeline,
    )
    return Setup(
        cfg=cfg,
        mesh=device_mesh,
        rules=resolved,
        plan=plan,
        trainer=build_trainer(cfg, plan) if optimizer else None,
        attention=attention_desc,
        mesh_spec=mesh,
        dcn_mesh_spec=dcn_mesh,
    )
