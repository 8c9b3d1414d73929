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

PyDoc_STRVAR(names_doc, "names($module, /)\n--\n\nThe TMS_* variables the library, its command line or its build reads.");

static PyObject *names(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out && tms_env_name(i); i++) {
        PyObject *name = PyUnicode_FromString(tms_env_name(i));
        if (!name || PyList_Append(out, name) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
    }
    return out;
}

PyDoc_STRVAR(is_known_doc, "is_known($module, name, /)\n--\n\n"
             "True if the library, its command line, its build or the project's tools read the variable.");

static PyObject *is_known(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (!name) return NULL;
    return PyBool_FromLong(tms_env_known(name));
}

static PyMethodDef module_methods[] = {
    {"names", names, METH_NOARGS, names_doc},
    {"is_known", is_known, METH_O, is_known_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_tms_env",
    .m_doc = "Raises ValueError at import naming the first malformed TMS_* variable (config.c parses them); "
              "names the variables the library reads.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

TMS_EXPORT PyObject *PyInit__tms_env(void) { return PyModuleDef_Init(&module_def); }
