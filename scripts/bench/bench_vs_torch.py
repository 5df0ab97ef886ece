"""Side by side with PyTorch, component by component, interleaved so machine noise cancels.

    python scripts/bench/bench_vs_torch.py [--rounds 3] [--only train,attention,moe,checkpoint,decode,dp]
                                     [--torch-python .venv-torch/bin/python]

Every participant (ours or PyTorch's) is its own long-lived process: it builds and compiles once,
then measures one window each time it is told to. Per round the orchestrator runs the windows of
a group's participants one after another (A B A B ...: only one computes at a time), and each
table row gives the medians over rounds and the median of the per-round ratios PyTorch / ours
(above 1: ours is faster). PyTorch runs from its own Python 3.11 venv (`--torch-python`, made as
docs/performance.md says; scripts/bench/torch_side.py is its half), never from the project's.

Groups:
- train: a jitted train step (`small`, and `medium-dense`: d 512, 8 layers, T 512) against
  PyTorch eager and torch.compile, fp32 and bf16 (CPU autocast), same batch, AdamW, clipping.
- attention: causal GQA forward+backward at T = 1k, 4k, 8k (1 x 8 heads / 4 kv heads x 64, fp32):
  our `xla` and `chunked` against F.scaled_dot_product_attention; time and peak memory (peak RSS
  above the inputs, both sides; ours also the compiler's temporaries).
- moe: one MoE layer forward+backward (`small-moe`'s sizes, 16 x 128 tokens, fp32): our capacity
  and dropless dispatch against a PyTorch top-k MoE with an expert loop + index_add, and with
  torch._grouped_mm.
- checkpoint: save (to the commit, synced) and restore of a 2-layer d=1024 model + AdamW moments
  (~366 MiB): our Checkpointer against torch.distributed.checkpoint.
- decode: KV-cache sampling of `small` (fp32), batch 1 and 16: ms per generated token-step
  against a PyTorch static-cache loop, eager and torch.compile.
- dp: `small` (fp32) data parallel over 2 processes on loopback, one core each: jax.distributed
  against DDP over gloo; step time and gradient bytes each process sends per step (ours from the
  compiled HLO's collectives, PyTorch's counted in a DDP comm hook). Ours twice: as it runs (one
  flat gradient vector, `cpu.grad_reduce=auto`) and with XLA's all-reduce of every array (`xla`).
"""

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench_ckpt import state_overrides  # noqa: E402  (same directory)

MEDIUM = [  # the larger dense train-step row: `small` grown to d 512, 8 layers, T 512
    "model.d_model=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.head_dim=64",
    "model.d_ff=1536",
    "model.scan_unroll=8",
    "train.seq_len=512",
    "train.global_batch_size=4",
]
CKPT = state_overrides(2)  # the state of scripts/bench/bench_ckpt.py: ~366 MiB with the AdamW moments


def say(obj) -> None:
    print("@@ " + json.dumps(obj), flush=True)


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ================================================================ our workers


def jax_train(s: dict):
    import jax

    from spmd.assembly.setup import assemble

    setup = assemble(s["config"], "", "dp", overrides=s["set"], devices=jax.devices()[:1])
    trainer, batches = setup.trainer, setup.batches()
    box = {"state": trainer.init_state(), "i": 0}
    step_fn = trainer.train_step.lower(box["state"], batches.train_batch(0)).compile()

    def step():
        box["state"], box["metrics"] = step_fn(box["state"], batches.train_batch(box["i"]))
        box["i"] += 1
        jax.block_until_ready(box["state"])

    for _ in range(s["warmup"]):
        step()
    return lambda: {"time": timed(step, s["steps"]), "loss": float(box["metrics"]["loss"])}


