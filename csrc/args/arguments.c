/* The parser that reads a call's arguments by a kv_signature.  See
 * arguments.h. */
#include "arguments.h"

#include <stdio.h>
#include <string.h>

/* The field of `out` that receives parameter `p`. */
static PyObject **field_of(void *out, const kv_param *p) { return (PyObject **)((char *)out + p->offset); }

/* The parameter a keyword names among those that take keywords, or NULL
 * (also for a name that is not a str, which the call then rejects). */
static const kv_param *keyword_param(const kv_signature *signature, PyObject *name)
{
    for (int i = 0; i < signature->count; i++) {
        const kv_param *p = &signature->params[i];
        if (p->kind != KV_POSITIONAL_ONLY && PyUnicode_Check(name)
            && PyUnicode_CompareWithASCIIString(name, p->name) == 0)
            return p;
    }
    return NULL;
}

/* The TypeError of a keyword no parameter takes: positional-only, or
 * unknown.  Returns -1. */
static int keyword_error(const kv_signature *signature, PyObject *name)
{
    for (int i = 0; i < signature->count; i++) {
        const kv_param *p = &signature->params[i];
        if (p->kind == KV_POSITIONAL_ONLY && PyUnicode_Check(name)
            && PyUnicode_CompareWithASCIIString(name, p->name) == 0) {
            PyErr_Format(PyExc_TypeError,
                         "%s() got some positional-only arguments passed as keyword "
                         "arguments: '%s'",
                         signature->name, p->name);
            return -1;
        }
    }
    PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", signature->name, name);
    return -1;
}

int kv_parse_arguments(const kv_signature *signature, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       void *out)
{
    if (signature->size == 0) {
        PyErr_Format(PyExc_SystemError, "%s() reads its arguments itself", signature->name);
        return -1;
    }
    memset(out, 0, signature->size);
    int positional = 0; /* the parameters that take a position */
    while (positional < signature->count && signature->params[positional].kind != KV_KEYWORD_ONLY)
        positional++;
    nargs = PyVectorcall_NARGS(nargs);
    if (nargs > positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional argument%s (%zd given)", signature->name,
                     positional, positional == 1 ? "" : "s", nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        *field_of(out, &signature->params[i]) = args[i];
    const Py_ssize_t keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < keywords; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        const kv_param *p = keyword_param(signature, name);
        if (p == NULL)
            return keyword_error(signature, name);
        PyObject **field = field_of(out, p);
        if (*field != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", signature->name, p->name);
            return -1;
        }
        *field = args[nargs + k];
    }
    /* Required parameters come first, and take a position. */
    for (int i = 0; i < signature->count; i++) {
        const kv_param *p = &signature->params[i];
        if (p->default_value == KV_REQUIRED && *field_of(out, p) == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", signature->name, p->name,
                         i + 1);
            return -1;
        }
    }
    return 0;
}

/* PyArg_ParseTupleAndKeywords's format for the signature: "O" a
 * parameter, "|" before the first optional one, "$" before the first
 * keyword-only one, the name after ":" ("OO|$O:PagedKVCache"). */
static void tuple_format(const kv_signature *signature, char *format, size_t size)
{
    size_t n = 0;
    for (int i = 0; i < signature->count; i++) {
        const kv_param *p = &signature->params[i], *before = i > 0 ? p - 1 : NULL;
        if (p->default_value != KV_REQUIRED && (before == NULL || before->default_value == KV_REQUIRED))
            format[n++] = '|';
        if (p->kind == KV_KEYWORD_ONLY && (before == NULL || before->kind != KV_KEYWORD_ONLY))
            format[n++] = '$';
        format[n++] = 'O';
    }
    snprintf(format + n, size - n, ":%s", signature->name);
}

_Static_assert(KV_TUPLE_PARAMS == 4, "kv_parse_tuple_arguments passes PyArg_ParseTupleAndKeywords four pointers");

int kv_parse_tuple_arguments(const kv_signature *signature, PyObject *args, PyObject *kwargs, void *out)
{
    if (signature->size == 0 || signature->count > KV_TUPLE_PARAMS) {
        PyErr_Format(PyExc_SystemError, "%s(): no tuple parser for this signature", signature->name);
        return -1;
    }
    char format[3 * KV_TUPLE_PARAMS + 64];
    char *keywords[KV_TUPLE_PARAMS + 1] = {NULL};
    PyObject *values[KV_TUPLE_PARAMS] = {NULL};
    tuple_format(signature, format, sizeof format);
    for (int i = 0; i < signature->count; i++) /* "": positional-only */
        keywords[i] = (char *)(signature->params[i].kind == KV_POSITIONAL_ONLY ? "" : signature->params[i].name);
    /* The format takes as many pointers as the signature has parameters;
     * a variadic function ignores the ones after. */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, keywords, &values[0], &values[1], &values[2], &values[3]))
        return -1;
    memset(out, 0, signature->size);
    for (int i = 0; i < signature->count; i++)
        *field_of(out, &signature->params[i]) = values[i];
    return 0;
}
