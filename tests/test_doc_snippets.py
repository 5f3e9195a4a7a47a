"""Every ```python block of the repository's pages (README.md, docs/*.md, tests/README.md,
benchmarks/README.md) runs as written.

The blocks of a page run in order in one namespace, so a block may use what an earlier
one of its page defined; each block is a test of its own (the page's earlier unmarked
blocks run again before it), so a failure names the block. A block runs in the current
directory of a fresh temporary folder, on the CPU unless it picks a GPU itself.

A block that cannot run like that says so in a mark, on one of the HTML comment lines
right before its fence, and nothing else is left out:

    <!-- snippet: gpu -->                      needs a CUDA GPU: runs (marked gpu) where torch sees one
    <!-- snippet: requires=nixl_cu13 -->       needs an optional extra: runs where it imports, else skipped naming it
    <!-- snippet: ranks=4 -->                  runs in 4 processes at once, each with RANK, WORLD_SIZE,
                                               LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torchrun sets them
                                               (marked multiprocess and slow: each process imports torch)
    <!-- snippet: skip reason=... -->          never run (not code), with the reason

Marks combine (`ranks=3 requires=nixl_cu13`); `reason=` takes the rest of the line. A
marked block runs after the page's unmarked blocks before it, never in front of a later
block. ```bash blocks and plain ``` ones are not run; the repository files they name must
exist."""

import importlib.util
import os
import re
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

# The snippets are written for torch users; an interpreter without torch (the free-threaded one) runs none.
pytest.importorskip("torch", reason="the doc snippets use torch, which this interpreter does not have")

from support import REPO_ROOT

