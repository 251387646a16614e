"""Every name the docs cite exists: file paths, `fusefs.…`/`trainer.…` names and
`Class.attribute` of the project's classes, in backticks in README.md, docs/*.md and the
docstrings and comments of fusefs/, trainer/, scripts/ and tests/ (the CHANGELOG tells
history, and `out/…` is what benchmarks write)."""
import ast
import functools
import glob
import os
import re

from conftest import REPO

DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))),
        # and the docstrings and comments of the code
        *sorted(p for part in ("fusefs", "trainer", "scripts", "tests") for p in glob.glob(os.path.join(REPO, part, "**", "*.py"),
                                                                         recursive=True))]
SOURCES = [p for part in ("fusefs", "trainer", "scripts")
           for p in glob.glob(os.path.join(REPO, part, "**", "*.py"), recursive=True)]
FILE = re.compile(r"([\w.-]+/)+[\w.-]+\.(py|sh|md|c|h|pyx|pxi|pxd|toml|jsonl|json|txt|in|patch)")
DOTTED = re.compile(r"(fusefs|trainer)(\.\w+)+")
MEMBER = re.compile(r"([A-Z]\w*)\.([A-Za-z_]\w*)")


@functools.cache
def classes() -> dict[str, tuple[set, bool]]:
    """(Parsed once a run.) Each class the project defines: (the names it defines or assigns on self, whether
    all its bases are the project's own: else it may inherit what it does not define)."""
    found: dict[str, tuple[set, list]] = {}
    for path in SOURCES:
        try:
            tree = ast.parse(open(path).read())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            names = set()
            for n in ast.walk(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    names.add(n.attr)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    names.add(n.id)
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
            old = found.get(node.name, (set(), []))
            found[node.name] = (old[0] | names, old[1] + bases)
    own = {}
    for name, (names, bases) in found.items():
        own[name] = (names, all(b in found or b in ("object", "Exception") for b in bases))
    return own


def lazy_names(path: str) -> dict[str, str]:
    """A module with a module-level __getattr__ (trainer's): the names it loads lazily and
    the module of each, from its top-level dicts of name -> module."""
    body = ast.parse(open(path).read()).body
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in body):
        return {}
    out = {}
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    out[k.value] = v.value
    return out


def top_level_names(path: str) -> set[str]:
    """The names a module of the checkout defines or imports at its top level (read, not
    imported: trainer's modules would import torch)."""
    names = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def resolves(dotted: str) -> bool:
    """Whether a `fusefs.…`/`trainer.…` name exists: the longest prefix that is a module or
    package of the checkout, then a name it defines or imports, then (a class's) a name
    that class defines."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = os.path.join(REPO, *parts[:i])
        module = next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.exists(p)), None)
        if module is None:
            if os.path.isdir(base) and i == len(parts):
                return True  # (a package of compiled or other modules)
            continue
        rest = parts[i:]
        if not rest:
            return True
        if rest[0] not in top_level_names(module):
            lazy = lazy_names(module)
            if rest[0] in lazy:
                return resolves(".".join([lazy[rest[0]], *rest]))
            return os.path.isdir(os.path.join(base, rest[0])) or os.path.exists(os.path.join(base, rest[0] + ".py"))
        own = classes()
        return len(rest) == 1 or (len(rest) == 2 and rest[0] in own and rest[1] in own[rest[0]][0])
    return False


def prose(path: str) -> str:
    """A doc's text; of a Python file, its comments and strings (newlines kept in place)."""
    text = open(path).read()
    if not path.endswith(".py"):
        return text
    import io
    import tokenize
    lines = [""] * (text.count("\n") + 2)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for k, part in enumerate(tok.string.split("\n")):
                lines[tok.start[0] - 1 + k] += " " + part
    return "\n".join(lines)


def cited() -> list[tuple[str, int, str]]:
    """(file, line, span): every span in backticks, and in code every Class.attribute."""
    out = []
    for doc in DOCS:
        text = prose(doc)
        spans = [m for m in re.finditer(r"`([^`\n]+)`", text)]
        if doc.endswith(".py"):
            spans += [m for m in re.finditer(r"\b([A-Z]\w*\.[A-Za-z_]\w*)\b", text)]
        for m in spans:
            out.append((os.path.relpath(doc, REPO), text.count("\n", 0, m.start()) + 1, m.group(1).strip()))
    return out


def test_every_cited_file_function_and_attribute_exists():
    own = classes()
    missing = []
    for doc, line, span in cited():
        span = span.removesuffix("()")
        if FILE.fullmatch(span):
            if span.startswith(("../", "out/", "/")):
                continue
            if not any(os.path.exists(os.path.join(REPO, base, span)) for base in ("", "docs", "scripts")):
                missing.append(f"{doc}:{line}: {span}: no such file")
        elif DOTTED.fullmatch(span):
            if not resolves(span):
                missing.append(f"{doc}:{line}: {span}: no such module or name")
        elif MEMBER.fullmatch(span):
            cls, attr = span.split(".")
            if cls in own and own[cls][1] and attr not in own[cls][0]:
                missing.append(f"{doc}:{line}: {span}: {cls} has no {attr}")
    assert not missing, "\n".join(missing)


def test_the_check_finds_a_name_that_is_gone():
    """The oracle can fail: names that do not exist are reported."""
    own = classes()
    assert "Core" in own and "statistics" in own["Core"][0] and "fetch_batch" not in own["Core"][0]
    assert resolves("fusefs.cache.SampleCache") and not resolves("fusefs.cache.NoSuchCache")
    assert resolves("trainer.HybridTrainer") and not resolves("trainer.NoSuchTrainer")
    gone = ".".join(["fusefs.cache.SampleCache", "no_such"])  # (spelled apart: not a citation)
    assert resolves("fusefs.cache.SampleCache.put") and not resolves(gone)
    assert not os.path.exists(os.path.join(REPO, "scripts", "gluster.sh"))


def test_the_architectures_module_table_lists_every_module_below_what_it_imports():
    """docs/ARCHITECTURE.md's table of modules says that a module imports only modules above
    it: every module of fusefs/ is in it, and no relative import points further down."""
    text = open(os.path.join(REPO, "docs", "ARCHITECTURE.md")).read()
    start = text.index("| module | concern |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    order = [m for row in rows for m in re.findall(r"`fusefs/(\w+)\.py`", row.split("|")[1])]
    at = {m: i for i, m in enumerate(order)}
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "fusefs", "*.py"))}
    assert modules - {"__init__", "__main__"} == set(at)
    below = [(m, node.module) for m in order
             for node in ast.walk(ast.parse(open(os.path.join(REPO, "fusefs", m + ".py")).read()))
             if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
             and at.get(node.module.split(".")[0], -1) > at[m]]
    assert below == []
