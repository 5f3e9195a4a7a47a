"""Each public signature is written once, in csrc/args/signatures.c, and the three things
that follow from it cannot drift: the C parser reads the tables themselves;
tools/gen_signatures.py writes the docstrings' first lines (csrc/args/signatures.h) and the
stub's defs (kvbm_ext/__init__.pyi) from them, and its check mode passes; the built module's
text signatures are the generated ones; and the module's parser accepts and refuses the
names and positions the tables declare, and reads an argument left out as the table's
default.  Reads files and calls the module; builds nothing."""

import ast
import inspect
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import kvbm_ext
from support import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import gen_signatures  # noqa: E402

sys.path.pop(0)

TABLES = gen_signatures.read(gen_signatures.TABLES)
STUBS = gen_signatures.read(gen_signatures.STUBS)
SIGNATURES = gen_signatures.read_signatures(TABLES)


def test_generated_files_are_up_to_date():
    """tools/gen_signatures.py --check: signatures.h and the stub's defs are what the tables
    say (after a change to csrc/args/signatures.c: run tools/gen_signatures.py)."""
    result = subprocess.run([sys.executable, os.path.join("tools", "gen_signatures.py"), "--check"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr


def runtime_object(signature):
    if signature.constructor:
        return getattr(kvbm_ext, signature.owner)
    if signature.owner is not None:
        return getattr(getattr(kvbm_ext, signature.owner), signature.name)
    return getattr(kvbm_ext, signature.name)


@pytest.mark.parametrize("signature", SIGNATURES, ids=lambda s: s.qualname)
def test_the_module_shows_the_generated_text_signature(signature):
    """The built docstring starts with the generated line (a stale build, or a docstring
    that does not start with its KV_<NAME>_TEXT_SIGNATURE, fails here)."""
    obj = runtime_object(signature)
    shown = signature.owner if signature.constructor else signature.name
    assert f"{shown}{obj.__text_signature__}" == signature.text_signature()


def test_every_c_callable_has_a_signature():
    """Every builtin function of kvbm_ext, PagedKVCache's constructor and every method of
    the C types (dunders too, private ones not) is declared, and nothing else is."""
    declared = {s.qualname for s in SIGNATURES}
    found = {name for name in kvbm_ext.__all__ if inspect.isbuiltin(getattr(kvbm_ext, name))} | {"PagedKVCache"}
    for cls in (kvbm_ext.PagedKVCache, kvbm_ext.HostBuffer, kvbm_ext.Deferred):
        found |= {f"{cls.__name__}.{name}" for name, value in vars(cls).items()
                  if type(value).__name__ == "method_descriptor" and not (name[0] == "_" and name[-1] != "_")}
    assert found == declared


# ------------------------------------------------------------ the parser reads the tables


class Bad:
    """An argument no reader takes."""


def callables(signature):
    """(callable, description) of a parsed signature, on a small host cache or buffer for
    methods."""
    if signature.owner == "PagedKVCache" and not signature.constructor:
        cache = kvbm_ext.PagedKVCache([np.zeros((4, 16, 2, 8), np.float16)], "bthd")
        return getattr(cache, signature.name)
    if signature.owner == "HostBuffer":
        return getattr(kvbm_ext.pinned_empty(8, "uint8"), signature.name)
    if signature.owner == "Deferred":
        return getattr(deferred(), signature.name)
    return runtime_object(signature)


def deferred():
    """The Deferred of a call on the CPU, done when it returns."""
    cache = kvbm_ext.PagedKVCache([np.arange(4 * 16 * 2 * 8, dtype=np.float16).reshape(4, 16, 2, 8)], "bthd")
    return cache.to_cache(kvbm_ext.PagedKVCache([np.zeros((4, 16, 2, 8), np.float16)], "bthd"), [1], [2], defer=True)


def message(function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 -- any reader's refusal of Bad
        return str(error)
    return ""


PARSED = [s for s in SIGNATURES if s.form in ("KV_SIGNATURE", "KV_CONSTRUCTOR")]


@pytest.mark.parametrize("signature", PARSED, ids=lambda s: s.qualname)
def test_the_parser_takes_the_declared_keywords(signature):
    """Each parameter the table declares is a keyword the call takes, or a positional-only
    one it refuses as such; a name no table declares is refused."""
    function = callables(signature)
    shown = signature.owner if signature.constructor else signature.name
    for p in signature.params:
        said = message(function, **{p.name: Bad()})
        if p.kind == gen_signatures.POSITIONAL_ONLY:
            assert f"positional-only arguments passed as keyword arguments: '{p.name}'" in said, said
        else:
            assert "unexpected keyword" not in said and "invalid keyword" not in said, (p.name, said)
    required = [Bad() for p in signature.params if p.default is None]
    said = message(function, *required, no_such_parameter=Bad())
    assert f"{shown}() got an unexpected keyword argument 'no_such_parameter'" in said \
        or f"'no_such_parameter' is an invalid keyword argument for {shown}()" in said, said


@pytest.mark.parametrize("signature", PARSED, ids=lambda s: s.qualname)
def test_the_parser_takes_the_declared_positions(signature):
    """As many positional arguments as the table's positional parameters, no more; the
    first required one missing is named with its position."""
    function = callables(signature)
    shown = signature.owner if signature.constructor else signature.name
    positional = [p for p in signature.params if p.kind != gen_signatures.KEYWORD_ONLY]
    said = message(function, *[Bad()] * (len(positional) + 1))
    plural = "" if len(positional) == 1 else "s"
    assert f"{shown}() takes at most {len(positional)} positional argument{plural} " \
           f"({len(positional) + 1} given)" in said, said
    required = [p for p in signature.params if p.default is None]
    if required:
        assert message(function) == f"{shown}() missing required argument '{required[0].name}' (pos 1)"


# ------------------------------------------------------------ the readers apply the tables' defaults


def host_cache(rng, zeros=False):
    """A host cache of 3 layers [4 blocks, 4 tokens, 2 heads, 8] (nt != nh, so that NHD
    and HND differ), and its layers."""
    layers = [np.zeros((4, 4, 2, 8), np.float32) if zeros else rng.random((4, 4, 2, 8), np.float32)
              for _ in range(3)]
    return kvbm_ext.PagedKVCache(layers, "bthd"), layers


def conversion_call(name):
    """A call of one of the six conversions on one block (nl = no = 2, nt = 4, nh = 2),
    writing its second argument."""
    def make():
        rng = np.random.default_rng(0)
        sides = {"blocks": [[rng.random((4, 2, 8), np.float32) for _ in range(4)]],
                 "universals": [rng.random((2, 2, 2, 4, 8), np.float32)],
                 "operationals": [rng.random((2, 2, 64), np.float32)]}
        source, target = name.split("_to_")
        sides[f"{target}s"] = [np.zeros_like(a) for a in sides[f"{target}s"]] if target != "block" else \
            [[np.zeros_like(a) for a in sides["blocks"][0]]]
        arrays = [sides[f"{source}s"], sides[f"{target}s"]]
        return getattr(kvbm_ext, name), arrays, {}, arrays
    return make


def cache_call(name):
    """A call of a PagedKVCache method on a host cache, writing universal, operational
    blocks or a second cache."""
    def make():
        rng = np.random.default_rng(0)
        cache, layers = host_cache(rng)
        if name == "to_cache":
            dst, dst_layers = host_cache(rng, zeros=True)
            return cache.to_cache, [dst, [1], [2]], {}, layers + dst_layers
        flat = [rng.random((2, 3, 1, 4, 8) if name.endswith("universal") else (3, 1, 64), np.float32)]
        if name.startswith("to_"):
            flat = [np.zeros_like(flat[0])]
        args = [[1], flat] if name.startswith("to_") else [flat, [1]]
        return getattr(cache, name), args, {}, layers + flat
    return make


def plain_call(function, *args):
    return lambda: (function, list(args), {}, [])


PAGED_METHODS = ("to_universal", "from_universal", "to_operational", "from_operational", "to_cache")
# Per parsed signature, calls whose outcome depends on each default: another value for any
# of them moves other bytes, or is refused on the CPU (backend, num_ctas, stream).  A
# variant's kwargs are the context some defaults need to show (pack_layers does only
# where `layers` selects some).
DEFAULT_CALLS = {
    **{name: [(conversion_call(name), {})] for name in ("block_to_universal", "universal_to_block",
                                                         "block_to_operational", "operational_to_block",
                                                         "universal_to_operational", "operational_to_universal")},
    **{f"PagedKVCache.{name}": [(cache_call(name), {}), (cache_call(name), {"layers": slice(1, 3)})]
       for name in PAGED_METHODS},
    "vectorized_copy": [(plain_call(kvbm_ext.vectorized_copy, [0], [0], [0]), {})],
    "memcpy_batch": [(plain_call(kvbm_ext.memcpy_batch, [0], [0], [0]), {})],
    "PagedKVCache": [(lambda: (kvbm_ext.PagedKVCache, [[np.zeros((4, 16, 2, 8), np.float16)], "bthd"], {}, []), {})],
    "set_staging": [(plain_call(kvbm_ext.set_staging), {})],
    "reserve_staging": [(plain_call(kvbm_ext.reserve_staging), {})],
    "staging_info": [(plain_call(kvbm_ext.staging_info), {})],
    "crc32c": [(plain_call(kvbm_ext.crc32c, np.arange(16, dtype=np.uint8)), {})],
    "pinned_empty": [(plain_call(kvbm_ext.pinned_empty, 8, "uint8"), {})],
    "unlink_shared": [(plain_call(kvbm_ext.unlink_shared, "kvbm_ext_no_such_region"), {})],
    "HostBuffer.__dlpack__": [(lambda: (kvbm_ext.pinned_empty(8, "uint8").__dlpack__, [], {}, []), {})],
    "Deferred.result": [(lambda: (deferred().result, [], {}, []), {})],
}


def outcome(make, kwargs):
    """What a call did: its result (or error), its warnings, the bytes of what it wrote."""
    function, args, base, watched = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = re.sub(r" at 0x[0-9a-f]+", "", repr(function(*args, **base, **kwargs)))
        except Exception as error:  # noqa: BLE001 -- an error is an outcome to compare
            result = f"{type(error).__name__}: {error}"
    return result, [str(w.message) for w in caught], [a.tobytes() for a in flat_arrays(watched)]


def flat_arrays(items):
    """The arrays of nested lists of arrays (a call's blocks are lists of chunks)."""
    return [a for item in items for a in (flat_arrays(item) if isinstance(item, list) else [item])]


def test_every_parsed_signature_has_calls_for_its_defaults():
    assert sorted(DEFAULT_CALLS) == sorted(s.qualname for s in PARSED)


def test_an_argument_left_out_reads_as_the_tables_default():
    """Each optional parameter, passed its default as signatures.c writes it, does what
    leaving it out does: the C readers apply the table's default (signatures.h's
    KV_<STRUCT>_<FIELD>_DEFAULT; None is the field left NULL), not one of their own."""
    differ = []
    for s in PARSED:
        for make, context in DEFAULT_CALLS[s.qualname]:
            for p in s.params:
                if p.default is None or p.name in context:
                    continue
                assert p.kind != gen_signatures.POSITIONAL_ONLY, f"{s.qualname}: {p.name} passed by keyword"
                left_out = outcome(make, context)
                given = outcome(make, {**context, p.name: ast.literal_eval(p.default)})
                if left_out != given:
                    differ.append(f"{s.qualname}({p.name}={p.default}) with {context}: "
                                  f"{given[:2]} but left out {left_out[:2]}, or other bytes")
    assert differ == [], "\n".join(differ)


def test_a_default_is_emitted_for_the_c_readers():
    """signatures.h carries each optional field's default as C reads it; a struct's
    signatures must agree on a field's default (they share its readers)."""
    header = gen_signatures.generate(TABLES, STUBS)[gen_signatures.HEADER]
    assert '#define KV_CONVERSION_ARGS_LAYOUT_DEFAULT "NHD"' in header
    assert "#define KV_PAGED_ARGS_PACK_LAYERS_DEFAULT 0" in header
    assert "#define KV_CRC32C_ARGS_VALUE_DEFAULT 0" in header
    assert "KV_STAGING_ARGS_DEVICE_DEFAULT" not in header  # None: the field left NULL
    changed = TABLES.replace('KV_PARAM(kv_conversion_args, layout, KV_POSITIONAL, "\'NHD\'"',
                             'KV_PARAM(kv_conversion_args, layout, KV_POSITIONAL, "\'HND\'"', 1)
    assert changed != TABLES
    with pytest.raises(gen_signatures.SignatureError, match="one field, one default"):
        gen_signatures.generate(changed, STUBS)
    changed = changed.replace("'NHD'", "'HND'")
    assert '#define KV_CONVERSION_ARGS_LAYOUT_DEFAULT "HND"' in gen_signatures.generate(changed, STUBS)[
        gen_signatures.HEADER]


# ------------------------------------------------------------ the generator can fail


def test_a_renamed_parameter_changes_every_output():
    """A name changed in the tables changes the struct, the docstring's line and the stub's
    def, so that the check above fails until they are generated again."""
    changed = TABLES.replace("KV_PARAM(kv_crc32c_args, value,", "KV_PARAM(kv_crc32c_args, start,", 1)
    assert changed != TABLES
    before = gen_signatures.generate(TABLES, STUBS)
    after = gen_signatures.generate(changed, STUBS)
    header, stubs = after[gen_signatures.HEADER], after[gen_signatures.STUBS]
    assert "PyObject *start;" in header and '"crc32c(data, /, start=0)\\n--\\n\\n"' in header
    assert "def crc32c(data: Any, /, start: SupportsIndex = 0) -> int: ..." in stubs
    assert "PyObject *start;" not in before[gen_signatures.HEADER]


def test_a_def_edited_in_the_stub_is_written_back():
    edited = STUBS.replace("def crc32c(data: Any, /, value: SupportsIndex = 0)", "def crc32c(data: Any, value: int = 0)")
    assert edited != STUBS
    assert gen_signatures.generate(TABLES, edited)[gen_signatures.STUBS] == STUBS


def test_a_long_def_takes_a_line_per_parameter():
    text = "\n".join(next(s for s in SIGNATURES if s.name == "to_cache").stub_def("    "))
    assert text.startswith("    def to_cache(\n        self,\n        dst: PagedKVCache,\n")
    assert text.endswith("        stream: _Stream = None,\n        defer: bool = False,\n    ) -> Deferred | None: ...")


@pytest.mark.parametrize("old,new,error", [
    ('KV_PARAM(kv_crc32c_args, value, KV_POSITIONAL, "0",', 'KV_PARAM(kv_crc32c_args, value, KV_KEYWORD_ONLY, KV_REQUIRED,',
     "required parameter"),
    ('KV_PARAM(kv_crc32c_args, value, KV_POSITIONAL,', 'KV_PARAM(kv_crc32c_args, data, KV_POSITIONAL,', "named twice"),
    ('KV_PARAM(kv_crc32c_args, data, KV_POSITIONAL_ONLY,', 'KV_PARAM(kv_crc32c_args, data, KV_KEYWORD_ONLY,', "order"),
    ('KV_PARAM(kv_crc32c_args, value, KV_POSITIONAL, "0",', 'KV_PARAM(kv_copy_args, value, KV_POSITIONAL, "0",',
     "every parameter is a field of kv_crc32c_args"),
    ('"SupportsIndex"),\n};\nconst kv_signature kv_crc32c', '"Supports Index"),\n};\nconst kv_signature kv_crc32c',
     "not a Python expression"),
    ('#include "signatures.h"', '#include "signatures.h"\n#define CRC32C_VALUE "0"', "preprocessor"),
    ("const kv_signature kv_crc32c_signature", "const kv_signature kv_crc32c_sig", "kv_<name>_signature"),
    ('KV_SIGNATURE(NULL, "crc32c", kv_crc32c_args, CRC32C, "int")', 'KV_SIGNATURE(NULL, "crc32c", CRC32C, "int")',
     "takes 5 arguments"),
    ('KV_SIGNATURE(NULL, "crc32c",', "KV_SIGNATURE(NULL, CRC32C_NAME,", "'CRC32C_NAME' is not a string"),
    ('"0", "SupportsIndex"),\n};', '"0", "SupportsIndex\\t"),\n};', "no escape"),
])
def test_the_reader_refuses_what_it_cannot_read(old, new, error):
    changed = TABLES.replace(old, new, 1)
    assert changed != TABLES, old
    with pytest.raises(gen_signatures.SignatureError, match=error):
        gen_signatures.read_signatures(changed)


def test_a_method_of_a_c_class_without_a_signature_is_refused():
    stubs = STUBS.replace("    def close(self) -> None: ...\n", "    def close(self) -> None: ...\n"
                                                                    "    def reopen(self) -> None: ...\n", 1)
    assert stubs != STUBS
    with pytest.raises(gen_signatures.SignatureError, match="HostBuffer.reopen"):
        gen_signatures.generate(TABLES, stubs)
