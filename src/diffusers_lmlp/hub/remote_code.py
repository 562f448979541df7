"""`push --with-code`: ship the pipeline's code in the repo, so that diffusers loads it without diffusers-lmlp.

`model_index.json` then names files that `DiffusionPipeline.from_pretrained(repo, trust_remote_code=True)` runs, each
generated from the installed package (`bundle_source`): a class's module and every package module it needs, in import
order, package imports taken out (only imports of names are followed; a module import or star import is refused).
One self-contained file per component, because
diffusers fetches only the file `model_index.json` names and the files it imports one level deep; all remote code
shares one module folder, hence the "lmlp" in the file names (`file_stem`). With the package installed,
`LMLPPipeline.from_pretrained` maps the entries back (`package_model_index`) and runs no file.
"""

import ast
import hashlib
import importlib
import importlib.util
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..pipelines.model_index import package_model_index


PACKAGE = __name__.split(".")[0]
# What only the installed package does (recording its classes under its name): left out of remote code, with the
# decorators these modules give.
PACKAGE_ONLY_MODULES = (f"{PACKAGE}.exports",)


@dataclass(frozen=True)
class SourceModule:
    """One module of the package, parsed: dotted `name`, `path` from the package's parent folder, `source`, `tree`."""

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
    """An import from the package: its `node`, whether it is `top_level`, and `bindings`: each name it binds -> (the
    module that defines the object, its name there)."""

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
    """Where the object `from <module_name> import <name>` imports is defined, following re-exports: (module, name
    there); `chain` holds the re-exports followed so far, to catch cycles."""
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


MODEL_INDEX = "model_index.json"
LINE_LENGTH = 119
# A line that diffusers' import scan (a regex over every line, strings included) reads as an import, and its module:
# diffusers would import it (or copy a relative one's file), so no shipped line may name the package this way.
_SCANNED_IMPORT = re.compile(r"^(\s*)(?:import\s+(\S+)\s*$|from\s+(\S+)\s+import)")


def _statement_lines(module: SourceModule, node: ast.stmt) -> tuple[int, int, str]:
    """The 0-based first and last line of a statement that has its lines to itself, and its indentation."""
    lines = module.source.splitlines()
    first, last = node.lineno - 1, node.end_lineno - 1
    indent = lines[first][: node.col_offset]
    rest = lines[last][node.end_col_offset :].strip()
    if indent.strip() or (rest and not rest.startswith("#")):
        raise SyntaxError(f"{module.path}:{node.lineno}: put this import on lines of its own to generate remote code.")
    return first, last, indent


def _external_imports(module: SourceModule) -> list[ast.Import | ast.ImportFrom]:
    """The module's top-level imports from other libraries: they move to the top of the generated file."""
    return [
        node
        for node in module.tree.body
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and _package_module(module, node) is None)
    ]


def _module_body(module: SourceModule) -> str:
    """The module's text without docstring, external imports, package imports (an alias becomes `Alias = Name`) and
    `PACKAGE_ONLY_MODULES` decorators."""
    edits: dict[int, tuple[int, list[str]]] = {}  # first line -> (last line, replacement lines)
    body = module.tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            edits[body[0].lineno - 1] = (body[0].end_lineno - 1, [])
    for node in _external_imports(module):
        first, last, _ = _statement_lines(module, node)
        edits[first] = (last, [])
    package_only = set()  # the names bound from PACKAGE_ONLY_MODULES
    for statement in package_imports(module):
        package_only |= {bound for bound, (source, _) in statement.bindings.items() if source in PACKAGE_ONLY_MODULES}
        first, last, indent = _statement_lines(module, statement.node)
        renames = [f"{indent}{bound} = {name}" for bound, (_, name) in statement.bindings.items() if bound != name]
        # A nested import may be the only statement of its block: keep the block valid.
        edits[first] = (last, renames or ([] if statement.top_level else [f"{indent}pass"]))
    for node in ast.walk(module.tree):
        for decorator in getattr(node, "decorator_list", []):
            if isinstance(decorator, ast.Name) and decorator.id in package_only:
                edits[decorator.lineno - 1] = (decorator.end_lineno - 1, [])
    lines = module.source.splitlines()
    for first in sorted(edits, reverse=True):
        last, replacement = edits[first]
        lines[first : last + 1] = replacement
    return "\n".join(lines).strip("\n")


def _binding(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, str]:
    """The name an import alias binds and what it binds it to (`import a.b` binds `a` to the module `a`)."""
    if isinstance(node, ast.Import):
        if alias.asname:
            return alias.asname, alias.name
        top = alias.name.split(".")[0]
        return top, top
    return alias.asname or alias.name, f"{node.module}.{alias.name}"