def jax_attention(s: dict):
    import jax

    from spmd.assembly import policy
    from spmd.kernels.chunked_attention import chunked_attention
    from spmd.models.attention import xla_attention
    from spmd.platform import cpu_matmul

    B, T, N, K, H = s["B"], s["T"], s["N"], s["K"], s["H"]
    ks = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(k_, (B, T, N, H)) for k_ in (ks[0], ks[3]))
    k, v = (jax.random.normal(k_, (B, T, K, H)) for k_ in ks[1:3])
    impl = {"xla": xla_attention, "chunked": chunked_attention}[s["impl"]]

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: impl(q, k, v, causal=True), q, k, v)
        return vjp(do)

    # Compiled as the train step compiles attention on CPU (cpu.matmul's default).
    options = cpu_matmul.compiler_options(policy.matmul("auto", jax.devices()[0].platform, "float32"))
    compiled = cpu_matmul.keep(jax.jit(fwd_bwd, compiler_options=options).lower(q, k, v, do).compile())
    temps = compiled.memory_analysis().temp_size_in_bytes
    base = rss_bytes()

    def step():
        jax.block_until_ready(compiled(q, k, v, do))

    step()
    return lambda: {
        "time": timed(step, s["reps"]),
        "peak_bytes": peak_rss_bytes() - base,
        "temp_bytes": temps,
    }


def jax_moe(s: dict):
    import jax
    from flax import nnx

    from spmd.assembly import policy
    from spmd.assembly.config import load_config
    from spmd.models.moe import MoE
    from spmd.platform import cpu_matmul

    cfg = load_config("small-moe", [f"moe.dispatch={s['impl']}", "model.dtype=float32"]).model
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    kx, kd = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (s["B"], s["T"], cfg.d_model))
    dy = jax.random.normal(kd, x.shape)

    def fwd_bwd(params, x, dy):
        def f(params, x):
            return nnx.merge(graphdef, params)(x)[0]

        _, vjp = jax.vjp(f, params, x)
        return vjp(dy)

    # Compiled as the train step compiles the layer on CPU (cpu.matmul's default).
    fwd_bwd = cpu_matmul.jit(fwd_bwd, policy.matmul("auto", jax.devices()[0].platform, "float32"))

    def step():
        jax.block_until_ready(fwd_bwd(params, x, dy))

    step()
    return lambda: {"time": timed(step, s["reps"])}


def quiet_disk(settle_s: float = 2.0) -> None:
    """Before a timed save: the other side's writes flushed and the disk left to settle. Right
    after another process synced 366 MiB, a save on this machine's virtual disk took 0.42-1.2 s
    instead of ~0.3 s; without this, each side's save paid for the one before it."""
    os.sync()
    time.sleep(settle_s)


def jax_checkpoint(s: dict):
    import shutil

    import jax
    import numpy as np

    from spmd.assembly.setup import assemble
    from spmd.io import checkpoint as ckpt

    trainer = assemble("small", "", "dp", overrides=CKPT, devices=jax.devices()[:1]).trainer
    rng = np.random.default_rng(1)
    state = jax.tree.map(  # random, not zeros: trained moments don't compress away
        lambda x: (
            jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
            if x.dtype.kind == "f"
            else x
        ),
        trainer.init_state(),
    )
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench-ours-", dir=s["dir"]))
    count = [0]

    def window():
        count[0] += 1
        run_dir = root / str(count[0])
        quiet_disk()
        t = time.perf_counter()
        writer = ckpt.Checkpointer(run_dir, ckpt.CheckpointConfig(async_save=False))
        writer.save(1, state, {"step": 1})
        writer.close()
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        restored, _ = ckpt.restore(run_dir / ckpt.SUBDIR, 1, trainer.abstract_state)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t
        shutil.rmtree(run_dir)
        return {"save": save_s, "restore": restore_s, "bytes": nbytes}

    window()  # warm-up, as every participant gets: the first save starts Orbax's and TensorStore's
    # threads and compiles the checksums (1.1-1.4 s against ~0.3 s after)
    return window


