"""Every error densekit raises on purpose is a `DensekitError` (`densekit.errors`): the source is walked
for a bare `raise ValueError(...)` or `raise RuntimeError(...)`, which only pydantic's validators may
keep (pydantic turns their ValueError into a ValidationError, and a request's answer repeats its repr)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from densekit import errors

SOURCE = Path(__file__).resolve().parents[1] / "src" / "densekit"
BARE = {"ValueError", "RuntimeError"}
VALIDATOR_DECORATORS = {"field_validator", "model_validator", "validator", "root_validator"}
VALIDATOR_WRAPPERS = {"AfterValidator", "BeforeValidator", "PlainValidator", "WrapValidator"}
# Checks that request models' validators call from another module: pydantic puts the error's repr into
# the 422 answer, so the class stays ValueError for the answer to stay as it is.
VALIDATOR_HELPERS = {"only_a_number"}
# Edited on another branch at the time of writing; its three raises become InputError when it merges.
PENDING = {"index/backends/quantized_index.py": 3}


def _name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _validator_functions(tree: ast.Module) -> set[str]:
    """Names of the functions `tree` hands to pydantic as validators (`AfterValidator(check)`)."""
    return {
        arg.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _name(node.func) in VALIDATOR_WRAPPERS
        for arg in node.args
        if isinstance(arg, ast.Name)
    }


def bare_raises(source: str, filename: str = "<source>") -> list[str]:
    """`file:line: raise X` for each `raise ValueError`/`RuntimeError` of `source` outside a pydantic
    validator (a decorated one, a function given to an `...Validator(...)`, or VALIDATOR_HELPERS)."""
    tree = ast.parse(source, filename)
    exempt = _validator_functions(tree) | VALIDATOR_HELPERS
    found: list[str] = []

    def visit(node: ast.AST, in_validator: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_validator
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                decorators = {_name(d) for d in child.decorator_list}
                inside = inside or child.name in exempt or bool(decorators & VALIDATOR_DECORATORS)
            if isinstance(child, ast.Raise) and child.exc is not None and not inside:
                raised = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(raised, ast.Name) and raised.id in BARE:
                    found.append(f"{filename}:{child.lineno}: raise {raised.id}")
            visit(child, inside)

    visit(tree, False)
    return found


def test_densekit_raises_its_own_errors_not_bare_value_or_runtime_errors():
    problems: list[str] = []
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE).as_posix()
        found = bare_raises(path.read_text(encoding="utf-8"), f"src/densekit/{relative}")
        if relative in PENDING and len(found) <= PENDING[relative]:
            continue
        problems += found
    assert not problems, (
        "raise one of densekit.errors (SettingError, InputError, StateError, or a module's own "
        "DensekitError) instead of:\n" + "\n".join(problems)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    raise ValueError('x')\n", ["<source>:2: raise ValueError"]),
        ("def f():\n    raise RuntimeError\n", ["<source>:2: raise RuntimeError"]),
        ("class C:\n    def f(self):\n        if 1:\n            raise ValueError('x')\n",
         ["<source>:4: raise ValueError"]),
        ("from densekit.errors import InputError\ndef f():\n    raise InputError('x')\n", []),
        ("class M(BaseModel):\n    @field_validator('a')\n    def _a(cls, v):\n"
         "        raise ValueError('x')\n",
         []),
        ("class M(BaseModel):\n    @model_validator(mode='after')\n    def _m(self):\n"
         "        def inner():\n            raise ValueError('x')\n        inner()\n", []),
        ("def _check(v):\n    raise ValueError('x')\nT = Annotated[str, AfterValidator(_check)]\n", []),
        ("def _check(v):\n    raise ValueError('x')\n", ["<source>:2: raise ValueError"]),
    ],
)  # fmt: skip
def test_the_walk_finds_bare_raises_outside_validators_only(source: str, expected: list[str]):
    assert bare_raises(source) == expected


@pytest.mark.parametrize(
    ("error", "builtin"),
    [(errors.SettingError, ValueError), (errors.InputError, ValueError), (errors.StateError, RuntimeError)],
)
def test_each_error_keeps_the_builtin_its_callers_catch(error: type[Exception], builtin: type[Exception]):
    assert issubclass(error, errors.DensekitError) and issubclass(error, builtin)
    with pytest.raises(builtin, match="a refusal"):
        raise error("a refusal")
