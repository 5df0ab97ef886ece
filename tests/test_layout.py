"""The package's structure holds: one top-level import name, no import cycles (function-local
imports count), models/ reach the engine only through its seams (spmd.core.logical, spmd.core.family) and
the engine imports no model, commands share only public names, and nothing but spmd/assembly/setup.py
assembles a run."""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The repository's code folders and the import names they install as (pyproject's package-dir).
PACKAGES = {"spmd": "spmd", "models": "spmd.models", "kernels": "spmd.kernels"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts))
            mods[name.removesuffix(".__init__")] = path
    return mods


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The project's wheel, built from a copy (setuptools writes build/ beside the sources)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", *PACKAGES, "configs", "sharding_rules"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    (built,) = root.glob("*.whl")
    return built


def test_the_wheel_installs_one_top_level_name_with_every_module_and_preset(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (top,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top).decode().split() == ["spmd"]
    expected = {
        "/".join(m.split(".")) + ("/__init__.py" if p.name == "__init__.py" else ".py")
        for m, p in _modules().items()
    }
    assert expected <= names, sorted(expected - names)
    assert "spmd/configs/small.toml" in names and "spmd/sharding_rules/fsdp_tp.toml" in names


# Python 3.11 with torch and transformers (the HF fixtures' venv; .ci/run makes it).
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"
BESIDE = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
import spmd
assert importlib.util.find_spec("kernels") is None and importlib.util.find_spec("models") is None
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1))
print(spmd.__file__)
"""


@pytest.mark.skipif(
    not TORCH_PYTHON.exists(), reason="needs .venv-torch: Python 3.11 with torch and transformers"
)
def test_transformers_builds_a_model_beside_the_installed_wheel(wheel, tmp_path):
    """Installed with its metadata into a directory on transformers' path, the wheel shadows no
    package of another (no top-level `kernels` for the kernel hub, no `models`), and transformers
    builds a model beside it."""
    target = tmp_path / "site"
    subprocess.run(
        [str(TORCH_PYTHON), "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python", "--target",
         str(target), str(wheel)], check=True, capture_output=True,
    )  # fmt: skip
    result = subprocess.run(
        [str(TORCH_PYTHON), "-c", BESIDE, str(target)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path,  # not the repository root, whose source folders `-c` would put on the path
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith(str(target))


def _imports(path: pathlib.Path, mods) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every first-party import, at any depth of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in mods]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
            names = [a.name for a in node.names]
            out.append((node.module, names))
            out += [(f"{node.module}.{n}", []) for n in names if f"{node.module}.{n}" in mods]
    return out


def _graph():
    mods = _modules()
    return {m: sorted({d for d, _ in _imports(p, mods) if d != m}) for m, p in mods.items()}


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in graph[m]:
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert [c for c in cycles if len(set(c)) > 1] == []


def _engine(m: str) -> bool:
    return not m.startswith(("spmd.models", "spmd.kernels"))


def test_models_reach_spmd_only_through_the_seams():
    """Models see the engine through two seams: spmd.core.logical (axis names, constraints, parallel
    ops) and spmd.core.family (the contract they fill in), and raise its UserError."""
    graph = _graph()
    used = {d for m, deps in graph.items() if m.startswith("spmd.models") for d in deps if _engine(d)}
    assert used == {"spmd.core.logical", "spmd.core.family", "spmd.core.errors"}


def test_the_engine_imports_no_model():
    """No module of the engine imports a model family or a model module: it finds a family by
    name at run time (spmd.core.family.find)."""
    graph = _graph()
    reached = {(m, d) for m, deps in graph.items() if _engine(m) for d in deps if d.startswith("spmd.models")}
    assert reached == set()


def test_no_private_names_cross_modules():
    mods = _modules()
    private = [
        (m, d, n)
        for m, p in mods.items()
        for d, names in _imports(p, mods)
        for n in names
        if n.startswith("_") and d != m
    ]
    assert private == []


def test_only_setup_assembles_a_run():
    """The chain config -> mesh -> rules -> plan -> trainer is built in spmd/assembly/setup.py alone."""
    callers = []
    for path in [*ROOT.glob("spmd/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/*.py")]:
        text = path.read_text()
        if path.name != "test_layout.py" and ("build_trainer(" in text or "sharding_lib.plan(" in text):
            callers.append(path.relative_to(ROOT).as_posix())
    assert sorted(callers) == [
        "spmd/assembly/setup.py",
        "spmd/training/trainer.py",
    ]  # trainer.py defines build_trainer


def test_run_from_the_repository_root_kernels_and_models_are_whatever_else_is_installed(tmp_path):
    """The repository's models/ and kernels/ folders have no `__init__.py`: with the current
    directory first on the path (`python -c`, `python -` or a notebook at the repository root), a
    package of that name installed elsewhere (Hugging Face's `kernels`) is the one imported, while
    spmd.kernels and spmd.models still import."""
    for name in ("kernels", "models"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("WHO = 'installed elsewhere'\n")
    code = (
        "import kernels, models, spmd.kernels.tuning, spmd.models.llama; print(kernels.WHO, '|', models.WHO)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[0] == "installed elsewhere | installed elsewhere"
    assert not (ROOT / "kernels" / "__init__.py").exists() and not (ROOT / "models" / "__init__.py").exists()


BUILD = """
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1))
"""


def _finetune_snippet() -> str:
    """docs/finetune.md's Python block that loads an exported model into transformers."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "finetune.md").read_text(), re.S)
    (snippet,) = [b for b in blocks if "AutoModelForCausalLM" in b and "hf/sft" in b]
    return snippet


@pytest.mark.skipif(
    not TORCH_PYTHON.exists(), reason="needs .venv-torch: Python 3.11 with torch and transformers"
)
def test_the_finetune_snippet_runs_from_the_repository_root():
    """As a reader runs it: from the repository root (where the recipe's relative paths lead), on
    stdin, so the current directory is first on the path; an exported chat model (the fixture
    transformers made) stands in for hf/sft. Then transformers builds a model there too."""
    model = ROOT / "tests" / "fixtures" / "chat" / "llama-chat"
    code = _finetune_snippet().replace('"hf/sft"', repr(str(model))) + BUILD
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(TORCH_PYTHON), "-"], input=code, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), "the snippet printed no generated text"
