"""The documentation's examples run as a reader would run them.

Every ```python block of README.md and docs/*.md is an *example*, named by its file and its
number in that file ("docs/autodiff.md, example 1"). Each runs on CPU ranks, as a script
started on every rank (``torchrun --nproc-per-node N example.py``), at the world sizes it is
written for; a block that defines ``test_*`` functions is a pytest module, and its tests are
called with the ``multidevice_test`` fixture. An HTML comment on the line before a block, which
a rendered page does not show, says what the block is when it is not a whole program for any
number of ranks; its clauses, separated by commas:

- ``fragment``: part of a program (a sketch of calls); only checked to be valid Python;
- ``runs at N ranks``: written for N ranks (other world sizes skip it);
- ``continues example K``: runs after example K of the same file, with its names.

A block of output marked ``<!-- output of example K at N ranks -->`` is what example K prints
on rank 0 at N ranks (``...`` stands for any text): it is compared with what the example
prints. Tracebacks name the markdown file and its line. The commands the documents name
(``python -m X``, ``torchrun ... -m X``, ``bash benchmarks/x.sh``, ``scripts/x.sh``) are checked
to exist, with the options they pass, without running them.
"""

# ruff: noqa: S102 (an example is code: running exactly the lines of the document)
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                  for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Example:
    """One ```python block: where it is, its code, and what its comment says about it."""

    doc: str
    number: int  # 1-based, among the document's python blocks
    line: int  # the first line of the code in the document
    code: str
    fragment: bool = False
    ranks: int | None = None  # None: any world size
    continues: int | None = None

    @property
    def name(self) -> str:
        return f"{self.doc}, example {self.number}"


@dataclass(frozen=True)
class Output:
    """A block of a document showing what an example prints on rank 0 at ``ranks`` ranks."""

    doc: str
    line: int
    number: int  # the example's
    ranks: int
    text: str


def _clauses(text: str) -> list[str]:
    """The clauses of the HTML comment that ends ``text`` (what precedes a block)."""
    text = text.rstrip()
    if not text.endswith("-->"):
        return []
    comment = text[text.rindex("<!--") + len("<!--"):-len("-->")]
    return [c.strip() for c in comment.split(",")]


def _directives(doc: str, number: int, clauses: list[str]) -> dict:
    found: dict = {}
    for clause in clauses:
        if clause == "fragment":
            found["fragment"] = True
        elif m := re.fullmatch(r"runs at (\d+) ranks?", clause):
            found["ranks"] = int(m.group(1))
        elif m := re.fullmatch(r"continues example (\d+)", clause):
            found["continues"] = int(m.group(1))
        else:
            raise ValueError(f"{doc}, example {number}: unknown clause {clause!r} in the comment "
                             "before it; use 'fragment', 'runs at N ranks' or 'continues "
                             "example K'")
    return found


def blocks_of(doc: str) -> tuple[list[Example], list[Output]]:
    """The ```python blocks of ``doc`` (a path relative to the repository), in order, and its
    blocks marked ``<!-- output of example K at N ranks -->``."""
    text = (ROOT / doc).read_text()
    examples, outputs = [], []
    for match in FENCE.finditer(text):
        before = text[:match.start()]
        line = before.count("\n") + 2
        clauses = _clauses(before.rstrip("\n"))
        if match.group(1) == "python":
            number = len(examples) + 1
            examples.append(Example(doc, number, line, match.group(2),
                                    **_directives(doc, number, clauses)))
        elif clauses and (m := re.fullmatch(r"output of example (\d+) at (\d+) ranks?",
                                            " ".join(clauses))):
            outputs.append(Output(doc, line, int(m.group(1)), int(m.group(2)), match.group(2)))
        elif clauses:
            raise ValueError(f"{doc}, line {line}: unknown comment {clauses!r} before a block; "
                             "use 'output of example K at N ranks'")
    return examples, outputs


EXAMPLES = [e for doc in DOCUMENTS for e in blocks_of(doc)[0]]
OUTPUTS = [o for doc in DOCUMENTS for o in blocks_of(doc)[1]]
BY_NAME = {(e.doc, e.number): e for e in EXAMPLES}


def _chain(example: Example) -> list[Example]:
    """The examples to run, in order, to run ``example``: those it continues, then itself."""
    chain = [example]
    while chain[0].continues is not None:
        chain.insert(0, BY_NAME[(example.doc, chain[0].continues)])
    return chain


def _world_size(example: Example) -> int | None:
    return next((e.ranks for e in _chain(example) if e.ranks is not None), None)


def _compiled(example: Example):
    # Padded so that a traceback's line numbers are the markdown file's.
    return compile("\n" * (example.line - 1) + example.code, example.doc, "exec")


def test_the_documents_have_their_examples():
    # A guard against a parser that silently finds nothing.
    assert len(EXAMPLES) >= 15
    assert {e.doc for e in EXAMPLES} >= {"README.md", "docs/autodiff.md", "docs/explain.md"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"{e.doc}-{e.number}")
