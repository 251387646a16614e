"""Every name the docs cite exists: file paths, `fusefs.…`/`trainer.…` names and
`Class.attribute` of the project's classes, in backticks in README.md, docs/*.md and the
docstrings and comments of fusefs/, trainer/, scripts/ and tests/ (the CHANGELOG tells
history, and `out/…` is what benchmarks write)."""
import ast
import functools
import glob
import importlib
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


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
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
    assert not os.path.exists(os.path.join(REPO, "scripts", "gluster.sh"))
