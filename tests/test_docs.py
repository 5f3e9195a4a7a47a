"""The documentation says what the code does, from one source each: the README's signatures
are generated from the stubs (which stubtest checks against the module), every option of
the module's functions and PagedKVCache has its text in docs/api.md and a line in the
README's option table, every docstring documents the options it takes, and every
relative link of the README and docs/ leads to a file or heading that exists."""

import inspect
import os
import re
import sys
import tarfile

import pytest

import kvbm_ext

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import readme  # noqa: E402

sys.path.pop(0)

README_TEXT = readme.read(os.path.join(REPO_ROOT, "README.md"))
API_DOC = readme.read(os.path.join(REPO_ROOT, "docs", "api.md"))
DOCS = ["README.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(REPO_ROOT, "docs")))
                        if name.endswith(".md")] + [os.path.join("benchmarks", "README.md")]


def c_callables():
    """(name, object) of the extension's functions and of PagedKVCache and its methods."""
    found = [(name, getattr(kvbm_ext, name)) for name in kvbm_ext.__all__ if inspect.isbuiltin(getattr(kvbm_ext, name))]
    found.append(("PagedKVCache", kvbm_ext.PagedKVCache))
    found += [(f"PagedKVCache.{name}", getattr(kvbm_ext.PagedKVCache, name)) for name in sorted(vars(kvbm_ext.PagedKVCache))
              if not name.startswith("_") and callable(getattr(kvbm_ext.PagedKVCache, name))]
    return found


def parameters(obj):
    return [name for name in inspect.signature(obj).parameters if name != "self"]


def options(obj):
    """The parameters a caller may leave out or must name: those with defaults or keyword-only."""
    return [p.name for p in inspect.signature(obj).parameters.values()
            if p.name != "self" and (p.default is not p.empty or p.kind is p.KEYWORD_ONLY)]


CALLABLES = c_callables()
TAKEN_BY = {}
for _name, _obj in CALLABLES:
    for _parameter in parameters(_obj):
        TAKEN_BY.setdefault(_parameter, []).append(_name)
# Options taken by more than one function: each docstring must give them an entry of their own.
SHARED = {name for name, takers in TAKEN_BY.items() if len(takers) > 1}


def test_readme_signatures_are_the_stubs():
    """The README's signature block is what tools/readme.py generates from the stubs
    (after a change to kvbm_ext/__init__.pyi: tools/readme.py api --write)."""
    generated = readme.api_block(readme.read(readme.STUBS))
    assert readme.readme_api_block(README_TEXT) == generated, "run tools/readme.py api --write"


def test_the_signature_block_names_every_public_name():
    block = readme.readme_api_block(README_TEXT)
    for name in kvbm_ext.__all__:
        assert re.search(rf"\bkvbm_ext\.{re.escape(name)}\b", block), name
    for name, obj in CALLABLES:
        if name.startswith("PagedKVCache."):
            assert f"cache.{name.split('.')[1]}(" in block, name


def test_a_changed_stub_changes_the_block():
    """The generator reads the stubs: a parameter renamed there shows in the block, so the
    comparison above can fail."""
    stubs = readme.read(readme.STUBS)
    changed = stubs.replace("head_offset: int = 0,", "head_start: int = 0,", 1)
    assert changed != stubs
    assert "head_start=0" in readme.api_block(changed) and "head_start" not in readme.api_block(stubs)


def test_generator_refuses_a_public_name_in_no_group():
    stubs = readme.read(readme.STUBS).replace('"vectorized_copy",\n]', '"vectorized_copy",\n    "frobnicate",\n]', 1)
    with pytest.raises(ValueError, match="frobnicate"):
        readme.api_block(stubs)


