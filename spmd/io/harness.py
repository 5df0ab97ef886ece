"""lm-eval (EleutherAI's evaluation harness) on a run's checkpoint: a model adapter registered
as `spmd`, on any mesh.

`loglikelihood` and `loglikelihood_rolling` score right-padded token rows with one jitted program
per (batch, length) shape: requests are sorted by length and padded to a power of two (at least
16 tokens, at most the model's context), so a task compiles a handful of programs.
`generate_until` decodes greedily with the KV-cache sampler (spmd.io.inference.Sampler), left-padded
in batches of one generation setting, and cuts each text at the first of its `until` strings.

Tokens are encoded as lm-eval's `hf` model encodes them: without special tokens, a pair split
after the context's own tokens, an empty context replaced by the end-of-text token (the
tokenizer_config.json's eos_token, where it names one). In a multi-process job every process runs
the same requests (one SPMD program, its inputs placed from the copy each process holds); lm-eval
sees a single rank.

lm-eval has no plugin discovery for models: `python -m spmd.io.harness ...` is lm-eval's own command
line with this module imported (`--model spmd --model_args run_dir=DIR,mesh=fsdp=8`; a mesh of
several axes writes its commas as ';'), and `spmd-eval --tasks` calls `lm_eval.simple_evaluate`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from spmd.core.errors import UserError
from spmd.data import chat
from spmd.data import tokenizer as tokenizer_lib
from spmd.io import inference

MIN_LENGTH = 16  # the shortest padded row
# What lm-eval's command line passes every model: the mesh places ours, so these say nothing.
LM_EVAL_ARGS = ("device", "max_batch_size")


def mesh_arg(mesh: str) -> str:
    """lm-eval's --model_args splits on commas: a mesh may write them as ';'."""
    return mesh.replace(";", ",")


