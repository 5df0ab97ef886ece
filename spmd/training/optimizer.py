"""The optimizer: the `[optimizer]` table and the optax transformation it makes.

Every parameter declares what the optimizer needs of it (`weight_decay`, its logical axes); nothing
here matches parameter names.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from spmd.core.logical import MATRIX_BATCH_AXES
from spmd.parallel.sharding import path_str

OPTIMIZERS = ("adamw", "adafactor", "lion", "muon", "sgd")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Which optax optimizer and its hyperparameters, the learning-rate schedule and clipping."""

    name: str = "adamw"  # adamw | adafactor | lion | muon | sgd
    learning_rate: float = 3e-3  # peak, reached after warmup; cosine decay to min_lr_ratio x peak
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    schedule_steps: int = 0  # length of the warmup + cosine schedule; 0: train.steps. Fix it to
    # stop a run early (fewer --steps) or resume with more, without changing the learning rates.
    weight_decay: float = 0.1  # decoupled (AdamW); not applied to norm scales and biases
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    momentum: float = 0.9  # sgd's momentum (0: plain sgd)
    state_dtype: str = "float32"  # first-moment dtype (adamw, lion, muon, sgd momentum, adafactor momentum)
    # Keep the optimizer state in host memory (memory kind pinned_host) between steps; the step
    # streams it to the device for the update and back. Needs a backend with host memory kinds.
    offload: bool = False

    def check(self) -> list[str]:
        problems = []
        if self.name not in OPTIMIZERS:
            problems.append(f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if not 0 < self.learning_rate < float("inf"):  # also NaN, which can only train to NaN
            problems.append(f"optimizer.learning_rate must be a positive number, got {self.learning_rate}")
        for key in ("warmup_steps", "schedule_steps"):
            if getattr(self, key) < 0:
                problems.append(f"optimizer.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("weight_decay", "eps", "grad_clip"):
            if not 0 <= getattr(self, key) < float("inf"):
                problems.append(f"optimizer.{key} must be a finite number >= 0, got {getattr(self, key)}")
        for key in ("beta1", "beta2"):  # moment decay rates: 1 or more never forgets (or diverges)
            if not 0 <= getattr(self, key) < 1:
                problems.append(f"optimizer.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.state_dtype not in ("float32", "bfloat16"):
            problems.append(f"optimizer.state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if not 0 <= self.momentum < 1:
            problems.append(f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        return problems


def lr_schedule(opt_cfg: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warmup to the peak, then cosine decay to min_lr_ratio x peak at schedule_steps (0:
    `steps`, the run's length)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt_cfg.learning_rate,
        warmup_steps=opt_cfg.warmup_steps,
        decay_steps=max(opt_cfg.schedule_steps or steps, opt_cfg.warmup_steps + 1),
        end_value=opt_cfg.learning_rate * opt_cfg.min_lr_ratio,
    )


def make_optimizer(
    opt_cfg: OptimizerConfig, steps: int, decay_mask, matrix_dims=None
) -> optax.GradientTransformation:
    """optimizer.name with warmup + cosine, global-norm clipping, and no decay where `decay_mask`
    is False. optimizer.state_dtype is the first moment's dtype (optax's mu_dtype); second
    moments stay in the parameters' dtype. `matrix_dims` (muon): see `matrix_dims`."""
    lr, dtype = lr_schedule(opt_cfg, steps), jnp.dtype(opt_cfg.state_dtype)
    wd, mask = opt_cfg.weight_decay, decay_mask
    if opt_cfg.name == "muon":
        # optax.contrib.muon: Newton-Schulz-orthogonalised momentum for the weight matrices
        # (`matrix_dims`), AdamW for the rest (embeddings, output head, norm scales), as Muon's
        # authors train. consistent_rms=0.2 scales each matrix's update to AdamW's RMS
        # (Moonlight's recipe), so optimizer.learning_rate means the same for both groups. Its
        # learning rate is -1 and the decay and schedule follow, as in optax.adamw, because
        # optax.contrib.muon's own AdamW group decays every parameter (norm scales too).
        muon = optax.contrib.muon(
            -1.0,
            mu_dtype=dtype,
            adam_b1=opt_cfg.beta1,
            adam_b2=opt_cfg.beta2,
            eps=opt_cfg.eps,
            muon_weight_dimension_numbers=matrix_dims,
            consistent_rms=0.2,
        )
        tx = optax.chain(muon, optax.add_decayed_weights(wd, mask), optax.scale_by_learning_rate(lr))
    elif opt_cfg.name == "adamw":
        tx = optax.adamw(lr, b1=opt_cfg.beta1, b2=opt_cfg.beta2, eps=opt_cfg.eps, mu_dtype=dtype,
                         weight_decay=wd, mask=mask)  # fmt: skip
    elif opt_cfg.name == "lion":
        tx = optax.lion(lr, b1=opt_cfg.beta1, b2=opt_cfg.beta2, mu_dtype=dtype, weight_decay=wd, mask=mask)
    elif opt_cfg.name == "adafactor":
        # Factored second moments (rows and columns of every matrix with both sides >= 128).
        tx = optax.adafactor(lr, weight_decay_rate=wd or None, weight_decay_mask=mask, dtype_momentum=dtype)
    else:  # sgd: decoupled weight decay, then momentum
        momentum = opt_cfg.momentum or None
        tx = optax.chain(
            optax.add_decayed_weights(wd, mask), optax.sgd(lr, momentum=momentum, accumulator_dtype=dtype)
        )
    if opt_cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt_cfg.grad_clip), tx)
    return tx


def matrix_dims(plan) -> dict:
    """Per parameter, how Muon sees it as matrices (optax.contrib.MuonDimensionNumbers), or None
    for AdamW, read from its logical axes: leading `layers`/`expert` axes index separate matrices;
    a projection from `embed` (q, k, v, gate, up, router) reduces over it and outputs the rest; a
    projection to `embed` (o, down) reduces over the rest. Embedding and output head (`vocab`),
    norm scales and anything else stay with AdamW."""
    by_path = {i.path: i for i in plan.params}

    def dims(path, _):
        logical = by_path[path_str(path)].logical
        lead = 0
        while lead < len(logical) and logical[lead] in MATRIX_BATCH_AXES:
            lead += 1
        rest = range(lead, len(logical))
        if "vocab" in logical or len(rest) < 2:
            return None
        if logical[lead] == "embed":
            return optax.contrib.MuonDimensionNumbers(reduction_axis=(lead,), output_axis=tuple(rest)[1:])
        if logical[-1] == "embed":
            return optax.contrib.MuonDimensionNumbers(
                reduction_axis=tuple(rest)[:-1], output_axis=(rest[-1],)
            )
        return None

    return jax.tree_util.tree_map_with_path(dims, plan.abstract_params)


def decay_mask(plan) -> dict:
    """True for parameters that get weight decay, as each parameter declares (norm scales don't)."""
    by_path = {i.path: i for i in plan.params}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: by_path[path_str(path)].weight_decay, plan.abstract_params
    )