def option_table_names():
    section = README_TEXT.split("### Options", 1)[1].split("\n### ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize("option", sorted({o for _, obj in CALLABLES for o in options(obj)} | {"dims"}))
def test_every_option_in_the_readme_table(option):
    assert option in option_table_names(), f"README's option table lacks {option}"


def api_doc_headings():
    names = set()
    for heading in re.findall(r"^### (.*)$", API_DOC, re.MULTILINE):
        names.update(re.findall(r"`(\w+)`", heading))
    return names


@pytest.mark.parametrize("parameter", sorted(TAKEN_BY))
def test_every_parameter_has_its_text_in_docs_api(parameter):
    assert parameter in api_doc_headings(), f"docs/api.md has no ### heading for {parameter} ({TAKEN_BY[parameter]})"


def documents(doc, name):
    """Whether a docstring gives `name` an entry ("name: ...", "name (...): ...", or in a
    list "a, name: ...") or names it in backquotes."""
    entry = rf"^[ \t]*(?:\w+, )*{re.escape(name)}(?:, \w+)*(?: \([^)]*\))?:"
    return bool(re.search(entry, doc, re.MULTILINE)) or f"`{name}`" in doc


def docstring_cases():
    return [pytest.param(name, obj, parameter, id=f"{name}-{parameter}")
            for name, obj in CALLABLES for parameter in parameters(obj)]


@pytest.mark.parametrize("name,obj,parameter", docstring_cases())
def test_every_docstring_documents_its_options(name, obj, parameter):
    """Each docstring names every parameter it takes; an option shared with another function
    gets an entry of its own (the same text as docs/api.md's, not a pointer elsewhere)."""
    doc = obj.__doc__ or ""
    assert re.search(rf"\b{re.escape(parameter)}\b", doc), f"{name}'s docstring never names {parameter}"
    if parameter in SHARED:
        assert documents(doc, parameter), f"{name}'s docstring has no entry for {parameter}"


def test_the_entry_rule_can_fail():
    assert documents("num_ctas: None or a count", "num_ctas")
    assert documents("src_ptrs, dst_ptrs: lists", "dst_ptrs")
    assert documents("backend (for device arrays): auto", "backend")
    assert not documents("Memory: pinned (see backend)", "backend")


def test_readme_numbers_layers_and_heads_side_by_side():
    section = README_TEXT.split("### Which index a selected layer or head gets", 1)[1].split("\n### ", 1)[0]
    header = next(line for line in section.splitlines() if line.startswith("| |"))
    assert "`layers=`" in header and "`heads=`" in header, header
    for words in ("l + layer_offset", "head_offset + j", "negative", "minus the lowest layer moved"):
        assert words in section, words


def slug(heading):
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    with open(path) as f:
        return {slug(heading) for heading in re.findall(r"^#+ (.*)$", f.read(), re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_lead_somewhere(doc):
    path = os.path.join(REPO_ROOT, doc)
    found = readme.relative_links(readme.read(path))
    assert found, f"{doc} links nothing"
    for target in found:
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if resolved.startswith(RESULTS) and not os.path.isdir(RESULTS):
            continue        # an sdist leaves the measured results out (MANIFEST.in)
        assert os.path.exists(resolved), f"{doc}: {target} does not exist"
        if anchor:
            assert anchor in anchors(resolved), f"{doc}: {target}: no heading makes #{anchor}"


def test_the_readme_image_is_in_the_tree():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README_TEXT)
    assert images and all(os.path.isfile(os.path.join(REPO_ROOT, image)) for image in images), images


def test_check_dist_notices_a_readme_link_the_sdist_lacks(tmp_path):
    """tools/check_dist.py reads the README inside the sdist and names each linked file or
    folder the sdist lacks (the README is the package's long description)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import check_dist
    finally:
        sys.path.remove(os.path.join(REPO_ROOT, "tools"))
    files = {"README.md": "![plot](docs/images/a.png) [api](docs/api.md#backend) [ex](examples/) "
                          "[site](https://example.org) `[not](a link)`\n",
             "docs/api.md": "x", "examples/one.py": "x"}
    top = f"kvbm_ext-{kvbm_ext.__version__}"
    sdist = tmp_path / f"{top}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in files.items():
            path = tmp_path / "member"
            path.write_text(text)
            tar.add(path, arcname=f"{top}/{name}")
    assert check_dist.sdist_problems(str(sdist), list(files)) == [
        "README.md links docs/images/a.png, which the sdist lacks"]
