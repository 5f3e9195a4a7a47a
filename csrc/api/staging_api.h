/* The module's staging functions (staging_api.c): set_staging,
 * reserve_staging and staging_info, with their docstrings. */
#ifndef KVBM_STAGING_API_H
#define KVBM_STAGING_API_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *kv_set_staging(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *kv_reserve_staging(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *kv_staging_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
extern const char kv_set_staging_doc[], kv_reserve_staging_doc[], kv_staging_info_doc[];

#endif /* KVBM_STAGING_API_H */
