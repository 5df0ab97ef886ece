"""Platform policy: every choice that depends on the devices a run compiles for, made once when the
run is assembled (spmd.assembly.setup) into concrete values that the config, the plan and the log share.

- `model.attention_impl = "auto"`: on a GPU the implementation measured fastest on that device
  kind for the nearest shape (spmd.kernels.tuning: cuDNN or the Pallas flash kernel), the flash
  kernel where nothing was measured, or with packed documents (cuDNN takes them only as a dense
  T x T mask); on TPU JAX's splash attention (`splash`, kernels/splash_attention.py) where the
  sequence is a multiple of its 128-position block, else the flash kernel (Mosaic: `pallas_tpu`,
  the kernel's TPU block layout; `pallas` there means it too); on CPU chunked attention (memory O(T)) from CHUNKED_FROM
  positions, plain XLA attention below. `cudnn` (cuDNN's
  fused attention) only on NVIDIA GPUs with a 16-bit compute dtype, `splash` only on TPU (and in
  interpret mode on CPU, for tests); elsewhere an error that names the alternatives.
- The matmul library of CPU step programs (`cpu.matmul`, spmd/platform/cpu_matmul.py): oneDNN or XLA's own.
- XLA options of the CPU parameter initialiser and train step (below).
- How a pure data-parallel step sums its gradients (`cpu.grad_reduce`, spmd/parallel/dataparallel.py).
- The KV cache layout for decoding: one array per layer on CPU (spmd.models.decoder.KVCache).
- The loss: the cross-entropy without a float32 copy of the logits (spmd.training.loss) on GPU and TPU.
- How the model's platform-dependent pieces lower (spmd.core.logical.Lowering, active while the
  model traces): attention's batch/head merging and its backward on CPU, Pallas interpret mode,
  the flash kernel's block sizes measured on the device kind (kernels/tuned.toml), the MoE
  experts' grouped matmul form.

The platform is the mesh's: compile-only TPU devices in a dry-run, whatever this host is.
"""

import dataclasses

import jax

from spmd.core.errors import UserError
from spmd.core.logical import Lowering
from spmd.kernels import tuning
from spmd.kernels.splash_attention import MIN_BLOCK as SPLASH_BLOCK
from spmd.kernels.splash_attention import supported as splash_supported
from spmd.parallel.dataparallel import GRAD_REDUCE
from spmd.platform import cpu_matmul
from spmd.platform.hostmem import HOST_HEAP

# On CPU, `auto` switches from plain to chunked attention at this many positions (memory O(T)).
CHUNKED_FROM = 1024
GPU_PLATFORMS = ("gpu", "cuda", "rocm")

# The parameter initialiser on CPU is mostly threefry random bits, one fusion per parameter, and
# LLVM's full optimisation of each costs more than the program ever runs: at backend optimisation
# level 1 it compiles several times faster and gives bit-identical parameters (level 0 does not).
INIT_OPTIONS_CPU = {"xla_backend_optimization_level": 1}
# The train step on CPU: copy insertion with region analysis. Without it XLA:CPU copies every AdamW
# moment before updating it in place in the donated state (the parameter's update reads the old
# moment); with it those copies go and the program is otherwise the same (bit-identical states:
# tests/test_data_and_training.py).
TRAIN_OPTIONS_CPU = {"xla_cpu_copy_insertion_use_region_analysis": True}


@dataclasses.dataclass(frozen=True)
class CpuConfig:
    """The `[cpu]` table: tuning for runs on CPU devices (elsewhere only grad_reduce = flat is
    checked, as an error)."""

    # Library for the matmuls of CPU train/eval steps (spmd/platform/cpu_matmul.py): "onednn" (as PyTorch's
    # CPU backend), "xla" (XLA:CPU's own choice: YNNPACK, Eigen), or "auto": oneDNN where the CPU
    # multiplies the compute dtype in hardware (bf16: AVX-512 BF16 or AMX), else XLA's own
    matmul: str = "auto"
    # Host memory of XLA:CPU programs (spmd/platform/hostmem.py): "tbbmalloc" relaunches the command under
    # Intel's scalable allocator (the `tbb` wheel; large blocks cached apart from small objects),
    # "retain" keeps glibc's freed heap memory for reuse (each step's temporaries are not faulted in
    # again; the process stays at its peak size), "system" leaves glibc's malloc as it is, "auto"
    # is tbbmalloc where installed (else retain) on a CPU host, system elsewhere
    host_heap: str = "auto"
    # How a pure data-parallel step sums its gradients: "flat" as one vector per dtype (DDP's
    # buckets; XLA:CPU's gloo pays a fixed cost per all-reduce operand), "xla" as XLA's all-reduce of
    # every array, "auto" flat on CPU across processes (spmd/parallel/dataparallel.py)
    grad_reduce: str = "auto"

    def check(self) -> list[str]:
        problems = []
        for key, choices in (
            ("matmul", cpu_matmul.CPU_MATMUL),
            ("host_heap", HOST_HEAP),
            ("grad_reduce", GRAD_REDUCE),
        ):
            if getattr(self, key) not in choices:
                problems.append(f"cpu.{key} must be one of {', '.join(choices)}, got {getattr(self, key)!r}")
        return problems