def test_each_example_is_valid_python_and_its_comment_is_consistent(example):
    _compiled(example)
    if example.continues is not None:
        assert example.continues < example.number, f"{example.name} continues a later example"
        assert not BY_NAME[(example.doc, example.continues)].fragment, (
            f"{example.name} continues a fragment")


RUNNABLE = [e for e in EXAMPLES if not e.fragment]


@pytest.mark.parametrize("output", OUTPUTS, ids=lambda o: f"{o.doc}-line{o.line}")
def test_each_shown_output_names_an_example_that_runs_at_its_size(output):
    example = BY_NAME.get((output.doc, output.number))
    assert example is not None and not example.fragment, (
        f"{output.doc}, line {output.line}: no runnable example {output.number}")
    assert _world_size(example) in (None, output.ranks)


def test_the_matching_of_shown_output():
    printed = "header\n  T0  [8]  input\n  T1  [8]  sum(T0)\n"
    assert unprinted_lines("  T0  [8]  input\n\n  T1 ... sum(T0)\n", printed) == []
    assert unprinted_lines("  T1  [8]  sum(T0)\n  T0  [8]  input", printed) == [
        "  T0  [8]  input"]  # in order
    assert unprinted_lines("  T0  [4]  input", printed) == ["  T0  [4]  input"]


@pytest.mark.mpi
@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: f"{e.doc}-{e.number}")
def test_each_example_runs(example, multidevice_test, tmp_path, monkeypatch):
    ranks = _world_size(example)
    if ranks is not None and ranks != multidevice_test.size:
        pytest.skip(f"{example.name} is written for {ranks} ranks")
    monkeypatch.chdir(_scratch_directory(tmp_path, multidevice_test))
    printed = run_example(example, multidevice_test)
    shown = [o for o in OUTPUTS if (o.doc, o.number, o.ranks)
             == (example.doc, example.number, multidevice_test.size)]
    for output in shown if multidevice_test.rank == 0 else ():
        missing = unprinted_lines(output.text, printed)
        assert not missing, (
            f"{output.doc}, line {output.line}, shows what {example.name} prints at "
            f"{output.ranks} ranks, but it prints\n{printed}\nwithout {missing}")


def _scratch_directory(tmp_path: Path, multidevice_test) -> Path:
    """A scratch directory for the example's files (one per rank: they may write the same
    names), with a ``docs/`` in it for an example that writes the documents' pictures."""
    where = tmp_path / f"rank{multidevice_test.rank}"
    (where / "docs").mkdir(parents=True)
    return where


def unprinted_lines(shown: str, printed: str) -> list[str]:
    """The lines of ``shown`` (``...`` standing for any text) that ``printed`` lacks, where
    each must come after the one before it; trailing spaces and blank lines do not count."""
    lines = [ln.rstrip() for ln in printed.splitlines()]
    at, missing = 0, []
    for want in (ln.rstrip() for ln in shown.splitlines() if ln.strip()):
        pattern = re.compile(".*".join(re.escape(p) for p in want.split("...")))
        found = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        if found is None:
            missing.append(want)
        else:
            at = found + 1
    return missing


def run_example(example: Example, multidevice_test) -> str:
    """Runs ``example`` (after those it continues) as a script on this rank; returns what it
    printed. A block defining ``test_*`` functions has them called, as pytest would."""
    namespace: dict = {"__name__": "__main__"}
    printed = io.StringIO()
    for part in _chain(example):
        try:
            with contextlib.redirect_stdout(printed):
                exec(_compiled(part), namespace)
                _call_tests(namespace, multidevice_test)
        except pytest.skip.Exception:
            raise
        except Exception as error:
            raise AssertionError(f"{part.name} (line {part.line}) failed on rank "
                                 f"{multidevice_test.rank} of {multidevice_test.size}: "
                                 f"{type(error).__name__}: {error}") from error
    return printed.getvalue()


def _call_tests(namespace: dict, multidevice_test) -> None:
    tests = {k: v for k, v in namespace.items() if k.startswith("test_") and callable(v)}
    for name, test in tests.items():
        fixtures = {"multidevice_test": multidevice_test}
        missing = set(inspect.signature(test).parameters) - set(fixtures)
        assert not missing, f"{name} needs fixtures this test does not give: {missing}"
        test(**{p: fixtures[p] for p in inspect.signature(test).parameters})
        del namespace[name]  # called once, even when a later example continues this one


# --- The commands the documents name -------------------------------------------------------

INLINE = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"(?:python|torchrun[^`\n]*?)\s+-m\s+([\w.]+)((?:\s+[^\s`|&;)]+)*)")
# A script, and the interpreter named before it (none: the script is run as a program).
SCRIPT = re.compile(r"(?:^|[\s`(=])((?:bash|sh|python|source|\.)\s+)?"
                    r"((?:scripts|benchmarks)/[\w./-]+\.(?:sh|py))")
OPTION = re.compile(r"(?<!\S)(--[a-z][\w-]*)")


