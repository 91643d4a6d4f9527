"""One owner per state: no object in stabljax/control assigns another object's attributes.

A value is set by its owner's own code (``self.x = ...`` in its methods), passed in as a
constructor or method argument, or asked for; never written from outside
(``store.keeps_best = ...``). Read from the source's syntax tree, so no path through the
code escapes it: plain, tuple, starred, augmented and annotated targets, ``for`` and
``with`` targets, ``del``, and ``setattr`` with a target other than ``self`` or ``cls``.
"""

from __future__ import annotations

import ast
import pathlib

CONTROL = pathlib.Path(__file__).parent.parent / "stabljax" / "control"
OWN = {"self", "cls"}

ALLOWED: dict[str, str] = {}
"""``"path:line"`` -> why that assignment is the owner's after all. Empty: none is."""


def foreign_assignments(source: str, name: str = "<src>") -> list[str]:
    """``"name:line: target"`` for each write to an attribute of something not ``self``/``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            if not (isinstance(node.value, ast.Name) and node.value.id in OWN):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN)
        ):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_catches_every_form_of_outside_assignment():
    src = """
class A:
    def f(self, other, cls):
        self.ok = 1
        cls.ok = 2
        other.x = 1
        self.a, other.y = 1, 2
        [other.z, *other.w] = [1, 2]
        other.n += 1
        other.t: int = 3
        self.store.field = 4
        for other.i in range(2):
            pass
        with open("f") as other.fh:
            pass
        del other.x
        setattr(other, "v", 1)
        setattr(self, "ok", 1)
"""
    got = [line.split(": ", 1)[1] for line in foreign_assignments(src)]
    assert sorted(got) == sorted(
        [
            "other.x",
            "other.y",
            "other.z",
            "other.w",
            "other.n",
            "other.t",
            "self.store.field",
            "other.i",
            "other.fh",
            "other.x",
            "setattr(other, 'v', 1)",
        ]
    )


def test_no_object_in_control_assigns_another_objects_attributes():
    found = []
    for path in sorted(CONTROL.rglob("*.py")):
        rel = path.relative_to(CONTROL.parent.parent).as_posix()
        found += foreign_assignments(path.read_text(), rel)
    unexplained = [f for f in found if f.rsplit(": ", 1)[0] not in ALLOWED]
    assert unexplained == []
    stale = set(ALLOWED) - {f.rsplit(": ", 1)[0] for f in found}
    assert not stale, f"allow-list entries that match nothing: {sorted(stale)}"
