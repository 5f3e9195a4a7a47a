/* kvbm_ext._C._NcclComm, a Resharder transport's NCCL communicator
 * (nccl_comm.c, over gpu.h's kv_nccl), and _C._NCCL_RECORD_MAX, the largest
 * record its swap() exchanges. */
#ifndef KVBM_NCCL_COMM_H
#define KVBM_NCCL_COMM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

int kv_nccl_comm_add_type(PyObject *module);

#endif /* KVBM_NCCL_COMM_H */