def attention(
    name: str, seq_len: int, platform: str, dtype: str = "bfloat16", device_kind: str = "", head_dim: int = 0,
    packed: bool = False,
) -> str:  # fmt: skip
    """The implementation `model.attention_impl = name` runs as on `platform` with compute `dtype`
    (`auto_reason` says why auto chose it)."""
    return _attention(name, seq_len, platform, dtype, device_kind, head_dim, packed)[0]


def auto_reason(
    seq_len: int, platform: str, dtype: str, device_kind: str, head_dim: int, packed: bool
) -> str:
    """Why `auto` runs what it runs on these devices, for the log."""
    return _attention("auto", seq_len, platform, dtype, device_kind, head_dim, packed)[1]


def _attention(name, seq_len, platform, dtype, device_kind, head_dim, packed) -> tuple[str, str]:
    if name == "cudnn":
        others = "xla, chunked, pallas or auto"
        if platform not in ("gpu", "cuda"):
            raise UserError(
                f"model.attention_impl = cudnn is NVIDIA's cuDNN fused attention; this run's devices are "
                f"{platform}: use {others}"
            )
        if dtype not in ("bfloat16", "float16"):
            raise UserError(
                f"model.attention_impl = cudnn runs in bfloat16 or float16, and model.dtype is {dtype}: set "
                f"model.dtype=bfloat16, or use {others}"
            )
    if name == "splash":
        if platform in GPU_PLATFORMS:
            raise UserError(
                f"model.attention_impl = splash is JAX's TPU kernel; this run's devices are {platform}: "
                "use auto, pallas, cudnn, chunked or xla"
            )
        if not splash_supported(seq_len):
            raise UserError(
                f"model.attention_impl = splash needs train.seq_len a multiple of {SPLASH_BLOCK}, got "
                f"{seq_len}: change the sequence length, or use auto or pallas"
            )
    if platform == "tpu" and name == "auto":
        if splash_supported(seq_len):
            return "splash", "TPU: JAX's splash attention"
        return (
            "pallas_tpu",
            f"TPU, {seq_len} positions is not a multiple of splash's {SPLASH_BLOCK}-position block",
        )
    if platform == "tpu" and name == "pallas":
        return "pallas_tpu", ""
    if name == "auto":
        if platform in GPU_PLATFORMS:
            if packed:
                return "pallas", "packed documents (cuDNN would take them as a dense T x T mask)"
            measured = tuning.lookup(device_kind, dtype, head_dim, seq_len)
            if measured is None:
                return (
                    "pallas",
                    f"not measured on {device_kind or 'this GPU'} in {dtype} (scripts/gpu/gpu_check.py)",
                )
            return measured.fastest, measured.why()
        if seq_len >= CHUNKED_FROM:
            return "chunked", f"CPU, {seq_len} >= {CHUNKED_FROM} positions"
        return "xla", f"CPU, {seq_len} < {CHUNKED_FROM} positions"
    return name, ""


def matmul(setting: str, platform: str, dtype: str = "float32") -> str:
    """The matmul library of step programs computing in `dtype` under `cpu.matmul = setting`: oneDNN
    on CPU when asked, or under `auto` where the CPU multiplies `dtype` in hardware; else XLA's own
    ("xla")."""
    if platform != "cpu":
        return "xla"
    if setting == "auto":
        return "onednn" if cpu_matmul.in_hardware(dtype) else "xla"
    return setting


def matmul_reason(setting: str, platform: str, dtype: str) -> str:
    """Why `auto` runs the CPU matmuls where it does, for the log ("" where nothing was chosen)."""
    if platform != "cpu" or setting != "auto":
        return ""
    if cpu_matmul.in_hardware(dtype):
        return f"this CPU multiplies {dtype} in hardware"
    return f"this CPU has no {dtype} matmul instructions, which oneDNN would emulate far slower"


