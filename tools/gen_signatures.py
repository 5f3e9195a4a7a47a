#!/usr/bin/env python3
"""Every public signature of kvbm_ext._C is written once, in csrc/args/signatures.c: a
table of parameters per function (name, kind, default, stub type), which the C parser
reads at each call.  This tool reads the same tables and writes what follows from them:

  csrc/args/signatures.h   the structs the parser fills (one field per parameter name),
                           the defaults the C readers apply to a field not given
                           (KV_<STRUCT>_<FIELD>_DEFAULT), the signatures' declarations,
                           and each docstring's first line
                           (KV_<NAME>_TEXT_SIGNATURE, which the docstring starts with)
  kvbm_ext/__init__.pyi    the def of each function and method (the rest of the stub,
                           its aliases, properties and Python classes, is written by hand)

  tools/gen_signatures.py           # write both
  tools/gen_signatures.py --check   # write nothing; exit 1 with a diff where either differs

tests/test_signatures.py runs the check, compares the built module's text signatures
with the tables, and calls each function with every default given and left out.
signatures.c's form is strict (see its header): anything else in it is an error, so
that what this tool reads is what the compiler reads."""

import argparse
import ast
import dataclasses
import difflib
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = os.path.join(ROOT, "csrc", "args", "signatures.c")
HEADER = os.path.join(ROOT, "csrc", "args", "signatures.h")
STUBS = os.path.join(ROOT, "kvbm_ext", "__init__.pyi")
WIDTH = 120             # a stub def longer than this takes one line per parameter (as black writes it)
TUPLE_PARAMS = 4        # KV_TUPLE_PARAMS: the most a constructor (kv_parse_tuple_arguments) takes

POSITIONAL_ONLY, POSITIONAL, VAR_POSITIONAL, KEYWORD_ONLY = "KV_POSITIONAL_ONLY", "KV_POSITIONAL", \
    "KV_VAR_POSITIONAL", "KV_KEYWORD_ONLY"
ORDER = {POSITIONAL_ONLY: 0, POSITIONAL: 1, VAR_POSITIONAL: 2, KEYWORD_ONLY: 3}


class SignatureError(ValueError):
    pass


@dataclasses.dataclass
class Param:
    name: str
    kind: str
    default: str | None     # a Python expression; None: required
    type: str
    struct: str | None      # the struct whose field receives it (None for *name)


@dataclasses.dataclass
class Signature:
    ident: str              # kv_<name>_signature
    form: str               # KV_SIGNATURE, KV_CONSTRUCTOR, KV_NO_ARGUMENTS or KV_UNPARSED
    owner: str | None       # the class of a method
    name: str
    struct: str | None      # the struct the parser fills
    params: list
    returns: str

    @property
    def constructor(self):
        return self.form == "KV_CONSTRUCTOR"

    @property
    def qualname(self):
        return self.owner if self.constructor else f"{self.owner}.{self.name}" if self.owner else self.name

    @property
    def macro(self):
        return f"KV_{self.ident[len('kv_'):-len('_signature')].upper()}_TEXT_SIGNATURE"

    def text_signature(self):
        """The docstring's first line, as CPython reads __text_signature__ from it."""
        if self.constructor:
            return f"{self.owner}({', '.join(self.parts(doc=True))})"
        parts = self.parts(doc=True)
        # $self is positional-only: CPython's own docstrings mark it so with a "/" where
        # the method takes nothing else by position.
        if self.owner is not None:
            takes_position = any(p.kind in (POSITIONAL_ONLY, POSITIONAL) for p in self.params)
            parts = ["$self"] + (["/"] if not takes_position else []) + parts
        elif not parts:
            parts = ["$module", "/"]
        return f"{self.name}({', '.join(parts)})"

    def parts(self, doc):
        """The parameters as a def lists them, with "/" and "*"; defaults as the docstring
        writes them (doc) or as the stub does (annotated)."""
        shown = []
        has_var = any(p.kind == VAR_POSITIONAL for p in self.params)
        for i, p in enumerate(self.params):
            if p.kind == KEYWORD_ONLY and not has_var and "*" not in shown:
                shown.append("*")
            text = p.name if doc else f"{p.name}: {p.type}"
            if p.kind == VAR_POSITIONAL:
                text = "*" + text
            if p.default is not None:
                text += f"={doc_default(p.default)}" if doc else f" = {stub_default(p.default)}"
            shown.append(text)
            if p.kind == POSITIONAL_ONLY and (i + 1 == len(self.params) or self.params[i + 1].kind != POSITIONAL_ONLY):
                shown.append("/")
        return shown

    def stub_def(self, indent):
        """The def of the stub, on one line where it fits in WIDTH columns."""
        name = "__new__" if self.constructor else self.name
        first = ["cls"] if self.constructor else ["self"] if self.owner else []
        parts = first + self.parts(doc=False)
        line = f"{indent}def {name}({', '.join(parts)}) -> {self.returns}: ..."
        if len(line) <= WIDTH:
            return [line]
        return [f"{indent}def {name}("] + [f"{indent}    {part}," for part in parts] + \
            [f"{indent}) -> {self.returns}: ..."]