def jax_decode(s: dict):
    import jax
    import numpy as np

    from spmd.assembly.config import load_config
    from spmd.assembly.setup import assemble
    from spmd.io.inference import Loaded, Sampler

    cfg = load_config("small", ["model.dtype=float32"])
    B = s["batch"]
    setup = assemble(cfg, "", "dp", devices=jax.devices()[:1], optimizer=False, decoding=True, batch_size=B)
    plan = setup.plan
    params = jax.jit(lambda: plan.init_params(cfg.train.seed), out_shardings=plan.param_shardings)()
    sampler = Sampler(Loaded(setup, 0, {}, params))
    prompts = [np.random.default_rng(i).integers(0, 256, s["prompt_len"]) for i in range(B)]

    def generate():
        stamps = []
        sampler.generate(
            prompts, s["new_tokens"], 0.8, 40, 1, on_token=lambda t, _: stamps.append(time.perf_counter())
        )
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    generate()  # compile
    return lambda: {"time": generate()}


def dp_overrides(s: dict) -> list[str]:
    return ["model.dtype=float32", f"cpu.grad_reduce={s['grad_reduce']}"]


def jax_dp(s: dict):
    os.sched_setaffinity(0, {s["rank"] % os.cpu_count()})  # one core per process, as PyTorch's
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    from spmd.analysis import hlo
    from spmd.assembly.setup import assemble
    from spmd.platform import distributed

    distributed.initialize(f"127.0.0.1:{s['port']}", s["world"], s["rank"])
    setup = assemble("small", f"data={s['world']}", "dp", overrides=dp_overrides(s))
    trainer, batches = setup.trainer, setup.batches()
    box = {"state": trainer.init_state(), "i": 0}
    compiled = trainer.train_step.lower(box["state"], batches.train_batch(0)).compile()
    sent = sum(c.bytes * c.count for c in hlo.collectives(compiled.as_text(), setup.plan.mesh))

    def step():
        box["state"], _ = compiled(box["state"], batches.train_batch(box["i"]))
        box["i"] += 1
        jax.block_until_ready(box["state"])

    for _ in range(s["warmup"]):
        step()
    return lambda: {"time": timed(step, s["steps"]), "bytes_per_step": sent}


KINDS = {
    "train": jax_train,
    "attention": jax_attention,
    "moe": jax_moe,
    "checkpoint": jax_checkpoint,
    "decode": jax_decode,
    "dp": jax_dp,
}


def worker(spec: dict) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    # Each of these runs inside a command that sets cpu.host_heap before JAX starts (spmd-train;
    # decoding: spmd-sample, with the setting's default): measured under the same heap. The
    # attention, MoE and decode rows were not until the fourteenth pass, and paid for faulting
    # their temporaries in on every call.
    kind = spec["kind"]
    config, sets = {
        "train": lambda: (spec["config"], spec["set"]),
        "checkpoint": lambda: ("small", CKPT),
        "attention": lambda: ("small", []),
        "moe": lambda: ("small-moe", []),
        "decode": lambda: (None, []),
        "dp": lambda: ("small", dp_overrides(spec)),
    }[kind]()
    from spmd.assembly.setup import before_jax_starts

    # relaunching this worker under tbbmalloc where that is the choice (the same arguments, and the
    # pipes to the harness stay open across the exec)
    before_jax_starts(config, sets, may_relaunch=True)
    window = KINDS[kind](spec)
    from spmd.platform import hostmem

    say({"ready": True, "jax": jax.__version__, "host_heap": hostmem.active()})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        say(window())


# ================================================================ orchestration


# Extra environment of PyTorch's processes (--torch-heap)
TORCH_ENV: dict[str, str] = {}


