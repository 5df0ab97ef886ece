"""The README and docs/ cannot drift from the code: every command in their code blocks parses with
the real command's parser, names configs, rules presets and config keys that exist, gives mesh and
byte sizes the commands accept, and calls scripts with flags they define; the cheap ones (those
that print and exit) run; every link between the pages leads to a page that exists.

A code block's lines that start with `spmd-...` (or `.venv/bin/spmd-...`, `srun spmd-...`) or
`python scripts/...` are commands; `&&` and `;` separate commands on one line, and a trailing
backslash continues a line. Blocks marked `bash` are meant to run as written; `text` blocks may
name things the reader supplies (a Hub model, a path)."""

import importlib
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from spmd.analysis import topology
from spmd.assembly import config as config_lib
from spmd.assembly import planner
from spmd.core import mesh as mesh_lib
from spmd.core import presets

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.M | re.S)
CLI = {  # console script -> its module (pyproject's [project.scripts])
    "spmd-train": "train",
    "spmd-ckpt": "ckpt",
    "spmd-eval": "eval",
    "spmd-sample": "sample",
    "spmd-launch": "launch",
    "spmd-dryrun": "dryrun",
    "spmd-plan": "plan",
    "spmd-data": "data",
}
# Flags after which a command prints what was asked and exits, without training.
CHEAP = ("--print-rules", "--list-keys", "--print-sharding", "--help")


class Command:
    def __init__(self, page: pathlib.Path, line: int, lang: str, argv: list[str]):
        self.page, self.line, self.lang, self.argv = page, line, lang, argv

    def __repr__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {shlex.join(self.argv)}"