def doc_default(text):
    node = ast.parse(text, mode="eval").body
    return repr(node.value) if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)


def stub_default(text):
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and '"' not in node.value \
            and "\\" not in node.value:
        return f'"{node.value}"'
    return ast.unparse(node)


# ------------------------------------------------------------ reading signatures.c

TOKEN = re.compile(r'\s+|/\*.*?\*/|//[^\n]*|(?P<string>"(?:[^"\\\n]|\\.)*")|(?P<word>\w+)|(?P<punct>[{}()\[\],;=])',
                   re.DOTALL)
ESCAPES = {'"': '"', "\\": "\\", "'": "'"}
# What each macro takes, a letter an argument: s a string, w a word, n a string or NULL,
# r a string or KV_REQUIRED (both read as None).
MACROS = {"KV_PARAM": "wwwrs", "KV_VAR_PARAM": "ws", "KV_SIGNATURE": "nswws", "KV_CONSTRUCTOR": "sww",
          "KV_NO_ARGUMENTS": "nss", "KV_UNPARSED": "nsws"}
LETTERS = {"s": "a string", "w": "a name", "n": "a string or NULL", "r": "a string or KV_REQUIRED"}


def unescape(literal, line):
    def one(match):
        if match.group(1) not in ESCAPES:
            raise SignatureError(f"signatures.c:{line}: no escape \\{match.group(1)} in a table's strings")
        return ESCAPES[match.group(1)]
    return re.sub(r"\\(.)", one, literal[1:-1])


def tokens(text):
    """(kind, value, line) of the C text: strings unescaped and adjacent ones joined, as the
    compiler joins them; no preprocessor line but #include."""
    text = re.sub(r'^#include "[\w.]+"$', "", text, flags=re.MULTILINE)
    if "#" in re.sub(r'"(?:[^"\\\n]|\\.)*"|/\*.*?\*/|//[^\n]*', "", text, flags=re.DOTALL):
        raise SignatureError("signatures.c: no preprocessor line but #include: the tables are read as written")
    out, pos, line = [], 0, 1
    while pos < len(text):
        match = TOKEN.match(text, pos)
        if match is None:
            raise SignatureError(f"signatures.c:{line}: unexpected {text[pos:pos + 20]!r}")
        if match.group("string"):
            value = unescape(match.group("string"), line)
            if out and out[-1][0] == "string":
                out[-1] = ("string", out[-1][1] + value, out[-1][2])
            else:
                out.append(("string", value, line))
        elif match.group("word") or match.group("punct"):
            out.append(("word" if match.group("word") else "punct", match.group(0), line))
        line += match.group(0).count("\n")
        pos = match.end()
    return out