def _check_one_namespace(modules: list[SourceModule]) -> None:
    """Raise if two of the modules bind one top-level name to different things: in one file they would clash."""
    # name -> ("module.name" it binds, its definition's dump if defined here (equal ones do not clash), module path)
    seen: dict[str, tuple[str, str | None, str]] = {}
    for module in modules:
        bound = {name: (f"{module.name}.{name}", ast.dump(node)) for name, node in top_level_names(module).items()}
        for node in _external_imports(module):
            for alias in node.names:
                name, target = _binding(node, alias)
                bound[name] = (target, None)
        for statement in package_imports(module):
            if statement.top_level:
                bound.update((name, (".".join(origin), None)) for name, origin in statement.bindings.items())
        for name, (what, definition) in bound.items():
            if name in seen and seen[name][0] != what and (definition is None or seen[name][1] != definition):
                raise NameError(
                    f"{seen[name][2]} and {module.path} both define {name!r} at the top level, differently; the "
                    "remote-code file holds both modules in one namespace. Rename one of them."
                )
            seen.setdefault(name, (what, definition, module.path))


def _render_imports(modules: list[SourceModule]) -> str:
    """The top-level imports of every module from other libraries, merged: standard library first, then the rest."""
    plain: set[str] = set()
    names: dict[str, set[str]] = {}
    for module in modules:
        for node in _external_imports(module):
            for alias in node.names:
                text = f"{alias.name} as {alias.asname}" if alias.asname else alias.name
                if isinstance(node, ast.Import):
                    plain.add(text)
                else:
                    names.setdefault(node.module, set()).add(text)

    def section(top: str) -> int:
        return 0 if top == "__future__" else 1 if top in sys.stdlib_module_names else 2

    def from_line(source: str) -> str:
        line = f"from {source} import {', '.join(sorted(names[source]))}"
        if len(line) <= LINE_LENGTH:
            return line
        return f"from {source} import (\n" + "".join(f"    {name},\n" for name in sorted(names[source])) + ")"

    blocks = []
    for number in range(3):
        block = [f"import {text}" for text in sorted(plain) if section(text.split(".")[0]) == number]
        block += [from_line(source) for source in sorted(names) if section(source.split(".")[0]) == number]
        if block:
            blocks.append("\n".join(block))
    return "\n\n".join(blocks)


def _as_comment(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in text.strip("\n").splitlines()]


def _rewrite_scanned_imports(text: str) -> str:
    """Prefix `>>> ` to lines inside strings (docstring examples) that diffusers' import scan would take for an import
    of the package or a relative module; raise for such a line outside a string."""
    lines = text.splitlines()
    inside_strings = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if tokenize.tok_name[token.type] in ("STRING", "FSTRING_MIDDLE"):  # FSTRING_*: Python 3.12+
            inside_strings.update(range(token.start[0], token.end[0] + 1))
    for number, line in enumerate(lines, start=1):
        match = _SCANNED_IMPORT.match(line)
        if match is None:
            continue
        named = match.group(2) or match.group(3)
        if named.startswith(".") or named.split(".")[0] == PACKAGE:
            if number not in inside_strings:
                raise SyntaxError(f"Line {number} of the generated code imports {named}: {line.strip()}")
            lines[number - 1] = f"{match.group(1)}>>> {line[len(match.group(1)) :]}"
    return "\n".join(lines) + "\n"