def _split(page: pathlib.Path, line: int, lang: str, text: str) -> list[Command]:
    """The commands of one shell line: ours and our scripts', split at `&&` and `;`."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    out, argv = [], []
    for token in [*lexer, ";"]:
        if token not in (";", "&&"):
            argv.append(token)
            continue
        argv = argv[1:] if argv[:1] == ["srun"] else argv
        if argv:
            argv[0] = argv[0].removeprefix(".venv/bin/")
        if argv and (
            argv[0].startswith("spmd-")
            or (argv[0] in ("python", "python3") and argv[1:2] and argv[1].startswith("scripts/"))
        ):
            out.append(Command(page, line, lang, argv))
        argv = []
    return out


# A command in the prose that is a template, not a command: `spmd-eval --run-dir DIR [--step N]`
# (and one of one or two words is a name: `spmd-ckpt verify`).
TEMPLATE = re.compile(r"\[|\.\.\.|<|\||\b[A-Z]{2,}\b")


def _commands() -> list[Command]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            lang, body = block.group(1), block.group(2)
            first = text.count("\n", 0, block.start(2)) + 1
            body = body.replace("\\\n", " ")  # continued lines (line numbers: the first's)
            for i, line in enumerate(body.splitlines()):
                if not re.search(r"\bspmd-\w+|scripts/[\w/]+\.py", line) or re.match(
                    r"\s*(#|\w+=\$\()", line
                ):
                    continue  # not a command line; a comment; a shell variable of the example
                out.extend(_split(page, first + i, lang, line))
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for span in re.finditer(r"`((?:\.venv/bin/)?spmd-[a-z]+ [^`]+|python3? scripts/[^`]+)`", prose):
            code = " ".join(span.group(1).split())
            if (code.startswith("python") or len(code.split()) > 2) and not TEMPLATE.search(
                code
            ):  # not a name: `spmd-ckpt verify`
                out.extend(_split(page, text.count("\n", 0, span.start()) + 1, "inline", code))
    return out


COMMANDS = _commands()
SPMD = [c for c in COMMANDS if c.argv[0].startswith("spmd-")]
SCRIPTS = [c for c in COMMANDS if not c.argv[0].startswith("spmd-")]


def test_the_docs_hold_commands_for_every_console_script_and_every_page():
    assert {c.argv[0] for c in SPMD} == set(CLI), (
        "a console script the docs never show, or one that is not ours"
    )
    with_commands = {c.page.name for c in COMMANDS}
    # library.md holds Python, run as written by tests/test_run.py
    assert {p.name for p in PAGES} - with_commands <= {"model-families.md", "library.md"}, with_commands


def _parse(argv: list[str]):
    module = importlib.import_module(f"spmd.cli.{CLI[argv[0]]}")
    try:
        return module.build_parser().parse_args(argv[1:])
    except SystemExit as e:
        if e.code == 0 and "--help" in argv:
            return None
        raise AssertionError(f"{argv[0]} rejects its arguments (exit {e.code})") from None


def _check_values(ns, cmd: Command) -> None:
    """What the parser takes as strings but the command reads as names or sizes."""
    config = getattr(ns, "config", None)
    config_names = presets.names(presets.folder("configs"))
    if config is not None:
        assert config in config_names, f"{cmd}: no config preset {config!r}"
    rules = getattr(ns, "rules", None)
    if rules is not None:
        assert rules in presets.names(presets.folder("sharding_rules")), f"{cmd}: no rules preset {rules!r}"
    for flag in ("mesh", "dcn_mesh"):
        if getattr(ns, flag, None):
            mesh_lib.parse_mesh(getattr(ns, flag))
    overrides = getattr(ns, "set", None) or []
    # keys and types: of the named config, else (a run's own config) of the default family's
    config_lib.load_config(config or "small", overrides)
    if getattr(ns, "memory_per_device", None):
        assert planner.parse_bytes(ns.memory_per_device) > 0
    if getattr(ns, "topology", None):
        topology.parse(ns.topology)


@pytest.mark.parametrize("cmd", SPMD, ids=repr)
def test_every_documented_command_parses_with_names_and_keys_that_exist(cmd):
    ns = _parse(cmd.argv)
    if ns is None:  # --help
        return
    _check_values(ns, cmd)
    if cmd.argv[0] == "spmd-launch":  # and the command it runs in every process
        inner = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
        assert inner and inner[0] in CLI, cmd
        _check_values(_parse(inner), cmd)


def _script_flags(path: pathlib.Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))


@pytest.mark.parametrize("cmd", SCRIPTS, ids=repr)
def test_every_documented_script_exists_and_takes_the_flags_given(cmd):
    path = ROOT / cmd.argv[1]
    assert path.is_file(), f"{cmd}: no such script"
    given = {a.split("=")[0] for a in cmd.argv[2:] if a.startswith("--")}
    assert given <= _script_flags(path), f"{cmd}: {sorted(given - _script_flags(path))} not defined"


def test_the_readme_holds_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    (line,) = [x for x in ci.splitlines() if "-m pytest" in x and not x.startswith("#")]
    assert line.strip() in (ROOT / "README.md").read_text()


def test_every_link_between_pages_leads_to_a_page():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.relative_to(ROOT)} links to missing {target}"
    linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", (ROOT / "README.md").read_text()))
    assert linked == {p.name for p in PAGES[1:]}, "a docs page the README does not link"


def _console(name: str) -> pathlib.Path:
    path = pathlib.Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to this Python (run the README's `pip install -e .`)")
    return path


CHEAP_COMMANDS = [
    c
    for c in SPMD
    if c.lang == "bash"
    and (any(flag in c.argv for flag in CHEAP) or (c.argv[0] == "spmd-dryrun" and "tiny" in c.argv))
]


@pytest.mark.parametrize("cmd", CHEAP_COMMANDS, ids=repr)
def test_the_cheap_commands_run_as_written(cmd, tmp_path):
    result = subprocess.run(
        [str(_console(cmd.argv[0])), *cmd.argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{cmd}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), cmd
    assert "Traceback" not in result.stderr and "error:" not in result.stderr, result.stderr[-3000:]


def test_there_are_cheap_commands_to_run():
    kinds = {next(f for f in (*CHEAP, "spmd-dryrun") if f in c.argv) for c in CHEAP_COMMANDS}
    assert {"--print-rules", "--list-keys", "--print-sharding", "spmd-dryrun"} <= kinds
