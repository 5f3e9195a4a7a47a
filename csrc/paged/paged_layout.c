/* The layout string of kvbm_ext.PagedKVCache.  See paged_layout.h. */
#include "paged_layout.h"

#include <stdio.h>
#include <string.h>

const char KV_LAYOUT_LETTERS[DIM_COUNT + 1] = "lkbthd";
const char *const KV_LAYOUT_NAMES[DIM_COUNT] = {"layer", "K/V", "block", "token", "head", "head dim"};

/* Letter index of character c (either case), or -1. */
static int letter_of(Py_UCS4 read)
{
    const Py_UCS4 c = read >= 'A' && read <= 'Z' ? read - 'A' + 'a' : read;
    const char *found = c != 0 && c < 128 ? strchr(KV_LAYOUT_LETTERS, (int)c) : NULL;
    return found == NULL ? -1 : (int)(found - KV_LAYOUT_LETTERS);
}

static int unknown_character(PyObject *text, Py_ssize_t i, Py_UCS4 read)
{
    PyObject *character = PyUnicode_FromOrdinal((int)read);
    if (character != NULL)
        kv_error(PyExc_ValueError,
                 "layout: %R at position %zd of %R is not one of l (layer), k (K/V), b (block), "
                 "t (token), h (head), d (head dim), or a parenthesis grouping letters",
                 character, i, text);
    Py_XDECREF(character);
    return -1;
}

/* A parenthesis at position i: opens a group (one new dimension) or closes
 * the open one.  *open is the position of the open group's '(' or -1. */
static int parenthesis(PyObject *text, Py_ssize_t i, Py_UCS4 c, Py_ssize_t *open, kv_layout *out)
{
    if (c == '(') {
        if (*open >= 0)
            return kv_error(PyExc_ValueError,
                            "layout: '(' at position %zd of %R opens a group inside the group "
                            "opened at position %zd; groups do not nest",
                            i, text, *open);
        *open = i;
        out->ndim++;
        return 0;
    }
    if (*open < 0)
        return kv_error(PyExc_ValueError, "layout: ')' at position %zd of %R closes no group", i, text);
    if (out->letters[out->ndim - 1] == 0)
        return kv_error(PyExc_ValueError, "layout: the group at position %zd of %R is empty", *open, text);
    *open = -1;
    return 0;
}

int kv_layout_parse(PyObject *text, kv_layout *out)
{
    if (!PyUnicode_Check(text))
        return kv_error(PyExc_TypeError, "layout: expected a str such as \"kbthd\", got %s", Py_TYPE(text)->tp_name);
    memset(out, 0, sizeof *out);
    for (int i = 0; i < DIM_COUNT; i++)
        out->dim[i] = -1;
    Py_ssize_t open = -1;
    const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_UCS4 read = PyUnicode_READ_CHAR(text, i);
        if (read == '(' || read == ')') {
            if (parenthesis(text, i, read, &open, out) < 0)
                return -1;
            continue;
        }
        const int letter = letter_of(read);
        if (letter < 0)
            return unknown_character(text, i, read);
        if (out->dim[letter] >= 0)
            return kv_error(PyExc_ValueError, "layout: letter '%c' (%s) appears twice in %R", KV_LAYOUT_LETTERS[letter],
                            KV_LAYOUT_NAMES[letter], text);
        /* Distinct letters, each in a dimension of its own or a group: at
         * most DIM_COUNT dimensions. */
        const int d = open >= 0 ? out->ndim - 1 : out->ndim++;
        out->group[d][out->letters[d]++] = letter;
        out->dim[letter] = d;
    }
    if (open >= 0)
        return kv_error(PyExc_ValueError, "layout: the group opened at position %zd of %R is not closed", open, text);
    const int required[] = {DIM_B, DIM_T, DIM_D};
    for (int i = 0; i < 3; i++)
        if (out->dim[required[i]] < 0)
            return kv_error(PyExc_ValueError, "layout: %R has no '%c' (%s); every cache has b, t and d", text,
                            KV_LAYOUT_LETTERS[required[i]], KV_LAYOUT_NAMES[required[i]]);
    return 0;
}

void kv_layout_dim_text(const kv_layout *layout, int d, char *buf, size_t size)
{
    const int n = layout->letters[d];
    size_t at = 0;
    if (n > 1 && at + 1 < size)
        buf[at++] = '(';
    for (int j = 0; j < n && at + 1 < size; j++)
        buf[at++] = KV_LAYOUT_LETTERS[layout->group[d][j]];
    if (n > 1 && at + 1 < size)
        buf[at++] = ')';
    buf[at] = '\0';
}

