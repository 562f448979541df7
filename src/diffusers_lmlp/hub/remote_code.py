"""`push --with-code`: ship the pipeline's code in the repo, so that diffusers loads it without diffusers-lmlp.

Each component's file (`bundle_source`) is its module and every package module it needs, in import order, package
imports taken out: diffusers fetches only the file `model_index.json` names and those it imports one level deep. All
remote code shares one module folder, hence "lmlp" in the file names."""

import ast
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import re
import sys
import tokenize
from pathlib import Path
from typing import Any, NamedTuple

from .. import __version__
from ..pipelines.model_index import package_model_index


PACKAGE = __name__.split(".")[0]
# What only the installed package does (recording its classes under its name): left out, with its decorators.
PACKAGE_ONLY_MODULES = (f"{PACKAGE}.exports",)


class SourceModule(NamedTuple):
    """One module of the package, parsed: dotted `name`, `path` from the package's parent folder, `source`, `tree`."""

    name: str
    path: str
    source: str
    tree: ast.Module


class PackageImport(NamedTuple):
    """An import from the package, `top_level` or not; `bindings`: each name it binds -> (defining module, name)."""

    node: ast.ImportFrom
    top_level: bool
    bindings: dict[str, tuple[str, str]]


@functools.cache
def load_module(name: str) -> SourceModule:
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
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update((name.id, node) for name in ast.walk(target) if isinstance(name, ast.Name))
    return names


def _package_module(module: SourceModule, node: ast.ImportFrom) -> str | None:
    """The package module an import statement imports from, or None."""
    if node.level:
        package = module.name if module.path.endswith("__init__.py") else module.name.rpartition(".")[0]
        return importlib.util.resolve_name("." * node.level + (node.module or ""), package)
    if node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
        return node.module
    return None


def defining_module(module_name: str, name: str, chain: tuple[str, ...] = ()) -> tuple[str, str]:
    """(module, name there) of what `from <module_name> import <name>` imports, following re-exports (`chain`)."""
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
    raise ImportError(
        f"Cannot find where {module.path} gets {name!r} from: remote code is generated from imports of names defined "
        "in the package (`from .module import SomeClass`), not of modules, star imports or names set at run time."
    )


def package_imports(module: SourceModule) -> list[PackageImport]:
    """Every statement of `module` that imports from the package, at any depth, resolved to the defining modules."""
    top = {id(node) for node in module.tree.body}
    found = []
    for node in ast.walk(module.tree):  # `import diffusers_lmlp.x` stays, and `check_self_contained` refuses it
        if not isinstance(node, ast.ImportFrom) or (source := _package_module(module, node)) is None:
            continue
        bindings = {alias.asname or alias.name: defining_module(source, alias.name) for alias in node.names}
        found.append(PackageImport(node, id(node) in top, bindings))
    return found


def bundle_order(entry: str) -> list[SourceModule]:
    """`entry` and every package module it needs, each after the modules its top-level imports need."""
    order: dict[str, SourceModule] = {}
    active: list[str] = []  # the modules being visited, outermost first

    def visit(name: str) -> None:
        if name in active:
            raise ImportError(f"Circular import at module level: {' -> '.join((*active, name))}.")
        active.append(name)
        later = []  # what imports inside functions need: present when they run, so in any place after this module
        for statement in package_imports(module := load_module(name)):
            for source, _ in statement.bindings.values():
                if source not in PACKAGE_ONLY_MODULES and source not in order:
                    visit(source) if statement.top_level else later.append(source)
        active.pop()
        order[name] = module
        for source in later:
            if source not in active and source not in order:
                visit(source)

    visit(entry)
    return list(order.values())


MODEL_INDEX = "model_index.json"
LINE_LENGTH = 119
# A line that diffusers' import scan (a regex over every line, strings included) reads as an import, and its module:
# diffusers would import it (or copy a relative one's file), so no shipped line may name the package this way.
_SCANNED_IMPORT = re.compile(r"^(\s*)(?:import\s+(\S+)\s*$|from\s+(\S+)\s+import)")


def _statement_lines(module: SourceModule, node: ast.stmt) -> tuple[int, int, str]:
    lines = module.source.splitlines()
    first, last = node.lineno - 1, node.end_lineno - 1
    indent = lines[first][: node.col_offset]
    rest = lines[last][node.end_col_offset :].strip()
    if indent.strip() or (rest and not rest.startswith("#")):
        raise SyntaxError(f"{module.path}:{node.lineno}: put this import on lines of its own to generate remote code.")
    return first, last, indent


def _external_imports(module: SourceModule) -> list[ast.Import | ast.ImportFrom]:
    return [
        node
        for node in module.tree.body
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and _package_module(module, node) is None)
    ]


