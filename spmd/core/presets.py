"""Preset files: a name from a preset directory (configs/, sharding_rules/) or a path to a TOML file."""

import pathlib
import tomllib

from spmd.core.errors import UserError, closest


def folder(name: str) -> pathlib.Path:
    """A preset folder (configs, sharding_rules): inside the installed package, or at the top of
    a source tree (the same folder: pyproject maps it into the wheel)."""
    here = pathlib.Path(__file__).resolve().parent.parent  # the spmd package
    return here / name if (here / name).is_dir() else here.parent / name


def names(directory: pathlib.Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.toml"))


def resolve(name_or_path: str, directory: pathlib.Path, kind: str, relative_to: pathlib.Path | None = None):
    """The file a --config/--rules value means: a path (a .toml suffix, or an existing file;
    relative to `relative_to` when given) or else the preset `directory/NAME.toml`. `kind` names
    the preset in the error ("config", "rules preset")."""
    path = pathlib.Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return relative_to / path if relative_to is not None and not path.is_absolute() else path
    path = directory / f"{name_or_path}.toml"
    if not path.exists():
        choices = names(directory)
        raise UserError(
            f"unknown {kind} {name_or_path!r}{closest(name_or_path, choices)}; "
            f"presets are {', '.join(choices)}, or pass a path to a .toml file"
        )
    return path


def display_name(path: pathlib.Path, directory: pathlib.Path) -> str:
    """A preset's name, or the path of any other file."""
    return path.stem if path.parent == directory else str(path)


def read(path: pathlib.Path, kind: str, hint: str = "") -> dict:
    """The TOML document at `path`; `kind` ("config file", "rules file") names it in errors."""
    if not path.is_file():
        raise UserError(f"{kind} {str(path)!r} not found{hint}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{kind} {str(path)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"{kind} {str(path)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8"
        ) from None