class Reader:
    """A strict reader of signatures.c's two statements (see its header)."""

    def __init__(self, text):
        self.tokens, self.at = tokens(text), 0

    def peek(self):
        return self.tokens[self.at] if self.at < len(self.tokens) else ("end", "", 0)

    def take(self, *expected):
        """The next token's value: one of `expected` (values), or a word where "word" is."""
        kind, value, line = self.peek()
        if value not in expected and not (kind == "word" and "word" in expected):
            raise SignatureError(f"signatures.c:{line}: expected {' or '.join(expected)}, got {value!r}")
        self.at += 1
        return value

    def call(self, *macros):
        """(macro, its arguments, line) of a call of one of `macros`, each argument checked
        against MACROS."""
        line = self.peek()[2]
        macro = self.take(*macros)
        self.take("(")
        values = []
        while True:
            values.append(self.peek())
            self.at += 1
            if self.take(",", ")") == ")":
                break
        spec = MACROS[macro]
        if len(values) != len(spec):
            raise SignatureError(f"signatures.c:{line}: {macro} takes {len(spec)} arguments, got {len(values)}")
        out = []
        for letter, (kind, value, _) in zip(spec, values):
            none = {"n": "NULL", "r": "KV_REQUIRED"}.get(letter)
            if kind == "word" and value == none:
                out.append(None)
            elif kind == ("word" if letter == "w" else "string"):
                out.append(value)
            else:
                raise SignatureError(f"signatures.c:{line}: {macro}: {value!r} is not {LETTERS[letter]}")
        return macro, out, line

    def table(self):
        """`static const kv_param NAME[] = {rows};`: (NAME, its parameters)."""
        self.take("static"), self.take("const"), self.take("kv_param")
        name = self.take("word")
        self.take("["), self.take("]"), self.take("="), self.take("{")
        rows = []
        while self.peek()[1] != "}":
            macro, values, line = self.call("KV_PARAM", "KV_VAR_PARAM")
            if macro == "KV_VAR_PARAM":
                rows.append(Param(values[0], VAR_POSITIONAL, None, values[1], None))
            elif values[2] not in (POSITIONAL_ONLY, POSITIONAL, KEYWORD_ONLY):
                raise SignatureError(f"signatures.c:{line}: {values[1]}: no kind {values[2]}")
            else:
                struct, field, kind, default, stub_type = values
                rows.append(Param(field, kind, default, stub_type, struct))
            if self.peek()[1] != "}":
                self.take(",")
        self.take("}"), self.take(";")
        return name, rows

    def signature(self, tables, used):
        """`const kv_signature IDENT = KV_...(...);` of one of the four forms (arguments.h)."""
        self.take("const"), self.take("kv_signature")
        ident = self.take("word")
        self.take("=")
        form, values, line = self.call("KV_SIGNATURE", "KV_CONSTRUCTOR", "KV_NO_ARGUMENTS", "KV_UNPARSED")
        self.take(";")
        struct = table = None
        if form == "KV_SIGNATURE":
            owner, name, struct, table, returns = values
        elif form == "KV_CONSTRUCTOR":
            owner, struct, table = values
            name = returns = owner
        elif form == "KV_NO_ARGUMENTS":
            owner, name, returns = values
        else:
            owner, name, table, returns = values
        if table is not None:
            if table not in tables or table in used:
                raise SignatureError(f"signatures.c:{line}: {ident}: {table} is no table, or another's")
            used.add(table)
        return Signature(ident, form, owner, name, struct, tables.get(table, []), returns)


def read_signatures(text):
    """The signatures of signatures.c, in its order, checked."""
    reader, tables, used, found = Reader(text), {}, set(), []
    while reader.peek()[0] != "end":
        if reader.peek()[1] == "static":
            name, rows = reader.table()
            if name in tables:
                raise SignatureError(f"signatures.c: two tables {name}")
            tables[name] = rows
        else:
            found.append(reader.signature(tables, used))
    unused = sorted(set(tables) - used)
    if unused:
        raise SignatureError(f"signatures.c: tables no signature names: {unused}")
    for signature in found:
        check(signature)
    for attr in ("ident", "qualname", "macro"):
        values = [getattr(s, attr) for s in found]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise SignatureError(f"signatures.c: two signatures of {attr} {repeated}")
    return found


