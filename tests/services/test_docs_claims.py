"""What the newcomer's docs cite exists: every repository path, every `kvserve.*` name, every link.

The README, CONTRIBUTING.md and the pages under docs/ that explain the code name files, folders and
modules; a rename that forgets them leaves a newcomer chasing a path that is not there. So:

- **Paths.** An inline code span that looks like a path is one, read from the repository root: it
  holds a `/` and either starts at a top-level entry (`scripts/setup.sh`), ends in a file extension
  (`kernels/kvserve/kernels/cpu/vec8.h`) or ends in `/` (`docs/`). A path relative to a subpackage
  (`cpu/vec8.h`, `kernels/cpu/`) is ambiguous, so it fails: the docs write full paths. A bare name,
  a source file's (`engine.py`) or a folder's (`grpc_api/`), must name some file or folder of the
  repository.
- **Modules.** A dotted name starting with `kvserve.` resolves, without importing anything, to
  `<portion>/<name as a path>.py` or `.../__init__.py` in one of the package's portions
  (`dev-mode-dirs` in pyproject.toml), or to such a module followed by a name it defines (a class,
  function, assignment or import) and, for a class, one of its members:
  `kvserve.scheduler.server.engine.Engine.submit`.
- **Links.** A relative markdown link resolves from its page's folder, and its `#anchor` is the
  GitHub slug of a heading of the target page.

Fenced code blocks are skipped for paths and links (they hold commands, not claims); their
`kvserve.*` names are checked like the prose's, since `python -m kvserve.x` must run.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "CONTRIBUTING.md", "docs/architecture.md", "docs/serving.md")
PORTIONS: tuple[str, ...] = tuple(
    tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]["dev-mode-dirs"]
)
GENERATED = (".venv/", "test-artifacts/", ".gpu-wheels/")
"""Paths the docs may name that a checkout creates (set-up, test runs), not that git holds."""
FILE_EXTENSIONS = (
    ".py", ".pyi", ".md", ".proto", ".toml", ".yml", ".yaml", ".sh", ".txt", ".h", ".cpp", ".json", ".jinja",
    ".js", ".html", ".css", ".png", ".gguf",
)  # fmt: skip
BARE_SOURCE_EXTENSIONS = (".py", ".md", ".proto", ".h", ".cpp", ".sh", ".toml", ".yml")
"""A bare file name with one of these is a claim about this repository; `config.json` is a model's file."""
SKIPPED_DIRS = {".git", ".venv", "node_modules", "__pycache__", "test-artifacts"}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
PATH_TOKEN = re.compile(r"[A-Za-z0-9_.][\w.\-/]*")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MODULE_NAME = re.compile(r"(?<![\w./-])kvserve(?:\.[A-Za-z_]\w*)+")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def without_fences(text: str) -> str:
    """The text with fenced code blocks blanked out (line count kept, so nothing moves)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def top_level_entries() -> set[str]:
    return {entry.name for entry in REPO.iterdir()}


def is_path_claim(token: str, top_level: set[str]) -> bool:
    """Whether a code span's text claims to be a repository path (see the module's docstring)."""
    if PATH_TOKEN.fullmatch(token) is None or "/" not in token or "//" in token:
        return False
    first = token.split("/", 1)[0]
    return first in top_level or token.endswith("/") or token.endswith(FILE_EXTENSIONS)


def is_bare_file_claim(token: str) -> bool:
    """`engine.py` is a claim; `.proto` (a kind of file) and `config.json` (a model's file) are not."""
    return PATH_TOKEN.fullmatch(token) is not None and "/" not in token and Path(token).suffix in BARE_SOURCE_EXTENSIONS


def code_spans(text: str) -> list[str]:
    return [m.group(2).strip() for m in CODE_SPAN.finditer(without_fences(text))]


def path_claims(text: str, top_level: set[str]) -> list[str]:
    return [token for token in code_spans(text) if is_path_claim(token, top_level)]


def bare_file_claims(text: str) -> list[str]:
    return [token for token in code_spans(text) if is_bare_file_claim(token)]


def module_claims(text: str) -> list[str]:
    return MODULE_NAME.findall(text)


def link_targets(text: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(without_fences(text))]


@cache
def repository_paths() -> tuple[Path, ...]:
    """Every file and folder of the repository, less what a checkout generates."""
    paths: list[Path] = []
    for entry in REPO.iterdir():
        if entry.name in SKIPPED_DIRS or entry.name.startswith("."):
            continue
        paths.append(entry)
        if entry.is_dir():
            paths += [p for p in entry.rglob("*") if not SKIPPED_DIRS.intersection(p.relative_to(REPO).parts)]
    return tuple(paths)


@cache
def repository_file_names() -> frozenset[str]:
    return frozenset(path.name for path in repository_paths() if path.is_file())


@cache
def repository_folder_names() -> frozenset[str]:
    return frozenset(path.name for path in repository_paths() if path.is_dir())


def is_bare_folder(token: str, top_level: set[str]) -> bool:
    """`grpc_api/`: one name and a slash, naming no top-level entry."""
    return token.endswith("/") and token.count("/") == 1 and token[:-1] not in top_level


def missing_path(token: str) -> str | None:
    if token.startswith(GENERATED):
        return None
    if is_bare_folder(token, top_level_entries()):
        found = token[:-1] in repository_folder_names()
        return None if found else f"no folder named {token} anywhere in the repository"
    path = REPO / token
    if token.endswith("/"):
        return None if path.is_dir() else f"no folder {token}"
    return None if path.exists() else f"no path {token}"


def missing_bare_file(token: str) -> str | None:
    return None if token in repository_file_names() else f"no file named {token} anywhere in the repository"


def module_file(parts: list[str]) -> Path | None:
    """The file of module `parts` in one of the portions, or None."""
    for portion in PORTIONS:
        base = REPO / portion / Path(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def defined_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines: classes, functions, assignments and imports."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like
            names.update(defined_names(node.body))
    return names


def missing_module(name: str) -> str | None:
    """None when `name` is a module, or a module and up to two names defined in it; else why not."""
    parts = name.split(".")
    for attributes in range(3):
        split = len(parts) - attributes
        if split < 2:
            break
        path = module_file(parts[:split])
        if path is None:
            continue
        body: list[ast.stmt] = module_tree(path).body
        for attribute in parts[split:]:
            node = defined_names(body).get(attribute)
            if node is None:
                return f"{name}: {path.relative_to(REPO)} defines no {attribute}"
            body = node.body if isinstance(node, ast.ClassDef) else []
        return None
    return f"{name}: no module file in any portion {PORTIONS}"


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    result: set[str] = set()
    for match in HEADING.finditer(without_fences(path.read_text())):
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(result)


def missing_link(page: Path, target: str) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
        return None
    file_part, _, anchor = target.partition("#")
    linked = (page.parent / file_part).resolve() if file_part else page
    if not linked.exists():
        return f"link {target}: no {file_part}"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"link {target}: {linked.relative_to(REPO)} has no heading #{anchor}"
    return None


def problems(page: Path, text: str) -> list[str]:
    top_level = top_level_entries()
    found = [missing_path(token) for token in path_claims(text, top_level)]
    found += [missing_bare_file(token) for token in bare_file_claims(text)]
    found += [missing_module(name) for name in module_claims(text)]
    found += [missing_link(page, target) for target in link_targets(text)]
    return [problem for problem in found if problem is not None]


SAMPLE = """
The core is `scheduler_svc/kvserve/scheduler/core/step_builder.py` (`kvserve.scheduler.core.step_builder`);
see [the architecture](docs/architecture.md), `docs/` and `grpc_api/`. Not paths: `application/json`, `/v1/models`,
`tcp://127.0.0.1:50052`, `$KVSERVE_CACHE/kernels`, `config.json`, `.venv/bin/kvserve`.
Made up: `scheduler_svc/kvserve/scheduler/core/no_such_step.py`, `cpu/vec8.h`, `kernels/cpu/`, `no_such_room/`,
`no_such_module.py`, `kvserve.scheduler.core.no_such_module`, `kvserve.scheduler.core.NoSuchName`,
`kvserve.scheduler.server.engine.Engine.no_such_method`, [a page](docs/no-such-page.md),
[an anchor](docs/architecture.md#no-such-heading).

```bash
cat fenced/not/a/claim.py   # commands in a fence are not path claims
```
"""


def test_the_extractor_catches_made_up_paths_modules_and_links() -> None:
    found = problems(REPO / "README.md", SAMPLE)
    assert found == [
        "no path scheduler_svc/kvserve/scheduler/core/no_such_step.py",
        "no path cpu/vec8.h",
        "no folder kernels/cpu/",
        "no folder named no_such_room/ anywhere in the repository",
        "no file named no_such_module.py anywhere in the repository",
        "kvserve.scheduler.core.no_such_module: scheduler_svc/kvserve/scheduler/core/__init__.py defines no "
        "no_such_module",
        "kvserve.scheduler.core.NoSuchName: scheduler_svc/kvserve/scheduler/core/__init__.py defines no NoSuchName",
        "kvserve.scheduler.server.engine.Engine.no_such_method: scheduler_svc/kvserve/scheduler/server/engine.py "
        "defines no no_such_method",
        "link docs/no-such-page.md: no docs/no-such-page.md",
        "link docs/architecture.md#no-such-heading: docs/architecture.md has no heading #no-such-heading",
    ]


def test_the_extractor_finds_what_exists() -> None:
    top_level = top_level_entries()
    assert path_claims(SAMPLE, top_level)[:2] == ["scheduler_svc/kvserve/scheduler/core/step_builder.py", "docs/"]
    assert missing_module("kvserve.scheduler.core.Scheduler") is None  # a name the package re-exports
    assert missing_module("kvserve.scheduler.server.engine.Engine.submit") is None
    assert missing_module("kvserve.nothing_here") is not None
    assert github_slug("8-bit activations: llama.cpp's arithmetic (2026-12-05, later)") == (
        "8-bit-activations-llamacpps-arithmetic-2026-12-05-later"
    )
    assert github_slug("Speculative decoding (`kvserve bench speculative`)") == (
        "speculative-decoding-kvserve-bench-speculative"
    )


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_path_module_and_link_exists(doc: str) -> None:
    page = REPO / doc
    text = page.read_text()
    cited = path_claims(text, top_level_entries()) + link_targets(text)
    assert cited, f"{doc} cites nothing: is the extractor broken?"
    assert problems(page, text) == []


@pytest.mark.parametrize("doc, limit", [("README.md", 250), ("docs/architecture.md", 500), ("docs/benchmarks.md", 450)])
def test_the_newcomer_docs_stay_short(doc: str, limit: int) -> None:
    """A newcomer reads them in an hour: detail goes to docs/serving.md, history to benchmarks-history.md."""
    lines = (REPO / doc).read_text().count("\n")
    assert lines <= limit, f"{doc} has {lines} lines, over {limit}"