def _command_texts(doc: str) -> list[str]:
    """The commands of ``doc``: lines of its bash blocks and of its python blocks' comments
    (``# quickstart.py: torchrun ...``), and its inline code spans."""
    text = (ROOT / doc).read_text()
    lines = []
    for match in FENCE.finditer(text):
        if match.group(1) in ("bash", "sh", ""):
            lines += match.group(2).splitlines()
        elif match.group(1) == "python":
            lines += [ln.split("#", 1)[1] for ln in match.group(2).splitlines() if "#" in ln]
    prose = FENCE.sub("", text)
    return lines + INLINE.findall(prose)


def _repository_module(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__main__.py", path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def named_commands() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(doc, kind, name, options)`` for every command the documents name: kind "module"
    (``-m name``), "script" (run by an interpreter named before it), "program" (a shell
    script named alone: run itself) or "file" (a Python file named alone)."""
    found = []
    for doc in DOCUMENTS:
        for text in _command_texts(doc):
            for match in MODULE.finditer(text):
                found.append((doc, "module", match.group(1),
                              tuple(OPTION.findall(match.group(2)))))
            for match in SCRIPT.finditer(text):
                # A .py file named alone is mentioned, not run (`python -m` runs modules).
                kind = ("script" if match.group(1) else
                        "program" if match.group(2).endswith(".sh") else "file")
                found.append((doc, kind, match.group(2), ()))
    return sorted(set(found))


COMMANDS = named_commands()


def test_the_documents_name_commands():
    kinds = {(kind, name) for _, kind, name, _ in COMMANDS}
    assert {("module", "meshfuse.demo"), ("module", "pytest"),
            ("program", "scripts/nvfuser_tests.sh")} <= kinds


@pytest.mark.parametrize("doc, kind, name, options", COMMANDS,
                         ids=[f"{d}-{n}" for d, _, n, _ in COMMANDS])
def test_each_named_command_exists_with_its_options(doc, kind, name, options):
    if kind in ("script", "program", "file"):
        assert (ROOT / name).is_file(), f"{doc} names {name}, which the repository lacks"
        assert kind != "program" or os.access(ROOT / name, os.X_OK), (
            f"{doc} runs {name} as a program, but it is not executable (git add --chmod=+x)")
        return
    source = _repository_module(name)
    if name == "pytest":  # the options the project adds to pytest's own
        known = ((ROOT / "meshfuse" / "testing" / "plugin.py").read_text()
                 + (ROOT / "tests" / "conftest.py").read_text())
        unknown = [o for o in options if f'"{o}"' not in known]
        assert not unknown, f"{doc} passes {unknown} to pytest; neither plugin adds them"
        return
    if source is None:
        assert importlib.util.find_spec(name) is not None, (
            f"{doc} runs `-m {name}`: no such module in the repository or installed")
        return
    if source.name == "__init__.py":
        pytest.fail(f"{doc} runs `-m {name}`, a package without a __main__.py")
    text = source.read_text()
    assert "__main__" in text, f"{doc} runs `-m {name}`, which has no main"
    unknown = [o for o in options
               if o != "--help" and f'"{o}"' not in text and f"'{o}'" not in text]
    assert not unknown, f"{doc} passes {unknown} to `-m {name}`, which {source.name} lacks"


def test_the_world_sizes_of_the_examples_are_those_the_run_is_given():
    # The default world sizes are the examples' (an example for N ranks runs at a default one).
    sizes = {_world_size(e) for e in RUNNABLE} - {None}
    assert sizes <= {1, 2, 4}, sizes


# --- The names and files the documents mention -----------------------------------------------

DOTTED = re.compile(r"\b(?:meshfuse|nvfuser|nvfuser_direct)(?:\.\w+)+")
REPOSITORY_PATH = re.compile(r"(?<![\w/.])((?:meshfuse|tests|benchmarks|scripts|docs)/[\w./-]*\w)")
# nvFuser's own test files, which docs/nvfuser-compat.md and docs/overlap.md name.
NVFUSER_TREE = "tests/python/"


def _resolves(dotted: str) -> bool:
    """True if ``dotted`` is a module of meshfuse, or an attribute reached from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def test_every_meshfuse_name_the_documents_mention_exists():
    # nvFuser's names are meshfuse's under the alias (meshfuse.testing.nvfuser_alias).
    stale = sorted({f"{doc}: {name}" for doc in DOCUMENTS
                    for name in DOTTED.findall((ROOT / doc).read_text())
                    if not _resolves("meshfuse." + name.split(".", 1)[1])})
    assert stale == []


def test_every_repository_file_the_documents_mention_exists():
    missing = sorted({f"{doc}: {path}" for doc in DOCUMENTS
                      for path in REPOSITORY_PATH.findall((ROOT / doc).read_text())
                      if not path.startswith(NVFUSER_TREE) and not (ROOT / path).exists()})
    assert missing == []


def test_the_documentation_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    unlisted = [doc for doc in DOCUMENTS
                if doc.startswith("docs/") and doc != "docs/README.md"
                and f"]({Path(doc).name})" not in index]
    assert unlisted == []