DOCS = os.path.join(REPO_ROOT, "docs")
PAGES = ["README.md"] + [f"docs/{name}" for name in sorted(os.listdir(DOCS)) if name.endswith(".md")] + \
        [page for page in ("tests/README.md", "benchmarks/README.md") if os.path.isfile(os.path.join(REPO_ROOT, page))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
MARK = re.compile(r"^<!-- snippet: (.*?) ?-->$")
KNOWN = {"gpu", "requires", "ranks", "skip", "reason"}
# Each optional module a mark may require: how it is installed (what a skip says), and the
# modules whose import needs it (a required module's snippet imports one of them).
EXTRAS = {"nixl_cu13": ('pip install "kvbm_ext[nixl]"', ("nixl_cu13", "kvbm_ext.nixl", "kvbm_ext.disk", "kvbm_ext.peer")),
          "transformers": ('pip install "kvbm_ext[transformers]"',
                           ("transformers", "kvbm_ext.integrations.transformers"))}
RANKS_TIMEOUT = 120


@dataclass
class Snippet:
    page: str               # relative to the repository root
    line: int               # the fence's line, 1-based
    language: str
    code: str
    marks: dict = field(default_factory=dict)

    @property
    def id(self):
        return f"{self.page}:{self.line}"

    def padded(self):
        """The code with the lines before it blank, so that a traceback names the page's lines."""
        return "\n" * self.line + self.code


def parse_marks(text):
    """{name: value} of a mark's text: `gpu`, `ranks=4`, `requires=a,b`, `skip reason=...`."""
    marks = {}
    text = text.strip()
    while text:
        if text.startswith("reason="):
            marks["reason"] = text[len("reason="):].strip()
            break
        word, _, text = text.partition(" ")
        name, _, value = word.partition("=")
        if name not in KNOWN:
            raise ValueError(f"unknown snippet mark {name!r} (known: {', '.join(sorted(KNOWN))})")
        marks[name] = value or True
        text = text.strip()
    if "skip" in marks and not marks.get("reason"):
        raise ValueError("a skipped snippet needs reason=...")
    if "ranks" in marks and not str(marks["ranks"]).isdigit():
        raise ValueError(f"ranks={marks['ranks']}: expected a number of processes")
    return marks


def snippets(page, text):
    """The fenced blocks of a markdown text, each with the marks on the comment lines right
    before its fence."""
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        marks = {}
        before = text[:match.start()].splitlines()
        while before and before[-1].startswith("<!--") and before[-1].rstrip().endswith("-->"):
            mark = MARK.match(before.pop().rstrip())
            if mark:
                if marks:
                    raise ValueError(f"{page}:{line}: two snippet marks")
                marks = parse_marks(mark.group(1))
        found.append(Snippet(page, line, match.group(1), match.group(2), marks))
    return found


def read(page):
    with open(os.path.join(REPO_ROOT, page)) as f:
        return f.read()


ALL = {page: snippets(page, read(page)) for page in PAGES}
PYTHON = [s for page in PAGES for s in ALL[page] if s.language == "python"]


def chain_before(snippet):
    """The unmarked python blocks of the snippet's page before it."""
    return [s for s in ALL[snippet.page] if s.language == "python" and not s.marks and s.line < snippet.line]


def run_in_process(blocks):
    namespace = {"__name__": "__main__"}
    for block in blocks:
        exec(compile(block.padded(), os.path.join(REPO_ROOT, block.page), "exec"), namespace)
    return namespace


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_ranks(blocks, count, folder):
    """The blocks as one script, in `count` processes at once, with torchrun's variables;
    each must exit 0. Returns their output."""
    script = folder / "snippet.py"
    script.write_text("namespace = {'__name__': '__main__'}\n" + "".join(
        f"exec(compile({b.padded()!r}, {os.path.join(REPO_ROOT, b.page)!r}, 'exec'), namespace)\n" for b in blocks))
    port = free_port()
    processes = []
    for rank in range(count):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(count), LOCAL_WORLD_SIZE=str(count),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        processes.append(subprocess.Popen([sys.executable, str(script)], cwd=folder, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=RANKS_TIMEOUT)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    failed = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
    report = "\n".join(f"--- rank {rank} (exit {p.returncode}) ---\n{out[-4000:]}"
                       for rank, (p, out) in enumerate(zip(processes, outputs)))
    assert not failed, f"ranks that failed (rank, exit status): {failed}\n{report}"
    return outputs


def missing_modules(snippet):
    wanted = [m for m in str(snippet.marks.get("requires", "")).split(",") if m]
    return [m for m in wanted if importlib.util.find_spec(m) is None]


def case(snippet):
    marks = []
    if "gpu" in snippet.marks:
        marks.append(pytest.mark.gpu)
    if "ranks" in snippet.marks:
        # each rank is a Python process importing torch: about a second of CPU each, so a
        # group takes seconds on a small machine
        marks += [pytest.mark.multiprocess, pytest.mark.slow]
    return pytest.param(snippet, marks=marks, id=snippet.id)


@pytest.mark.parametrize("snippet", [case(s) for s in PYTHON])
def test_snippet_runs(snippet, tmp_path, monkeypatch):
    if "skip" in snippet.marks:
        pytest.skip(f"marked skip in {snippet.id}: {snippet.marks['reason']}")
    missing = missing_modules(snippet)
    if missing:
        pytest.skip(f"{snippet.id} needs {', '.join(missing)}: {'; '.join(EXTRAS[m][0] for m in missing)}")
    if "gpu" in snippet.marks:
        import kvbm_ext
        if kvbm_ext.is_using_stubs():
            pytest.skip(f"{snippet.id} needs a GPU, and this build of kvbm_ext has no CUDA")
    blocks = chain_before(snippet) + [snippet]
    if "ranks" in snippet.marks:
        run_in_ranks(blocks, int(snippet.marks["ranks"]), tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        run_in_process(blocks)


def test_every_python_block_is_a_case():
    """Each page's python blocks are all here: none lost to the parser (an unclosed fence,
    an indented one)."""
    for page in PAGES:
        text = read(page)
        opened = len(re.findall(r"^\s*```python", text, re.MULTILINE))
        assert opened == sum(s.language == "python" for s in ALL[page]), page
    assert len(PYTHON) >= 10


def test_only_what_cannot_run_here_is_marked():
    """A mark says why the block cannot run in this process on the CPU: a GPU block
    names cuda, a multi-process block reads its rank, a required module is imported."""
    for s in PYTHON:
        if "gpu" in s.marks:
            assert "cuda" in s.code, f"{s.id} is marked gpu and never names cuda"
        if "ranks" in s.marks:
            assert re.search(r"RANK|init_process_group", s.code), f"{s.id} runs in ranks and never reads its rank"
        for module in [m for m in str(s.marks.get("requires", "")).split(",") if m]:
            assert module in EXTRAS, f"{s.id} requires {module}: say in EXTRAS how it is installed"
            users = "|".join(re.escape(name) for name in EXTRAS[module][1])
            assert re.search(rf"^\s*(import|from) ({users})\b", s.code, re.MULTILINE), \
                f"{s.id} requires {module} and imports none of {EXTRAS[module][1]}"


def test_marks_are_read_and_a_failing_block_is_noticed(tmp_path):
    page = textwrap.dedent("""\
        <!-- example: one -->
        <!-- snippet: ranks=2 requires=nixl_cu13 -->
        ```python
        x = 1
        ```

        <!-- snippet: skip reason=signatures, not code -->
        ```python
        f(a, /, *, b=None)
        ```

        ```python
        assert x == 2, "the second block sees the first's names"
        ```
        """)
    first, second, third = snippets("page.md", page)
    assert first.marks == {"ranks": "2", "requires": "nixl_cu13"} and first.line == 3
    assert second.marks == {"skip": True, "reason": "signatures, not code"}
    assert third.marks == {}
    with pytest.raises(AssertionError, match="the second block"):
        run_in_process([first, third])
    for bad in ("gpus", "skip", "ranks=two"):
        with pytest.raises(ValueError):
            parse_marks(bad)


def test_a_failing_rank_is_noticed(tmp_path):
    code = "import os\nassert os.environ['RANK'] != '1', 'rank 1 fails'\n"
    with pytest.raises(AssertionError, match=r"\[\(1, 1\)\][\s\S]*rank 1 fails"):
        run_in_ranks([Snippet("page.md", 1, "python", code)], 2, tmp_path)


REPO_PATH = re.compile(r"(?<![\w./-])((?:tools|tests|examples|benchmarks|docs|kvbm_ext)/[\w./-]*\w)")
RESULTS = "benchmarks/results"      # left out of an sdist (MANIFEST.in)


@pytest.mark.parametrize("page", PAGES)
def test_command_blocks_name_files_that_exist(page):
    """The ```bash blocks, and the plain ``` ones (command listings), are not run; the
    repository files and folders they name exist."""
    for s in ALL[page]:
        if s.language in ("bash", "sh", "shell", "console", ""):
            for path in REPO_PATH.findall(s.code):
                if path.startswith(RESULTS) and not os.path.isdir(os.path.join(REPO_ROOT, RESULTS)):
                    continue
                assert os.path.exists(os.path.join(REPO_ROOT, path)), f"{s.id} names {path}, which does not exist"
