"""Preference tuning: DPO (sigmoid, IPO, hinge, robust), SimPO and ORPO on pairs of completions.

A preference batch holds pairs: row 2j is prompt + chosen completion of pair j, row 2j + 1 the
same prompt + the rejected one (spmd.data.preference); `loss_mask` marks the completion's
targets, `target_mask` every real (unpadded) target. Each row's log-probability of its
completion is the sum of the model's log-probabilities of the marked targets (`logps`), or that
sum divided by their count (`avg`: SimPO, ORPO, and IPO's margin).

Per pair, with policy log-probabilities c (chosen) and r (rejected), the reference's c0 and r0,
beta b and label smoothing e (logsig = log sigmoid):

  dpo sigmoid  d = (c - c0) - (r - r0);  -(1 - e) logsig(b d) - e logsig(-b d)   (cDPO when e > 0)
  dpo ipo      (d_avg - 1 / (2 b))^2, d_avg the same margin of per-token averages
  dpo hinge    relu(1 - b d)
  dpo robust   (-(1 - e) logsig(b d) + e logsig(-b d)) / (1 - 2 e)
  simpo        z = c_avg - r_avg - gamma / b;  -(1 - e) logsig(b z) - e logsig(-b z)
  orpo         NLL(chosen) - lambda logsig(log odds(c_avg) - log odds(r_avg)), odds(p) = p / (1 - p)

Metrics are TRL's (the reference implementation; tests/golden/trl_preference.json holds its
numbers): rewards/chosen = b (c - c0) (SimPO: b c_avg, ORPO: lambda c_avg), rewards/rejected,
rewards/accuracies (chosen reward > rejected), rewards/margins, logps/chosen and logps/rejected
(the policy's: sums for DPO, averages for SimPO and ORPO). ORPO's NLL is over every target of the
chosen sequence, prompt included, as TRL's ORPOTrainer computes it.

The reference model of DPO is the run's starting weights (`--init-from`), frozen: under LoRA the
frozen base itself (adapters off, no second copy: spmd.training.transform.Partition.off), else a
copy the train state carries as `reference` and checkpoints never hold. With `reference =
precomputed` the step runs no reference at all: its log-probabilities come with each batch,
written beside the data once by `spmd-eval --write-reference`.
"""

import dataclasses

import jax
import jax.numpy as jnp

from spmd.data.preference import FIELDS, REFERENCE_FIELD, REFERENCED, precomputed_reference

