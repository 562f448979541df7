"""The package's own source, read for `push --with-code` (`hub.remote_code`): its modules parsed, each package import
resolved to the module that defines the name, and the modules a shipped module needs, in import order.

Only imports of names are followed; an import of a package module itself, or a star import, is refused, since remote
code could not inline it.
"""

import ast
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


PACKAGE = __name__.split(".")[0]
# What only the installed package does: recording its classes under the package's name (`exports.public`). Imports
# from these modules, and the decorators they give, are left out of remote code, whose classes keep their own module.
PACKAGE_ONLY_MODULES = (f"{PACKAGE}.exports",)


@dataclass(frozen=True)
class SourceModule:
    """One module of the package, parsed: its dotted `name`, its `path` relative to the folder that holds the package
    (`"diffusers_lmlp/models/backbone.py"`), its `source` text and its syntax `tree`."""

    name: str
    path: str
    source: str
    tree: ast.Module

    @property
    def package(self) -> str:
        """The package that its relative imports start from."""
        return self.name if self.path.endswith("__init__.py") else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class PackageImport:
    """An import from the package: its `node`, whether it is `top_level` (runs when the module is imported), and
    `bindings`: each name it binds -> (the module that defines the object, its name there)."""

    node: ast.ImportFrom
    top_level: bool
    bindings: dict[str, tuple[str, str]]


def load_module(name: str) -> SourceModule:
    """Read and parse a module of the package by its dotted name."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ModuleNotFoundError(f"{name} has no Python source file to generate remote code from.")
    origin = Path(spec.origin)
    root = Path(importlib.util.find_spec(PACKAGE).origin).parent.parent
    source = origin.read_text(encoding="utf-8")
    return SourceModule(name, origin.relative_to(root).as_posix(), source, ast.parse(source, filename=spec.origin))


def top_level_names(module: SourceModule) -> dict[str, ast.stmt]:
    """The names a module defines itself at the top level (functions, classes, assignments), with their statement."""
    names = {}
    for node in module.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
    return names


def _package_module(module: SourceModule, node: ast.ImportFrom) -> str | None:
    """The package module an import statement imports from, or None for an import from another library."""
    if node.level:
        return importlib.util.resolve_name("." * node.level + (node.module or ""), module.package)
    if node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
        return node.module
    return None


def defining_module(module_name: str, name: str, chain: tuple[str, ...] = ()) -> tuple[str, str]:
    """Where the object that `from <module_name> import <name>` imports is defined, following re-exports: (module,
    name there); `chain` holds the re-exports followed so far, to catch cycles."""
    where = f"{module_name}.{name}"
    if where in chain:
        raise ImportError(f"Circular re-export: {' -> '.join((*chain, where))}.")
    module = load_module(module_name)
    if name in top_level_names(module):
        return module_name, name
    for node in module.tree.body:
        if isinstance(node, ast.ImportFrom) and (source := _package_module(module, node)):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return defining_module(source, alias.name, (*chain, where))
    if module.path.endswith("__init__.py") and importlib.util.find_spec(where) is not None:
        raise ImportError(
            f"{module.path} imports the module {where} itself; remote code can only be generated from imports of "
            f"names (`from .{name} import SomeClass`)."
        )
    raise ImportError(f"Cannot find where {module.path} gets {name!r} from (a name set at run time?).")


def package_imports(module: SourceModule) -> list[PackageImport]:
    """Every statement of `module` that imports from the package, at any depth, resolved to the defining modules."""
    top = {id(node) for node in module.tree.body}
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import) and any(
            alias.name == PACKAGE or alias.name.startswith(PACKAGE + ".") for alias in node.names
        ):
            raise ImportError(
                f"{module.path}:{node.lineno} imports a module of the package (`{ast.unparse(node)}`); remote code "
                "can only be generated from imports of names (`from .module import SomeClass`)."
            )
        if not isinstance(node, ast.ImportFrom) or (source := _package_module(module, node)) is None:
            continue
        if any(alias.name == "*" for alias in node.names):
            raise ImportError(f"{module.path}:{node.lineno} star-imports {source}; import the names it uses.")
        bindings = {alias.asname or alias.name: defining_module(source, alias.name) for alias in node.names}
        found.append(PackageImport(node, id(node) in top, bindings))
    return found


def bundle_order(entry: str) -> list[SourceModule]:
    """`entry` and every package module it needs, each after the modules its top-level imports need."""
    order: list[SourceModule] = []
    done: set[str] = set()
    active: list[str] = []  # the modules being visited, outermost first

    def visit(name: str) -> None:
        if name in done:
            return
        if name in active:
            raise ImportError(f"Circular import at module level: {' -> '.join((*active, name))}.")
        active.append(name)
        module = load_module(name)
        later = []  # what imports inside functions need: present when they run, so in any place after this module
        for statement in package_imports(module):
            for source, _ in statement.bindings.values():
                if source in PACKAGE_ONLY_MODULES:
                    continue
                if statement.top_level:
                    visit(source)
                else:
                    later.append(source)
        active.pop()
        done.add(name)
        order.append(module)
        for source in later:
            if source not in active:
                visit(source)

    visit(entry)
    return order
