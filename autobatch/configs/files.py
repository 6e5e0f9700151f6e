"""Read and write config files (JSON, YAML) with one-line errors instead of tracebacks.

The format follows the file's suffix: ``.json`` or ``.yaml``/``.yml``. Writes are atomic (a
temporary file in the same folder, then a rename) so an interrupted run never leaves half a config.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ..errors import AutobatchError

__all__ = ["ConfigFileError", "read_config", "write_config"]

_JSON = (".json",)
_YAML = (".yaml", ".yml")


class ConfigFileError(AutobatchError):
    """A config file cannot be read, parsed or written.

    Attributes:
        path: The file.
        problem: What is wrong, stated as the rule and the value (``"must exist, but …"``).
        fix: What to do about it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str):
        self.path = os.fspath(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"config file {problem}; {fix}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed refuses duplicate keys; plain json.loads would silently keep the last one.
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as error:
        try:  # JSON with comments, as DeepSpeed reads it: numbers kept as written (hjson reads 1.0 as 1)
            return json.loads(_uncommented(text), object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError:
            pass
        # DeepSpeed reads hjson (unquoted keys, trailing commas); accept it when that library is installed.
        try:
            import hjson
        except ImportError:
            raise error from None  # the JSON error is the one to show, not the missing library
        return hjson.loads(text, object_pairs_hook=_no_duplicates)


def _uncommented(text: str) -> str:
    r"""``text`` without the ``//``, ``#`` and ``/* */`` comments outside its quoted strings.

    Example:
        >>> _uncommented('{"a": "s3://x", // why\n "b": 1.0 /* kept */}')
        '{"a": "s3://x", \n "b": 1.0 }'
    """
    out, quote, i = [], False, 0
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                out.append(text[i:i + 2])
                i += 2
                continue
            quote = char != '"'
        elif char == '"':
            quote = True
        elif char == "#" or text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = len(text) if end < 0 else end + 2
            continue
        out.append(char)
        i += 1
    return "".join(out)


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a JSON or YAML config file as a dict.

    Args:
        path: A ``.json``, ``.yaml`` or ``.yml`` file.

    Raises:
        ConfigFileError: missing, unreadable or malformed file, or not a mapping at the top level;
            the message names the file and the cause in one line.

    Example:
        >>> read_config("ds_config.json")  # doctest: +SKIP
        {'train_batch_size': 224, ...}
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(path, f"must exist, but {str(path)!r} was not found", "check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(path, f"must be readable, but reading {str(path)!r} failed: {exc}", "check the file") from None
    kind = "YAML" if path.suffix.lower() in _YAML else "JSON"
    try:
        data = yaml.safe_load(text) if kind == "YAML" else _parse_json(text)
    except (ValueError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())  # parsers write several lines; the CLI shows one
        raise ConfigFileError(path, f"must be valid {kind}, but {str(path)!r} failed to parse: {detail}", f"fix the {kind} syntax") from None
    except RecursionError:
        raise ConfigFileError(
            path, f"must be a config, but {str(path)!r} is nested too deeply to parse", f"check that it is the {kind} file you meant"
        ) from None
    if not isinstance(data, dict):
        raise ConfigFileError(
            path,
            f"must hold a mapping of keys to values, but {str(path)!r} holds a {type(data).__name__}",
            "put the settings in a top-level mapping",
        )
    return data


_OUR_HEADER = "# written by autobatch:"  # the comment block accelerate files get from us: ours to rewrite


def has_comments(path: str | os.PathLike[str]) -> bool:
    """Whether a file holds comments of its user's, which a rewrite loses: ``//``, ``/* */`` or ``#`` in
    JSON (DeepSpeed reads it as HJSON), ``#`` in YAML, less the header autobatch wrote itself; never
    what is inside a quoted string (``"output_path": "s3://runs"``, ``name: "run #2"``).

    Example:
        >>> _comment_in('{"output_path": "s3://runs/#1"}', json=True), _comment_in('{"a": 1} // why', json=True)
        (False, True)
        >>> _comment_in("name: 'run #2'", json=False), _comment_in("note: it's 4  # fits", json=False)
        (False, True)
    """
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    if lines and lines[0].startswith(_OUR_HEADER):
        while lines and lines[0].lstrip().startswith("#"):
            lines.pop(0)
    return _comment_in("\n".join(lines), json=Path(path).suffix.lower() not in _YAML)


def _comment_in(text: str, *, json: bool) -> bool:
    """Whether ``text`` has a comment outside its quoted strings: JSON's ``"…"`` (HJSON's ``//``, ``/*``
    and ``#``: what :func:`_uncommented` takes out), YAML's ``"…"`` and ``'…'`` (``#`` at a line's start or
    after a blank)."""
    if json:
        return _uncommented(text) != text
    quote, previous, before, i = "", "\n", "\n", 0  # before: the last character that is no blank
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\" and quote == '"':
                i += 1  # an escaped character, a quote among them
            elif char == quote:
                quote = ""
        elif char in "\"'" and before in "\n:-[{,?":  # YAML quotes open a value only
            quote = char
        elif char == "#" and previous in " \t\n":
            return True
        previous = char
        before = char if char not in " \t" else before
        i += 1
    return False


def keep_original(path: str | os.PathLike[str]) -> Path | None:
    """Before a file with its user's comments is rewritten (JSON and YAML writers keep none), copy it
    to ``NAME.orig`` (``NAME.orig.1``, … where taken); the copy, or ``None`` where nothing is lost.
    A copy that already holds the same bytes is reused, so the file is copied once however often asked."""
    path = Path(path)
    if not path.is_file() or not has_comments(path):
        return None
    original = path.read_bytes()
    for n in range(1000):
        copy = path.with_name(f"{path.name}.orig" + (f".{n}" if n else ""))
        if not copy.exists():
            copy.write_bytes(original)
            return copy
        if copy.read_bytes() == original:
            return copy
    raise ConfigFileError(path, f"comments must be kept, but {path.name}.orig … .orig.999 are all taken",
                          "move the old copies away")


def write_config(path: str | os.PathLike[str], data: dict[str, Any], *, comment: str | None = None) -> Path:
    """Write ``data`` as JSON or YAML (by suffix), atomically, and return the path. An existing file
    with its user's comments is copied first (:func:`keep_original`).

    Args:
        path: Target file; ``.json``, ``.yaml`` or ``.yml``. Parent folders are created.
        data: The config mapping; key order is kept.
        comment: For YAML only: lines written as ``#`` comments at the top (JSON has no comments).

    Example:
        >>> write_config("accelerate.yaml", {"num_processes": 16}, comment="made by autobatch")  # doctest: +SKIP
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in _JSON:
        text = json.dumps(data, indent=2) + "\n"
    elif suffix in _YAML:
        header = "".join(f"# {line}\n" if line else "#\n" for line in (comment or "").splitlines())
        text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    else:
        raise ConfigFileError(path, f"name must end in .json, .yaml or .yml, but got {str(path)!r}", "rename it")
    tmp = None
    try:
        keep_original(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # keep an existing file's permissions; mkstemp alone would leave 0600
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise ConfigFileError(path, f"must be writable, but writing {str(path)!r} failed: {exc}", "check the folder and permissions") from None
    return path