def check(s):
    """What Python allows of a def, and what kv_parse_arguments reads: kinds in order,
    required parameters first and by position, the rows filling the signature's struct."""
    where = f"signatures.c: {s.ident}"
    if not re.fullmatch(r"kv_\w+_signature", s.ident):
        raise SignatureError(f"{where}: a signature is named kv_<name>_signature")
    names = [p.name for p in s.params]
    if len(set(names)) != len(names):
        raise SignatureError(f"{where}: a parameter named twice")
    kinds = [ORDER[p.kind] for p in s.params]
    if kinds != sorted(kinds) or kinds.count(ORDER[VAR_POSITIONAL]) > 1:
        raise SignatureError(f"{where}: parameters in the order positional-only, positional, *name, keyword-only")
    optional = False
    for p in s.params:
        if p.default is None and p.kind != VAR_POSITIONAL and (optional or p.kind == KEYWORD_ONLY):
            raise SignatureError(f"{where}: {p.name}: a required parameter after an optional one, or keyword-only")
        optional = optional or p.default is not None
        for text in ([p.default] if p.default is not None else []) + [p.type]:
            try:
                ast.parse(text, mode="eval")
            except SyntaxError as error:
                raise SignatureError(f"{where}: {p.name}: {text!r} is not a Python expression") from error
    parsed = s.form in ("KV_SIGNATURE", "KV_CONSTRUCTOR")
    if parsed and any(p.struct != s.struct for p in s.params):
        raise SignatureError(f"{where}: every parameter is a field of {s.struct}")
    if s.constructor and len(s.params) > TUPLE_PARAMS:
        raise SignatureError(f"{where}: a constructor takes at most {TUPLE_PARAMS} parameters")
    if s.form == "KV_UNPARSED" and any(p.struct is not None for p in s.params):
        raise SignatureError(f"{where}: KV_UNPARSED declares its parameters with KV_VAR_PARAM")


# ------------------------------------------------------------ writing signatures.h

def wrap(text, indent):
    """A comment's text in lines of at most 100 columns."""
    return textwrap.wrap(text, 100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def c_default(text):
    """A default as the C readers take it: a str as a string literal, a bool as 1 or 0, an
    int as itself; None for None, which is the field left NULL."""
    value = ast.literal_eval(text)
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    raise ValueError(text)


def struct_defaults(struct, signatures):
    """{field: C default} of the optional fields of `struct` that are not None.  The
    signatures sharing the struct share its readers, so they must agree on each default."""
    found = {}
    for s in signatures:
        for p in s.params if s.struct == struct else []:
            if p.default is None:
                continue
            try:
                value = c_default(p.default)
            except ValueError as error:
                raise SignatureError(f"signatures.c: {s.ident}: {p.name}: default {p.default!r} is not None, "
                                     "a bool, an int or a plain str") from error
            if found.setdefault(p.name, value) != value:
                raise SignatureError(f"signatures.c: {s.ident}: {p.name}: default {p.default!r}, but another "
                                     f"signature filling {struct} gives it another: one field, one default")
    return {field: value for field, value in found.items() if value is not None}


def default_macro(struct, field):
    return f"{struct.upper()}_{field.upper()}_DEFAULT"


def header(signatures):
    """signatures.h: per struct, a field per parameter name of the signatures filling it
    (in their order) and the defaults of its fields; then each signature's declaration and
    text signature."""
    structs = {}
    for s in signatures:
        if s.struct is not None:
            users, fields = structs.setdefault(s.struct, ([], []))
            users.append(f"{s.qualname}()")
            fields += [p.name for p in s.params if p.name not in fields]
    lines = ["/* Generated by tools/gen_signatures.py from signatures.c: do not edit; after a change",
             " * there, run it again.  The structs the parser fills (one field per parameter, NULL",
             " * where not given), the defaults their readers apply to a field left NULL (a str as a",
             " * string, a bool as 1 or 0; a default of None is the field left NULL), the signatures,",
             " * and the first line of each docstring. */",
             "/* clang-format off */",
             "#ifndef KVBM_SIGNATURES_H",
             "#define KVBM_SIGNATURES_H",
             "",
             '#include "arguments.h"',
             ""]
    for struct, (users, fields) in structs.items():
        lines += wrap(f"/* The arguments of {', '.join(users)}. */", " * ")
        lines.append("typedef struct {")
        lines += [f"    PyObject *{field};" for field in fields]
        lines += [f"}} {struct};", ""]
        defaults = struct_defaults(struct, signatures)
        lines += [f"#define {default_macro(struct, field)} {value}" for field, value in defaults.items()]
        lines += [""] if defaults else []
    for s in signatures:
        text = s.text_signature().replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f"extern const kv_signature {s.ident};")
        lines.append(f'#define {s.macro} "{text}\\n--\\n\\n"')
    lines += ["", "#endif /* KVBM_SIGNATURES_H */", "/* clang-format on */", ""]
    return "\n".join(lines)


