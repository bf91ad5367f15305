"""Turn pydantic validation errors and YAML/JSON/CSV read errors into one-line ``SpecError``s."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from hetserve.errors import SpecError

M = TypeVar("M", bound=pydantic.BaseModel)


def _expected(err: dict[str, Any], model: type[pydantic.BaseModel] | None) -> str:
    kind, msg = err.get("type", ""), err.get("msg", "")
    if kind == "missing":
        return "a value (the field is required)"
    if kind == "extra_forbidden":
        return "no such field (check its spelling)"
    if kind in ("too_long", "too_short") and " should have " in msg:  # "List should have at least 1 item after validation, not 0"
        return msg.split(" should have ", 1)[1].replace(" after validation", "")
    if kind == "tuple_type":  # the files' pairs: a stage's layers [start, end), a link's two sites
        return "a list of two, e.g. [0, 4]"
    for prefix in ("Input should be ", "Value error, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg[0].lower() + msg[1:] if msg else "a valid value"


def validate(model: type[M], data: Any, source: str) -> M:
    """Validate ``data`` against a pydantic model; the first problem becomes a SpecError. A field
    that is not known comes first: a misspelt key is also why its right spelling is missing
    (``bandwdth_gbps``: the error names it, and says that ``bandwidth_gbps`` is required there)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        extra = [e for e in errors if e.get("type") == "extra_forbidden"]
        err = extra[0] if extra else errors[0]
        loc = tuple(err.get("loc", ()))
        field = ".".join(str(p) for p in loc) or "(top level)"
        got = err.get("input") if err.get("type") not in ("missing",) else None
        if isinstance(got, (dict, list)):
            got = None  # a whole sub-document is not a helpful "got"
        expected = _expected(err, model)
        missing = [repr(str(e["loc"][-1])) for e in errors
                   if extra and e.get("type") == "missing" and tuple(e.get("loc", ()))[:-1] == loc[:-1]]
        if missing:  # the unknown key is likely the misspelling of the one missing beside it
            expected = (f"no such field (check its spelling; {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} required here)")
        raise SpecError(source, field, expected, got) from exc


# a top-level field that tells a file's kind: a file of one kind given where another is read is
# named as such, not as a list of misspelt fields
FILE_KINDS = {"machines": "a cluster file", "replicas": "a plan file"}
# fields of what hetserve writes that no input file has: they tell the kind even beside an input's
# own field (a simulation summary lists its replicas, as a plan does)
OUTPUT_KINDS = {"slo_attainment": "a simulation summary, as hetserve simulate -o writes",
                "rate_sweep": "a rate sweep, as hetserve simulate --sweep-rates writes"}


def refuse_other_kind(data: dict[str, Any], source: str, own: str, expected: str) -> None:
    """``data`` is what hetserve writes, or lacks this kind's field ``own`` but has another kind's:
    one line saying which."""
    for key, kind in OUTPUT_KINDS.items():
        if key in data:
            raise SpecError(source, "(top level)", expected, f"{kind} (it has {key})")
    if own in data:
        return
    for key, kind in FILE_KINDS.items():
        if key != own and key in data:
            raise SpecError(source, "(top level)", expected, f"{kind} (it lists {key})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last value,
    so ``bandwidth_gbps`` written twice would silently take the second."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"found the key {key!r} twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _json_object(pairs):
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise json.JSONDecodeError(f"the key {twice[0]!r} twice in one object", "", 0)
    return dict(pairs)


def existing_path(name: str | Path) -> Path | None:
    """The file or folder ``name`` names here, if there is one. A blank name names none: ``Path("")``
    is the current folder, which a user who typed no name did not mean."""
    path = Path(name)
    return path if str(name).strip() and path.exists() else None


def shown_name(name: str | Path) -> str:
    """``name`` as an error shows it (an empty one as ``''``, not as nothing)."""
    return str(name) or "''"


# The largest spec file read (a plan of a thousand GPUs is a few megabytes). A path may come from a
# request (``/admin/replan``'s cluster): /dev/zero would otherwise be read until memory ran out.
MAX_SPEC_FILE_BYTES = 64 << 20


def read_text_file(path: Path, limit: int = MAX_SPEC_FILE_BYTES) -> str:
    """The UTF-8 text of ``path``: a regular file (not a device, FIFO or folder: opening a FIFO does
    not block, nothing is read from the others) of at most ``limit`` bytes; SpecError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SpecError(str(path), "(file)", "a regular file")
            raw = f.read(limit + 1)
    except OSError as exc:
        raise SpecError(str(path), "(file)", "a readable file", str(exc.strerror)) from exc
    if len(raw) > limit:
        raise SpecError(str(path), "(file)", f"a file of at most {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), "(file)", "a UTF-8 text file", str(exc)) from exc


def read_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML or JSON file that must hold a mapping at the top level."""
    text = read_text_file(path)
    try:
        data = (json.loads(text, object_pairs_hook=_json_object) if path.suffix == ".json"
                else yaml.load(text, Loader=_UniqueKeyLoader))
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        where, began = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        if where is not None and began is not None and began.line != where.line:
            # an unclosed bracket is noticed lines later: name where it opened too
            line = f" (line {began.line + 1}, noticed at line {where.line + 1})"
        raise SpecError(str(path), "(file)", f"valid YAML/JSON{line}", str(exc).splitlines()[0]) from exc
    if data is None:
        raise SpecError(str(path), "(top level)", "a mapping of fields", "an empty file")
    if not isinstance(data, dict):
        raise SpecError(str(path), "(top level)", "a mapping of fields", type(data).__name__)
    return data