def _module_body(module: SourceModule) -> str:
    """The module's text without docstring, imports (a package alias becomes `Alias = Name`), package-only decorators."""
    edits: dict[int, tuple[int, list[str]]] = {}  # first line -> (last line, replacement lines)
    if ast.get_docstring(module.tree, clean=False) is not None:
        edits[module.tree.body[0].lineno - 1] = (module.tree.body[0].end_lineno - 1, [])
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


def _check_one_namespace(modules: list[SourceModule]) -> None:
    """Raise if two of the modules bind one top-level name to different things: in one file they would clash."""
    # name -> ("module.name" it binds, its definition's dump if defined here (equal ones do not clash), module path)
    seen: dict[str, tuple[str, str | None, str]] = {}
    for module in modules:
        bound = {name: (f"{module.name}.{name}", ast.dump(node)) for name, node in top_level_names(module).items()}
        for node in _external_imports(module):
            for alias in node.names:  # `import a.b` binds `a` to the module `a`
                name = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else name
                bound[name] = (f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else target, None)
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
    """The top-level imports of every module from other libraries, once each: standard library first, then the rest."""
    lines = {ast.unparse(node) for module in modules for node in _external_imports(module)}
    return "\n".join(
        sorted(lines, key=lambda line: (line.split()[1].split(".")[0] not in sys.stdlib_module_names, line))
    )


def _rewrite_scanned_imports(text: str) -> str:
    """Prefix `>>> ` to lines in strings that diffusers' import scan takes for a package or relative import (such a line
    outside a string is an import, which `check_self_contained` refuses)."""
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
        if number in inside_strings and (named.startswith(".") or named.split(".")[0] == PACKAGE):
            lines[number - 1] = f"{match.group(1)}>>> {line[len(match.group(1)) :]}"
    return "\n".join(lines) + "\n"


def check_self_contained(text: str, filename: str = "<remote code>") -> None:
    """Raise unless the generated `text` compiles and imports nothing relative or from the package, at any depth."""
    for node in ast.walk(ast.parse(text, filename=filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            names = ["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            if name.startswith(".") or name.split(".")[0] == PACKAGE:
                raise ImportError(f"{filename}:{node.lineno} imports {name}; remote code must be self-contained.")
    compile(text, filename, "exec")


def bundle_source(entry: str, class_name: str) -> str:
    """One self-contained file: the module `entry` defining `class_name` and everything it needs from the package."""
    modules = bundle_order(entry)
    _check_one_namespace(modules)
    digest = hashlib.sha256("".join(f"{m.path}\n{len(m.source)}\n{m.source}" for m in modules).encode())
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
        doc = ast.get_docstring(module.tree, clean=True) or ""
        banner += [f"# {line}".rstrip() for line in doc.splitlines()]
        parts.append("\n".join(banner) + "\n\n\n" + _module_body(module))
    text = _rewrite_scanned_imports("\n\n\n".join(part for part in parts if part))
    check_self_contained(text, f"{file_stem(entry)}.py")
    return text


def file_stem(entry: str) -> str:
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
    """The code files (path -> text) of the pipeline and its package components, and the `model_index.json`."""
    check_component_names(model_index)
    index = package_model_index(model_index)
    pipeline, files = index["_class_name"], {}
    targets = [("_class_name", "", pipeline)] + [
        (key, f"{key}/", index[key][1])
        for key in pipeline_components(pipeline)
        if isinstance(index.get(key), list) and index[key][0] == PACKAGE
    ]
    for key, folder, class_name in targets:
        module = defining_module_of(class_name)
        files[f"{folder}{file_stem(module)}.py"] = bundle_source(module, class_name)
        index[key] = [file_stem(module), class_name]
    return files, index


def write_model_index(folder: Path, model_index: dict[str, Any]) -> None:
    """Write `model_index.json` as diffusers' `save_config` does."""
    (folder / MODEL_INDEX).write_text(json.dumps(model_index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def add_remote_code(folder: Path) -> list[str]:
    """Write the generated code into a staged folder, point its `model_index.json` at it; return the files, sorted."""
    files, index = remote_code_files(json.loads((folder / MODEL_INDEX).read_text(encoding="utf-8")))
    for path, text in files.items():
        with open(folder / path, "x", encoding="utf-8") as f:
            f.write(text)
    write_model_index(folder, index)
    return sorted(files)


def name_package_classes(folder: Path) -> None:
    """Point a staged folder's `model_index.json` back at the package's classes if it names code files."""
    model_index = json.loads((folder / MODEL_INDEX).read_text(encoding="utf-8"))
    if (index := package_model_index(model_index)) != model_index:
        write_model_index(folder, index)