@register_model("spmd")
class SpmdLM(TemplateLM):
    def __init__(self, run_dir: str, step: int | None = None, mesh: str = "fsdp=-1", rules: str | None = None,
                 batch_size: int = 8, max_length: int | None = None, max_gen_toks: int = 256,
                 overrides: tuple = (), **unused):  # fmt: skip
        super().__init__()
        unused = {k: v for k, v in unused.items() if k not in LM_EVAL_ARGS}
        if unused:
            raise UserError(
                f"unknown spmd model_args {', '.join(sorted(unused))}; they are run_dir, step, mesh, rules, "
                f"batch_size, max_length, max_gen_toks"
            )
        self.where = (str(run_dir), step, mesh_arg(mesh), rules, tuple(overrides))
        self.loaded = inference.load(*self.where[:4], self.where[4], batch=0)
        self.tokenizer = tokenizer_lib.for_run(
            self.loaded.run_dir, self.loaded.cfg, self.loaded.meta.get("run", {}).get("tokenizer")
        )
        multiple = inference.batch_multiple(self.loaded)
        batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # lm-eval's "auto": ours
        self.batch = -(-batch_size // multiple) * multiple
        context = self.loaded.cfg.train.seq_len
        limit = self.loaded.plan.family.figures(self.loaded.cfg.model, context).max_positions
        self.max_length = int(max_length or (min(context, limit) if limit else context))
        self.max_gen_toks = int(max_gen_toks)
        eot = chat.end_of_text_id(self.tokenizer)
        self._eot = int(eot) if eot is not None else 0  # bytes: no EOS; NUL stands in
        self._score = self._scorer()
        self._sampler = None

    # -- what lm-eval asks of a TemplateLM

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        inner = getattr(self.tokenizer, "tokenizer", None)
        if inner is not None:  # tokenizers: as transformers with add_special_tokens=False
            return inner.encode(string, add_special_tokens=bool(add_special_tokens)).ids
        return [int(i) for i in self.tokenizer.encode(string)]

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole, len(continuation)))
        return self.score_rows(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owner = [], []
        for k, request in enumerate(requests):
            (text,) = request.args
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, windows):
                rows.append((list(context) + list(continuation), len(continuation)))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self.score_rows(rows)):
            totals[k] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for k, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(k)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.pop("do_sample", False) or kwargs.get("temperature", 0):
                raise UserError("the spmd lm-eval model decodes greedily: a task asked for sampling")
            keep = self.max_length - new_tokens
            if keep < 1:
                raise UserError(
                    f"max_gen_toks {new_tokens} leaves no room for a prompt in {self.max_length} positions"
                )
            for start in range(0, len(members), self.batch):
                chunk = members[start : start + self.batch]
                prompts = [
                    np.asarray(self.tok_encode(requests[k].args[0])[-keep:] or [self._eot]) for k in chunk
                ]
                made = self.sampler().generate(prompts, new_tokens, 0.0, 0, 0, stop={self._eot})
                for k, prompt, ids in zip(chunk, prompts, made):
                    text = _completion(self.tokenizer, prompt, ids, self._eot)
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    out[k] = text
        return out

    # -- our side

    def sampler(self) -> inference.Sampler:
        """The KV-cache sampler, made on first use (a second copy of the weights, laid out for decoding)."""
        if self._sampler is None:
            run_dir, step, mesh, rules, overrides = self.where
            self._sampler = inference.Sampler(
                inference.load(run_dir, step, mesh, rules, overrides, batch=0, decoding=True)
            )
        return self._sampler

    def _scorer(self):
        plan = self.loaded.plan
        graphdef = plan.graphdef

        def score(params, tokens_BT, targets_BT, mask_BT):
            with plan.activate():
                logits_BTV = nnx.merge(graphdef, params)(tokens_BT).astype(jnp.float32)
            logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
            picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
            greedy_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
            counted_BT = mask_BT.astype(bool)
            return jnp.sum(jnp.where(counted_BT, picked_BT, 0.0), -1), jnp.all(greedy_BT | ~counted_BT, -1)

        rows = plan.batch_sharding
        return jax.jit(
            score, in_shardings=(plan.param_shardings, rows, rows, rows), out_shardings=plan.replicated
        )

    def _place(self, rows_BT: np.ndarray) -> jax.Array:
        """A host array every process holds whole, as a global array in the batch sharding."""
        sharding = self.loaded.plan.batch_sharding
        return jax.make_array_from_callback(rows_BT.shape, sharding, lambda index: rows_BT[index])

    def score_rows(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(summed log-probability, all greedy) of the last `n` tokens of each row given the ones
        before; rows sorted longest first, batched and padded to few shapes."""
        order = sorted(range(len(rows)), key=lambda k: -len(rows[k][0]))
        out: list = [None] * len(rows)
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            longest = max(len(rows[k][0]) - 1 for k in chunk)
            T = min(max(MIN_LENGTH, 1 << math.ceil(math.log2(max(longest, 1)))), self.max_length)
            tokens, targets, mask = (np.zeros((self.batch, T), np.int32) for _ in range(3))
            for r, k in enumerate(chunk):
                whole, n = rows[k]
                L = len(whole) - 1
                tokens[r, :L], targets[r, :L] = whole[:-1], whole[1:]
                mask[r, L - min(n, L) : L] = 1  # a continuation longer than the window: its tail
            placed = [self._place(x) for x in (tokens, targets, mask)]
            logprob, greedy = jax.device_get(self._score(self.loaded.params, *placed))
            for r, k in enumerate(chunk):
                out[k] = (float(logprob[r]), bool(greedy[r]))
        return out


def _completion(tokenizer, prompt, ids, eot: int) -> str:
    ids = [int(t) for t in ids]
    if eot in ids:
        ids = ids[: ids.index(eot)]
    before = tokenizer.decode(prompt)
    after = tokenizer.decode([*prompt, *ids])
    return after[len(before) :] if after.startswith(before) else tokenizer.decode(ids)


def evaluate(loaded_args: dict, tasks: list[str], limit: float | None, num_fewshot: int | None,
             include_path: str | None, batch_size: int) -> dict:  # fmt: skip
    """lm_eval.simple_evaluate on a run (for spmd-eval --tasks): its results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise UserError(
            f"no lm-eval task named {', '.join(map(repr, missing))}; list them with `lm_eval ls tasks`, or "
            f"give a folder of task YAML files with --include-path"
        )
    model = SpmdLM(batch_size=batch_size, **loaded_args)
    return lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        limit=limit,
        num_fewshot=num_fewshot,
        task_manager=manager,
        log_samples=False,
    )


def main() -> None:
    """`python -m spmd.io.harness`: lm-eval's command line, with the `spmd` model registered."""
    from lm_eval.__main__ import cli_evaluate

    from spmd.core.errors import UserError, report

    try:
        cli_evaluate()
    except UserError as e:  # bad model_args or a run that does not load: one line, as our commands
        report(e)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