OBJECTIVES = ("lm", "dpo", "simpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCES = ("checkpoint", "precomputed")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """The `[preference]` table: how `train.objective = dpo | simpo | orpo` scores a pair."""

    loss: str = "sigmoid"  # dpo: sigmoid | ipo | hinge | robust
    beta: float = 0.1  # dpo's KL weight (IPO's tau); simpo's reward scale
    label_smoothing: float = 0.0  # the chance a pair's labels are flipped (dpo sigmoid/robust, simpo)
    gamma: float = 0.5  # simpo: the target reward margin
    orpo_lambda: float = 0.1  # orpo: the weight of the odds-ratio term beside the chosen NLL
    # dpo: the reference is the run's starting weights, run beside the policy (checkpoint), or
    # its log-probabilities written beside the data by spmd-eval --write-reference (precomputed)
    reference: str = "checkpoint"

    def check(self) -> list[str]:
        problems = []
        if self.loss not in DPO_LOSSES:
            problems.append(f"preference.loss must be one of {', '.join(DPO_LOSSES)}, got {self.loss!r}")
        if not 0 < self.beta < float("inf"):
            problems.append(f"preference.beta must be a positive number, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"preference.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if not 0 <= self.gamma < float("inf"):
            problems.append(f"preference.gamma must be a number >= 0, got {self.gamma}")
        if not 0 < self.orpo_lambda < float("inf"):
            problems.append(f"preference.orpo_lambda must be a positive number, got {self.orpo_lambda}")
        if self.reference not in REFERENCES:
            problems.append(
                f"preference.reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}"
            )
        return problems


def needs_reference(objective: str) -> bool:
    """Whether the objective scores against a reference model (SimPO and ORPO do not)."""
    return objective in REFERENCED


def reference_model(cfg) -> bool:
    """Whether the train step runs the reference model (not when its log-probabilities come with
    the data)."""
    return needs_reference(cfg.train.objective) and cfg.preference.reference == "checkpoint"


def batch_fields(cfg) -> tuple[str, ...]:
    """The arrays of a preference batch under run config `cfg`."""
    return (*FIELDS, REFERENCE_FIELD) if precomputed_reference(cfg) else FIELDS


def row_sums(ce_BT, loss_mask_BT, target_mask_BT):
    """Per row: (sum of the completion's log-probabilities, its token count, the cross-entropy
    summed over every real target, their count)."""
    completion = loss_mask_BT.astype(jnp.float32) * target_mask_BT.astype(jnp.float32)
    every = target_mask_BT.astype(jnp.float32)
    return (-jnp.sum(ce_BT * completion, axis=1), jnp.sum(completion, axis=1),
            jnp.sum(ce_BT * every, axis=1), jnp.sum(every, axis=1))  # fmt: skip


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _pairs(x_R):
    """(chosen, rejected) halves of a per-row vector whose rows alternate chosen, rejected."""
    x_P2 = x_R.reshape(-1, 2)
    return x_P2[:, 0], x_P2[:, 1]


def pair_sums(objective: str, cfg: PreferenceConfig, policy, reference=None):
    """(summed loss over the pairs, pairs, {metric: sum over the pairs}) from the per-row sums of
    the policy (`row_sums`) and the reference's completion log-probabilities (per row, or None).

    Sums rather than means, so microbatches and devices add up: the step divides by the pairs.
    ORPO's NLL term is a mean over the batch's chosen tokens (as TRL's); it enters the sum as
    that mean times the pairs, so the division gives it back."""
    logp_R, n_R, nll_R, n_all_R = policy
    c, r = _pairs(logp_R)
    n_c, n_r = _pairs(n_R)
    c_avg, r_avg = c / jnp.maximum(n_c, 1.0), r / jnp.maximum(n_r, 1.0)
    b, e = cfg.beta, cfg.label_smoothing
    pairs = jnp.asarray(c.shape[0], jnp.float32)
    extra = {}
    if objective == "dpo":
        c0, r0 = _pairs(reference)
        d = (c - c0) - (r - r0)
        if cfg.loss == "sigmoid":
            loss = -(1 - e) * jax.nn.log_sigmoid(b * d) - e * jax.nn.log_sigmoid(-b * d)
        elif cfg.loss == "ipo":
            d_avg = (c - c0) / jnp.maximum(n_c, 1.0) - (r - r0) / jnp.maximum(n_r, 1.0)
            loss = jnp.square(d_avg - 1 / (2 * b))
        elif cfg.loss == "hinge":
            loss = jax.nn.relu(1 - b * d)
        else:  # robust
            loss = (-(1 - e) * jax.nn.log_sigmoid(b * d) + e * jax.nn.log_sigmoid(-b * d)) / (1 - 2 * e)
        chosen, rejected, logps = b * (c - c0), b * (r - r0), (c, r)
    elif objective == "simpo":
        z = c_avg - r_avg - cfg.gamma / b
        loss = -(1 - e) * jax.nn.log_sigmoid(b * z) - e * jax.nn.log_sigmoid(-b * z)
        chosen, rejected, logps = b * c_avg, b * r_avg, (c_avg, r_avg)
    else:  # orpo
        lam = cfg.orpo_lambda
        log_odds = (c_avg - r_avg) - (_log1mexp(c_avg) - _log1mexp(r_avg))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll_c, _ = _pairs(nll_R)
        n_all_c, _ = _pairs(n_all_R)
        nll = jnp.sum(nll_c) / jnp.maximum(jnp.sum(n_all_c), 1.0)  # mean over the chosen tokens
        loss = nll - lam * ratio
        chosen, rejected, logps = lam * c_avg, lam * r_avg, (c_avg, r_avg)
        extra = {
            "nll_loss": nll * pairs,
            "log_odds_ratio": jnp.sum(ratio),
            "log_odds_chosen": jnp.sum(log_odds),
        }
    metrics = {
        "rewards/chosen": jnp.sum(chosen),
        "rewards/rejected": jnp.sum(rejected),
        "rewards/accuracies": jnp.sum((chosen > rejected).astype(jnp.float32)),
        "rewards/margins": jnp.sum(chosen - rejected),
        "logps/chosen": jnp.sum(logps[0]),
        "logps/rejected": jnp.sum(logps[1]),
        **extra,
    }
    return jnp.sum(loss), pairs, metrics


def means(sums: dict, pairs) -> dict:
    """The pair metrics of summed `pair_sums` metrics: means over the pairs."""
    return {name: sums[name] / pairs for name in (*METRICS, *ORPO_METRICS) if name in sums}
