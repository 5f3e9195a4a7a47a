/* A public function's parameters, declared once, and the parser that reads
 * a call's arguments by them.
 *
 * Every public callable of the module has one kv_signature in signatures.c:
 * a table of its parameters (name, kind, default, stub type), each bound to
 * a field of the struct the parser fills.  From that table come the
 * parser's names and rules (here), and, through tools/gen_signatures.py,
 * the struct itself, the defaults its readers apply and the docstring's
 * first line (signatures.h) and the
 * function's def in kvbm_ext/__init__.pyi; tests/test_signatures.py fails
 * when any of them differs from what the tables say. */
#ifndef KVBM_ARGUMENTS_H
#define KVBM_ARGUMENTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

/* How Python passes a parameter.  In a table they come in this order. */
typedef enum {
    KV_POSITIONAL_ONLY, /* before the "/" */
    KV_POSITIONAL,      /* by position or by keyword */
    KV_KEYWORD_ONLY,    /* after the "*" */
    KV_VAR_POSITIONAL,  /* *name, of a function that reads its arguments itself */
} kv_param_kind;

typedef struct {
    const char *name;
    kv_param_kind kind;
    /* The default as Python writes it ("None", "'NHD'", "0"), for the
     * docstring and the stub; NULL (KV_REQUIRED): none, the argument must
     * be given.  The parser leaves an argument not given NULL: its reader
     * applies the default, which signatures.h carries as C reads it
     * (KV_<STRUCT>_<FIELD>_DEFAULT; None is the field left NULL). */
    const char *default_value;
    const char *stub_type; /* its annotation in kvbm_ext/__init__.pyi */
    size_t offset;         /* of the PyObject * field that receives it */
} kv_param;

#define KV_REQUIRED NULL

/* A parameter named as `field` of struct `args` (signatures.h). */
#define KV_PARAM(args, field, kind, default_value, stub_type)                                                          \
    {#field, kind, default_value, stub_type, offsetof(args, field)}

/* *name, taking any number of positional arguments: only in a signature
 * the parser does not read (KV_UNPARSED). */
#define KV_VAR_PARAM(name, stub_type) {#name, KV_VAR_POSITIONAL, KV_REQUIRED, stub_type, 0}

typedef struct {
    const char *owner; /* the class of a method; NULL for a module function */
    const char *name;  /* as Python calls it and its errors name it */
    const kv_param *params;
    int count;
    size_t size;         /* of the struct the parser fills; 0 where it reads nothing */
    const char *returns; /* the stub's return annotation */
} kv_signature;

#define KV_COUNT(params) ((int)(sizeof params / sizeof params[0]))

/* A module function (owner NULL) or a method whose arguments the parser
 * reads into an `args` struct. */
#define KV_SIGNATURE(owner, name, args, params, returns) {owner, name, params, KV_COUNT(params), sizeof(args), returns}

/* A class's constructor (its tp_new; __new__ in the stub): errors name
 * the class, as the docstring does. */
#define KV_CONSTRUCTOR(type, args, params) {type, type, params, KV_COUNT(params), sizeof(args), type}

/* One that takes no argument (METH_NOARGS). */
#define KV_NO_ARGUMENTS(owner, name, returns) {owner, name, NULL, 0, 0, returns}

/* One that reads its arguments itself (METH_FASTCALL). */
#define KV_UNPARSED(owner, name, params, returns) {owner, name, params, KV_COUNT(params), 0, returns}

/* Reads the arguments of a METH_FASTCALL | METH_KEYWORDS call into *out, a
 * struct of signature->size bytes: each parameter's field receives its
 * argument (borrowed from the call), or NULL when it was not given; the
 * struct's other fields are NULL.  No tuple or dict is built.  TypeError
 * as Python words it for a function defined with that signature.  Returns
 * 0 or -1. */
int kv_parse_arguments(const kv_signature *signature, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       void *out);

/* The same for a type's tp_new, which receives a tuple and a dict: read
 * by PyArg_ParseTupleAndKeywords, so that its errors are those of any
 * other type's constructor.  At most KV_TUPLE_PARAMS parameters. */
#define KV_TUPLE_PARAMS 4
int kv_parse_tuple_arguments(const kv_signature *signature, PyObject *args, PyObject *kwargs, void *out);

#endif /* KVBM_ARGUMENTS_H */