# ------------------------------------------------------------ writing the stub's defs

def stub_with_defs(stubs, signatures):
    """The stub with the def of every signature replaced by the generated one, where it
    stands (module level, or in its class's body)."""
    tree = ast.parse(stubs)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    replacements = []
    for s in signatures:
        owner = s.owner
        if owner is not None and owner not in classes:
            raise SignatureError(f"kvbm_ext/__init__.pyi: no class {owner} (for {s.qualname})")
        body = classes[owner].body if owner is not None else tree.body
        name = "__new__" if s.constructor else s.name
        defs = [node for node in body if isinstance(node, ast.FunctionDef) and node.name == name]
        if len(defs) != 1 or defs[0].decorator_list:
            raise SignatureError(f"kvbm_ext/__init__.pyi: {s.qualname}: expected one undecorated def {name}; add "
                                 f"a placeholder `def {name}(): ...` where it belongs")
        indent = " " * defs[0].col_offset
        replacements.append((defs[0].lineno, defs[0].end_lineno, s.stub_def(indent)))
    declared = {(s.owner, "__new__" if s.constructor else s.name) for s in signatures}
    for owner in {s.owner for s in signatures if s.owner is not None}:
        for node in classes[owner].body:
            if isinstance(node, ast.FunctionDef) and not node.decorator_list and (owner, node.name) not in declared:
                raise SignatureError(f"kvbm_ext/__init__.pyi: {owner}.{node.name} is declared in no signature "
                                     "of csrc/args/signatures.c")
    lines = stubs.split("\n")
    for first, last, new in sorted(replacements, reverse=True):
        lines[first - 1:last] = new
    return "\n".join(lines)


def generate(tables_text, stubs_text):
    """{path: text} of the generated files, from signatures.c's text and the stub's."""
    signatures = read_signatures(tables_text)
    return {HEADER: header(signatures), STUBS: stub_with_defs(stubs_text, signatures)}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def differences():
    """A unified diff per generated file that differs from what is written, and the
    generated texts."""
    generated = generate(read(TABLES), read(STUBS))
    diffs = []
    for path, text in generated.items():
        current = read(path) if os.path.exists(path) else ""
        if current != text:
            name = os.path.relpath(path, ROOT)
            diffs.append("".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                      f"{name} (written)", f"{name} (generated)")))
    return diffs, generated


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file differs")
    options = parser.parse_args(argv)
    try:
        diffs, generated = differences()
    except SignatureError as error:
        print(f"gen_signatures: {error}", file=sys.stderr)
        return 2
    if options.check:
        for diff in diffs:
            print(diff, end="")
        if diffs:
            print("gen_signatures: out of date: run tools/gen_signatures.py", file=sys.stderr)
        return 1 if diffs else 0
    for path, text in generated.items():
        if not os.path.exists(path) or read(path) != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