def check_self_contained(text: str, filename: str = "<remote code>") -> None:
    """Raise unless the generated `text` compiles and imports nothing relative or from the package, at any depth."""
    for node in ast.walk(ast.parse(text, filename=filename)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = ["." * node.level + (node.module or "")]
        for name in modules:
            if name.startswith(".") or name.split(".")[0] == PACKAGE:
                raise ImportError(f"{filename}:{node.lineno} imports {name}; remote code must be self-contained.")
    compile(text, filename, "exec")


def bundle_source(entry: str, class_name: str) -> str:
    """One self-contained file: the module `entry` defining `class_name` and everything it needs from the package.
    The same package source gives the same text."""
    modules = bundle_order(entry)
    _check_one_namespace(modules)
    digest = hashlib.sha256()
    for module in modules:  # whole source files
        digest.update(f"{module.path}\n{len(module.source)}\n{module.source}".encode())
    header = [
        f"# Generated from diffusers-lmlp {__version__} by `python -m diffusers_lmlp.hub push --with-code`: do not",
        "# edit. Change the package and push again. Its source files, in this order:",
        *(f"#   {module.path}" for module in modules),
        f"# sha256 of those files: {digest.hexdigest()}",
    ]
    docstring = (
        f'"""`{class_name}` of diffusers-lmlp, for diffusers\' remote code.\n\n'
        "`DiffusionPipeline.from_pretrained(repo, trust_remote_code=True)` runs this file; it needs diffusers,\n"
        'transformers and torch, not diffusers-lmlp."""'
    )
    parts = ["\n".join(header), docstring, _render_imports(modules)]
    for module in modules:
        banner = [f"# ---- {module.path} " + "-" * max(0, LINE_LENGTH - 12 - len(module.path))]
        doc = ast.get_docstring(module.tree, clean=True)
        parts.append("\n".join(banner + (_as_comment(doc) if doc else [])) + "\n\n\n" + _module_body(module))
    text = _rewrite_scanned_imports("\n\n\n".join(part for part in parts if part))
    check_self_contained(text, f"{file_stem(entry)}.py")
    return text


def file_stem(entry: str) -> str:
    """The name (without `.py`) of the file generated from module `entry`, "lmlp" in it (one shared module folder)."""
    stem = entry.rpartition(".")[2]
    return stem if "lmlp" in stem else f"lmlp_{stem}"


def defining_module_of(class_name: str) -> str:
    """The package module that defines an exported class (`__module__` is pinned to the package, so search)."""
    cls = getattr(importlib.import_module(PACKAGE), class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{PACKAGE} exports no class {class_name!r} to generate remote code for.")
    for name in sorted(sys.modules):
        if name.startswith(PACKAGE + ".") and vars(sys.modules[name]).get(class_name) is cls:
            if isinstance(top_level_names(load_module(name)).get(class_name), ast.ClassDef):
                return name
    raise ValueError(f"No module of {PACKAGE} defines {class_name} (is it defined at run time?).")


def pipeline_components(class_name: str) -> list[str]:
    """The components a pipeline class of the package takes (its `__init__`'s, as diffusers reads them)."""
    pipeline = getattr(importlib.import_module(PACKAGE), class_name, None)
    if not isinstance(pipeline, type) or not hasattr(pipeline, "_get_signature_keys"):
        raise ValueError(f"{PACKAGE} exports no pipeline class {class_name!r}.")
    return pipeline._get_signature_keys(pipeline)[0]


def check_component_names(model_index: dict[str, Any], where: str | Path = MODEL_INDEX) -> None:
    """Raise, naming the key, unless every `model_index.json` key is a plain name (a path would write code outside
    the upload) and every package entry is a component of the pipeline (another would get no code)."""
    for key in model_index:
        if not key.isidentifier():
            raise ValueError(
                f"{where} has the key {key!r}, which is not a component name: each key names a folder of the "
                "pipeline (a Python identifier such as 'transformer'), never a path. Fix or remove that entry."
            )
    index = package_model_index(model_index)
    components = pipeline_components(index["_class_name"]) if isinstance(index.get("_class_name"), str) else []
    for key, entry in index.items():
        if isinstance(entry, list) and entry[:1] == [PACKAGE] and key not in components:
            raise ValueError(
                f"{where} names {entry[1]} under {key!r}, which is not a component of {index['_class_name']} (it "
                f"takes {', '.join(components)}): remove that entry."
            )


def remote_code_files(model_index: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The code files (path -> text) of the pipeline and its package components, and the `model_index.json` naming
    them."""
    check_component_names(model_index)
    index = package_model_index(model_index)
    files = {}
    pipeline_class = index["_class_name"]
    stem = file_stem(defining_module_of(pipeline_class))
    files[f"{stem}.py"] = bundle_source(defining_module_of(pipeline_class), pipeline_class)
    index["_class_name"] = [stem, pipeline_class]
    for component in pipeline_components(pipeline_class):
        entry = index.get(component)
        if isinstance(entry, list) and entry[0] == PACKAGE:
            module = defining_module_of(entry[1])
            files[f"{component}/{file_stem(module)}.py"] = bundle_source(module, entry[1])
            index[component] = [file_stem(module), entry[1]]
    return files, index


def write_model_index(folder: Path, model_index: dict[str, Any]) -> None:
    """Write `model_index.json` the way diffusers' `save_config` does (sorted keys, indent 2, final newline)."""
    text = json.dumps(model_index, indent=2, sort_keys=True) + "\n"
    (folder / MODEL_INDEX).write_text(text, encoding="utf-8")


def add_remote_code(folder: str | Path) -> list[str]:
    """Write the generated code into a staged folder, point its `model_index.json` at it; return the files, sorted."""
    folder = Path(folder)
    files, index = remote_code_files(json.loads((folder / MODEL_INDEX).read_text(encoding="utf-8")))
    for path, text in files.items():
        with open(folder / path, "x", encoding="utf-8") as f:
            f.write(text)
    write_model_index(folder, index)
    return sorted(files)


def name_package_classes(folder: str | Path) -> None:
    """Point a staged folder's `model_index.json` back at the package's classes if it names code files."""
    folder = Path(folder)
    model_index = json.loads((folder / MODEL_INDEX).read_text(encoding="utf-8"))
    if package_model_index(model_index) != model_index:
        write_model_index(folder, package_model_index(model_index))
