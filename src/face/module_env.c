/* _tms_env: every TMS_* variable checked at `import torch_memory_saver`, without loading a core. */
#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  /* the stable ABI, as the variants */
#endif
#include <Python.h>

#include "platform/config.h"

#define TMS_EXPORT __attribute__((visibility("default")))

static int module_exec(PyObject *module)
{
    (void)module;
    struct tms_err err = {0};
    if (tms_env_check(&err) == TMS_OK) return 0;
    PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s", err.msg);
    return -1;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_tms_env",
    .m_doc = "Raises ValueError at import naming the first malformed TMS_* variable (config.c parses them).",
    .m_size = 0,
    .m_slots = module_slots,
};

TMS_EXPORT PyObject *PyInit__tms_env(void) { return PyModuleDef_Init(&module_def); }