PyObject *kv_layout_text(const kv_layout *layout)
{
    char text[3 * DIM_COUNT + 1] = "";
    size_t at = 0;
    for (int d = 0; d < layout->ndim; d++) {
        kv_layout_dim_text(layout, d, text + at, sizeof text - at);
        at = strlen(text);
    }
    return PyUnicode_FromString(text);
}

/* The size of a grouped letter that does not take the rest: t's is
 * block_size (0 when not given), k's 2; 0 for the others. */
static int64_t known_size(int letter, int64_t block_size)
{
    return letter == DIM_T ? block_size : letter == DIM_K ? 2 : 0;
}

/* Sizes of the letters of grouped dimension d; the one letter of unknown
 * size takes the rest. */
static int group_sizes(const kv_layout *layout, int d, int64_t extent, int64_t block_size, const kv_path *path,
                       int64_t size[DIM_COUNT])
{
    char text[3 * DIM_COUNT + 1];
    kv_layout_dim_text(layout, d, text, sizeof text);
    int64_t known = 1;
    int rest = -1;
    for (int j = 0; j < layout->letters[d]; j++) {
        const int letter = layout->group[d][j];
        if (letter == DIM_T && block_size == 0)
            return kv_error(PyExc_ValueError,
                            "block_size: the layout groups 't' in dimension %d ('%s'), so "
                            "block_size= must say how many tokens a block holds",
                            d, text);
        size[letter] = known_size(letter, block_size);
        if (size[letter] == 0 && rest >= 0)
            return kv_error(PyExc_ValueError,
                            "layout: '%s' groups '%c' and '%c', whose sizes are not known; one "
                            "letter of a group at most takes the rest of the dimension (t is block_size, k is 2)",
                            text, KV_LAYOUT_LETTERS[rest], KV_LAYOUT_LETTERS[letter]);
        if (size[letter] == 0)
            rest = letter;
        else if (__builtin_mul_overflow(known, size[letter], &known))
            known = INT64_MAX; /* fits no extent: refused below */
    }
    if (rest >= 0 ? extent % known == 0 : extent == known) {
        if (rest >= 0)
            size[rest] = extent / known;
        return 0;
    }
    if (layout->dim[DIM_T] == d) {
        char where[96];
        kv_path_format(path, where, sizeof where);
        return kv_error(PyExc_ValueError,
                        "block_size: %lld does not fit dimension %d ('%s') of %s, which has %lld "
                        "entries",
                        (long long)block_size, d, text, where, (long long)extent);
    }
    return kv_path_error(PyExc_ValueError, path, "dimension %d ('%s') has %lld entries, %s %lld", d, text,
                         (long long)extent, rest >= 0 ? "not a multiple of" : "but its letters make", (long long)known);
}

static int block_size_differs(int64_t block_size, int d, int64_t tokens, const kv_path *path)
{
    char where[96];
    kv_path_format(path, where, sizeof where);
    return kv_error(PyExc_ValueError, "block_size: %lld, but dimension %d ('t') of %s has %lld tokens",
                    (long long)block_size, d, where, (long long)tokens);
}

int kv_layout_geometry(const kv_layout *layout, const kv_array *a, int64_t block_size, const kv_path *path,
                       int64_t size[DIM_COUNT], int64_t stride[DIM_COUNT])
{
    for (int letter = 0; letter < DIM_COUNT; letter++)
        size[letter] = 1, stride[letter] = 0;
    for (int d = 0; d < layout->ndim; d++) {
        const int first = layout->group[d][0];
        if (layout->letters[d] == 1) {
            size[first] = a->shape[d];
            stride[first] = a->strides[d];
            if (first == DIM_T && block_size != 0 && a->shape[d] != block_size)
                return block_size_differs(block_size, d, a->shape[d], path);
            continue;
        }
        if (group_sizes(layout, d, a->shape[d], block_size, path, size) < 0)
            return -1;
        /* Row-major: the innermost letter has the dimension's stride. */
        int64_t running = a->strides[d];
        for (int j = layout->letters[d] - 1; j >= 0; j--) {
            const int letter = layout->group[d][j];
            stride[letter] = running;
            if (__builtin_mul_overflow(running, size[letter], &running))
                return kv_path_error(PyExc_ValueError, path, "dimension %d overflows its strides", d);
        }
    }
    return 0;
}