def grad_reduce(setting: str, platform: str, processes: int) -> str:
    """How a pure data-parallel step sums its gradients: "flat" (one vector per dtype where the
    layout allows it: spmd/parallel/dataparallel.py), "flat_required" (asked for: a layout that does not
    allow it is an error) or "xla" (XLA's all-reduce). `auto` is flat on CPU across processes, where
    gloo's cost per all-reduce operand is paid; in one process XLA:CPU's collectives are memory
    copies."""
    if setting == "flat" and platform != "cpu":
        raise UserError(
            f"cpu.grad_reduce=flat sums gradients as one vector on CPU devices; this run's devices are "
            f"{platform}; use auto or xla"
        )
    if setting == "auto":
        return "flat" if platform == "cpu" and processes > 1 else "xla"
    return "flat_required" if setting == "flat" else setting


@dataclasses.dataclass(frozen=True)
class Choices:
    """What a run does on its platform (module doc), resolved once."""

    platform: str
    attention_requested: str  # model.attention_impl as configured
    attention: str  # what it runs as
    matmul: str  # "onednn" | "xla"
    grad_reduce: str  # cpu.grad_reduce resolved (grad_reduce above)
    init_options: dict | None
    train_options: dict | None
    kv_cache_per_layer: bool
    attention_reason: str = ""  # why `auto` chose `attention` (for the log)
    matmul_reason: str = ""  # why cpu.matmul = auto chose `matmul` (for the log)
    lowering: Lowering = Lowering()  # how the model's platform-dependent pieces lower
    # the cross-entropy without a float32 copy of the logits (spmd.training.loss): on accelerators, where
    # the logits' memory and passes count; CPU runs keep optax's (their pinned trajectories)
    fused_loss: bool = False

    def describe_attention(self) -> str:
        """For the log, e.g. "auto -> chunked (O(T) memory)"."""
        impl = self.attention
        cpu = self.platform == "cpu"
        note = {
            "pallas": " (interpret mode on CPU: slow, for tests)" if cpu else " (Triton)",
            "pallas_tpu": " (interpret mode on CPU: slow, for tests)" if cpu else " (Mosaic)",
            "splash": " (interpret mode on CPU: slow, for tests)" if cpu else " (Mosaic)",
            "chunked": " (O(T) memory)",
        }.get(impl, "")
        why = (
            f"; {self.attention_reason}"
            if self.attention_requested == "auto" and self.attention_reason
            else ""
        )
        return (
            (f"{self.attention_requested} -> {impl}" if self.attention_requested != impl else impl)
            + note
            + why
        )

    def describe_matmul(self) -> str:
        """For the log on CPU, e.g. "xla (auto: this CPU has no bfloat16 matmul instructions, ...)"."""
        return f"{self.matmul} (auto: {self.matmul_reason})" if self.matmul_reason else self.matmul

    def to_json(self) -> dict:
        return {
            "platform": self.platform,
            "attention_impl": self.attention,
            "matmul": self.matmul,
            "grad_reduce": self.grad_reduce,
            "kv_cache_per_layer": self.kv_cache_per_layer,
            "fused_loss": self.fused_loss,
            "lowering": self.lowering.to_json(),
        }


def resolve(cfg, platform: str, device_kind: str = "") -> Choices:
    """The choices of config `cfg` (spmd.assembly.config.Config) on devices of `platform` (and kind)."""
    cpu = platform == "cpu"
    head_dim = cfg.model_family.figures(cfg.model, cfg.train.seq_len).head_dim
    shape = (
        cfg.train.seq_len,
        platform,
        cfg.model.dtype,
        device_kind,
        head_dim,
        cfg.data.packing == "segments",
    )
    impl, reason = _attention(cfg.model.attention_impl, *shape)
    return Choices(
        platform=platform,
        attention_requested=cfg.model.attention_impl,
        attention=impl,
        attention_reason=reason,
        matmul=matmul(cfg.cpu.matmul, platform, cfg.model.dtype),
        matmul_reason=matmul_reason(cfg.cpu.matmul, platform, cfg.model.dtype),
        grad_reduce=grad_reduce(cfg.cpu.grad_reduce, platform, jax.process_count()),
        init_options=dict(INIT_OPTIONS_CPU) if cpu else None,
        train_options=dict(TRAIN_OPTIONS_CPU) if cpu else None,
        kv_cache_per_layer=cpu,
        fused_loss=not cpu,
        lowering=dataclasses.replace(
            Lowering.for_platform(
                platform, flash_blocks(cfg.model.dtype, device_kind, head_dim, cfg.train.seq_len)
            ),
            float32_weight_grads=cfg.train.grad_reduce_dtype == "float32",
        ),
    )


def flash_blocks(dtype: str, device_kind: str, head_dim: int, seq_len: int) -> tuple:
    """The flash kernel's block sizes measured best on `device_kind` for the nearest shape
    (spmd.kernels.tuning), as (field, value) pairs; () where nothing was measured (its defaults)."""
    measured = tuning.lookup(device_kind, dtype, head_dim, seq_len)
    return tuple(sorted(measured.blocks.items())) if measured is not None and measured.blocks else ()