class Participant:
    """One long-lived benchmark process speaking the `@@ json` line protocol."""

    def __init__(self, label: str, side: str, spec: dict, torch_python: str):
        self.label, self.side = label, side
        script = ROOT / "scripts" / ("torch_side.py" if side == "torch" else "bench_vs_torch.py")
        python = torch_python if side == "torch" else sys.executable
        cmd = [python, str(script), "--spec", json.dumps(spec)] + (["--worker"] if side == "ours" else [])
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
        if side == "torch":
            env |= TORCH_ENV
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty compiler can't block it
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        self.proc.wait()
        self.log.seek(0)
        err = self.log.read()[-3000:]
        raise SystemExit(f"error: benchmark process {self.label!r} ({self.side}) failed:\n{err}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(members, rounds: int, torch_python: str) -> dict[str, list[dict]]:
    """members: [(label, side, [spec, ...])]; a member with several specs is one multi-process job
    (all started together, each window run on all at once, its time the slowest process's)."""
    jobs = []
    for label, side, specs in members:
        procs = [Participant(label, side, spec, torch_python) for spec in specs]
        info = [p.read() for p in procs]
        print(f"  ready: {label} {info[0]}", file=sys.stderr, flush=True)
        jobs.append((label, procs))
    results = {label: [] for label, _ in jobs}
    try:
        for r in range(rounds):
            for label, procs in jobs:
                for p in procs:
                    p.send("run")
                outs = [p.read() for p in procs]
                out = max(outs, key=lambda o: o.get("time", 0))
                results[label].append(out)
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
                print(f"  round {r + 1}: {label} {shown}", file=sys.stderr, flush=True)
    finally:  # all told to quit before any is waited for: a multi-process job shuts down together
        for _, procs in jobs:
            for p in procs:
                p.quit()
        for _, procs in jobs:
            for p in procs:
                p.proc.wait(timeout=120)
    return results


def median_of(results, label, key="time") -> float:
    return statistics.median(o[key] for o in results[label])


def ratio(results, ours, theirs, key="time") -> list[float]:
    """Each round's PyTorch time / ours (> 1: ours faster); the table shows them and their median."""
    return [t[key] / o[key] for o, t in zip(results[ours], results[theirs], strict=True)]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def fmt_mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def model_spec(cfg) -> dict:
    m = cfg.model
    return {
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "n_kv_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "d_ff": m.d_ff,
        "rope_theta": m.rope_theta,
    }


def group_train(args, table):
    from spmd.assembly.config import load_config

    for name, sets, steps in (("small", [], args.steps), ("medium-dense", MEDIUM, max(3, args.steps // 3))):
        cfg = load_config("small", sets)
        base = model_spec(cfg) | {
            "kind": "train",
            "batch": cfg.train.global_batch_size,
            "seq_len": cfg.train.seq_len,
            "steps": steps,
            "warmup": 3,
        }
        members = []
        for dt in ("float32", "bfloat16"):
            members.append(
                (f"ours {dt}", "ours", [base | {"config": "small", "set": sets + [f"model.dtype={dt}"]}])
            )
            for mode in ("eager", "compile"):
                spec = base | {"dtype": dt, "compile": mode == "compile"}
                members.append((f"torch {mode} {dt}", "torch", [spec]))
        res = run_group(members, args.rounds, args.torch_python)
        what = f"{name} ({cfg.train.global_batch_size} x {cfg.train.seq_len} tokens)"
        for dt in ("float32", "bfloat16"):
            for mode in ("eager", "compile"):
                table.append(
                    (
                        f"train step, {what}, {dt}",
                        f"ours vs torch {mode}",
                        fmt_ms(median_of(res, f"ours {dt}")) + " ms",
                        fmt_ms(median_of(res, f"torch {mode} {dt}")) + " ms",
                        ratio(res, f"ours {dt}", f"torch {mode} {dt}"),
                    )
                )


def group_attention(args, table):
    for T in args.lengths:
        base = {"kind": "attention", "B": 1, "T": T, "N": 8, "K": 4, "H": 64, "reps": 3 if T <= 4096 else 2}
        members = [
            ("ours xla", "ours", [base | {"impl": "xla"}]),
            ("ours chunked", "ours", [base | {"impl": "chunked"}]),
            ("torch sdpa", "torch", [base]),
        ]
        res = run_group(members, args.rounds, args.torch_python)
        for impl in ("xla", "chunked"):
            o, t = res[f"ours {impl}"][-1], res["torch sdpa"][-1]
            table.append(
                (
                    f"attention fwd+bwd, T={T:,}",
                    f"ours `{impl}` vs SDPA",
                    f"{fmt_ms(median_of(res, f'ours {impl}'))} ms, peak {fmt_mib(o['peak_bytes'])} "
                    f"(temps {fmt_mib(o['temp_bytes'])})",
                    f"{fmt_ms(median_of(res, 'torch sdpa'))} ms, peak {fmt_mib(t['peak_bytes'])}",
                    ratio(res, f"ours {impl}", "torch sdpa"),
                )
            )


def group_moe(args, table):
    from spmd.assembly.config import load_config

    m = load_config("small-moe").model
    moe = m.moe
    B, T = 16, 128
    members = [
        ("ours capacity", "ours", [{"kind": "moe", "impl": "capacity", "B": B, "T": T, "reps": 10}]),
        ("ours dropless", "ours", [{"kind": "moe", "impl": "dropless", "B": B, "T": T, "reps": 10}]),
    ]
    for impl in ("index_add", "grouped_mm"):
        spec = {"kind": "moe", "impl": impl, "tokens": B * T, "D": m.d_model, "E": moe.n_experts}
        spec |= {"top_k": moe.top_k, "F": moe.d_ff_expert, "reps": 10}
        members.append((f"torch {impl}", "torch", [spec]))
    res = run_group(members, args.rounds, args.torch_python)
    what = f"MoE layer fwd+bwd ({B * T} tokens, D {m.d_model}, {moe.n_experts} experts x F {moe.d_ff_expert}, top-{moe.top_k}, fp32)"
    for ours in ("capacity", "dropless"):
        for theirs in ("index_add", "grouped_mm"):
            table.append(
                (
                    what,
                    f"ours {ours} vs torch {theirs}",
                    fmt_ms(median_of(res, f"ours {ours}")) + " ms",
                    fmt_ms(median_of(res, f"torch {theirs}")) + " ms",
                    ratio(res, f"ours {ours}", f"torch {theirs}"),
                )
            )


def group_checkpoint(args, table):
    from spmd.assembly.config import load_config

    cfg = load_config("small", CKPT)
    os.makedirs(args.dir, exist_ok=True)
    members = [
        ("ours", "ours", [{"kind": "checkpoint", "dir": args.dir}]),
        ("torch dcp", "torch", [model_spec(cfg) | {"kind": "checkpoint", "dir": args.dir}]),
    ]
    res = run_group(members, args.rounds, args.torch_python)
    for key in ("save", "restore"):
        o, t = res["ours"][-1], res["torch dcp"][-1]
        table.append(
            (
                f"checkpoint {key} (model + AdamW, fp32)",
                "ours (Orbax) vs torch.distributed.checkpoint",
                f"{median_of(res, 'ours', key):.2f} s ({fmt_mib(o['bytes'])})",
                f"{median_of(res, 'torch dcp', key):.2f} s ({fmt_mib(t['bytes'])})",
                ratio(res, "ours", "torch dcp", key),
            )
        )


def group_decode(args, table):
    from spmd.assembly.config import load_config

    cfg = load_config("small")
    for batch in (1, 16):
        base = {"kind": "decode", "batch": batch, "prompt_len": 16, "new_tokens": 64}
        members = [("ours", "ours", [base])]
        for mode in ("eager", "compile"):
            members.append(
                (f"torch {mode}", "torch", [model_spec(cfg) | base | {"compile": mode == "compile"}])
            )
        res = run_group(members, args.rounds, args.torch_python)
        for mode in ("eager", "compile"):
            table.append(
                (
                    f"decode `small` fp32, batch {batch}, ms per token step",
                    f"ours vs torch {mode}",
                    f"{median_of(res, 'ours') * 1e3:.2f} ms",
                    f"{median_of(res, f'torch {mode}') * 1e3:.2f} ms",
                    ratio(res, "ours", f"torch {mode}"),
                )
            )


def group_dp(args, table):
    from spmd.assembly.config import load_config

    cfg = load_config("small")
    base = {"world": 2, "steps": args.steps, "warmup": 3}
    # Ours as it runs (cpu.grad_reduce=auto: one flat gradient vector across processes) and with
    # XLA's own all-reduce of every gradient array, the layout before the flat gradient sum.
    variants = {"ours": "auto", "ours xla": "xla"}
    participants = []
    for name, grad_reduce in variants.items():
        port = free_port()
        ranks = [base | {"kind": "dp", "rank": r, "port": port, "grad_reduce": grad_reduce} for r in range(2)]
        participants.append((name, "ours", ranks))
    port = free_port()
    spec = model_spec(cfg) | base | {"kind": "ddp", "port": port, "batch": cfg.train.global_batch_size}
    spec |= {"seq_len": cfg.train.seq_len}
    theirs = [spec | {"rank": r} for r in range(2)]
    res = run_group([*participants, ("torch ddp", "torch", theirs)], args.rounds, args.torch_python)
    labels = {
        "ours": "ours (jax.distributed, flat gradient sum) vs DDP (gloo)",
        "ours xla": "ours (jax.distributed, XLA's all-reduce per array) vs DDP (gloo)",
    }
    for name, label in labels.items():
        table.append(
            (
                f"2-process data parallel, `small` fp32, {cfg.train.global_batch_size} x {cfg.train.seq_len}, "
                "1 core each",
                label,
                f"{fmt_ms(median_of(res, name))} ms, {fmt_mib(res[name][-1]['bytes_per_step'])}/step",
                f"{fmt_ms(median_of(res, 'torch ddp'))} ms, {fmt_mib(res['torch ddp'][-1]['bytes_per_step'])}/step",
                ratio(res, name, "torch ddp"),
            )
        )


GROUPS = {
    "train": group_train,
    "attention": group_attention,
    "moe": group_moe,
    "checkpoint": group_checkpoint,
    "decode": group_decode,
    "dp": group_dp,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="train steps per window (medium-dense: a third)")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of {', '.join(GROUPS)}")
    p.add_argument("--lengths", default="1024,4096,8192", help="attention sequence lengths")
    p.add_argument("--dir", default="/tmp/spmd-bench-vs-torch", help="checkpoint scratch directory")
    p.add_argument("--torch-python", default=str(ROOT / ".venv-torch" / "bin" / "python"))
    p.add_argument(
        "--torch-heap",
        choices=("system", "tbbmalloc"),
        default="system",
        help="PyTorch's malloc: glibc's as installed (default), or tbbmalloc preloaded as ours runs on CPU "
        "(cpu.host_heap, spmd/platform/hostmem.py): the same allocator on both sides",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.spec))
    groups = [g for g in args.only.split(",") if g]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        print(
            f"error: --only: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if not os.path.exists(args.torch_python):
        print(
            f"error: --torch-python {args.torch_python} not found; make the PyTorch venv as "
            "docs/performance.md says, or point --torch-python at one",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.rounds < 3:
        print("error: --rounds must be at least 3 (medians of interleaved rounds)", file=sys.stderr)
        raise SystemExit(2)
    args.lengths = [int(t) for t in args.lengths.split(",")]
    if args.torch_heap == "tbbmalloc":
        from spmd.platform import hostmem

        libraries = hostmem.tbbmalloc_libraries()
        if libraries is None:
            print(
                "error: --torch-heap tbbmalloc needs the tbb wheel in this environment: pip install tbb",
                file=sys.stderr,
            )
            raise SystemExit(2)
        TORCH_ENV.update(
            LD_PRELOAD=" ".join(libraries),
            TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD=str(hostmem.TBBMALLOC_KEEP_FROM_BYTES),
        )

    import jax

    table: list[tuple] = []
    for g in groups:
        print(f"group {g}", file=sys.stderr, flush=True)
        GROUPS[g](args, table)
    versions = subprocess.run(
        [args.torch_python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"\njax {jax.__version__}, PyTorch {versions}, {os.cpu_count()} CPU cores, {args.rounds} interleaved "
        f"rounds; PyTorch / ours = median over rounds of the per-round time ratio (> 1: ours faster)\n"
    )
    print(
        "| component | comparison | ours | PyTorch | PyTorch / ours | per round |\n|---|---|---:|---:|---:|---|"
    )
    for what, cmp_, ours, theirs, r in table:
        rounds = " ".join(f"{x:.2f}" for x in r)
        print(f"| {what} | {cmp_} | {ours} | {theirs} | **{statistics.median(r):.2f}x** | {rounds} |")


if __name__ == "__main__":
    main()
