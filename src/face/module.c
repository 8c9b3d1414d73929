/* The CPython face of the core, module _tms_preload or _tms_torch (one per hook variant): its definition, state and error mapping; the methods are module_ops.c's, module_table.c's and module_process.c's. */
#include "face/module.h"

#include <string.h>

#include "hooks/variant.h"
#include "share/job.h"

#define TMS_EXPORT __attribute__((visibility("default")))

module_state *tms_py_state(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* type(obj).__name__ as a new str (the limited API has no tp_name), or NULL. */
static PyObject *type_name(PyObject *obj)
{
    return PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
}

PyObject *tms_py_type_error(const char *what, const char *expected, PyObject *obj)
{
    PyObject *name = type_name(obj);
    if (name) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, not %U", what, expected, name);
        Py_DECREF(name);
    }
    return NULL;
}

PyObject *tms_py_raise(PyObject *module, const struct tms_err *err)
{
    module_state *st = tms_py_state(module);
    PyObject *type;
    switch (err->status) {
    case TMS_E_OOM:
    case TMS_E_HOST_OOM: type = st->oom_error; break;
    case TMS_E_ARG:
    case TMS_E_NOT_FOUND: type = PyExc_ValueError; break;
    case TMS_E_UNSUPPORTED: type = PyExc_NotImplementedError; break;
    case TMS_E_DRIVER:
    case TMS_E_IO:
    case TMS_E_NO_DRIVER:
    case TMS_E_STATE: type = st->error; break;
    default:
        PyErr_Format(st->error, "torch_memory_saver: unrecognised status %d: %s", err->status, err->msg);
        return NULL;
    }
    if (err->flags & TMS_ERR_DISK_DIR) type = st->disk_dir_error;
    if (err->flags & TMS_ERR_CORRUPT) type = st->integrity_error;
    PyErr_Format(type, "torch_memory_saver: %s", err->msg[0] ? err->msg : tms_status_name(err->status));
    return NULL;
}

const char *tms_py_tag_bytes(PyObject *obj, const char *what)
{
    if (!PyUnicode_Check(obj)) return tms_py_type_error(what, "a str", obj), NULL;
    Py_ssize_t len = 0;
    const char *tag = PyUnicode_AsUTF8AndSize(obj, &len);
    if (!tag) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s %R is not valid UTF-8", what, obj);
        return NULL;
    }
    if ((size_t)len != strlen(tag)) {
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s %R contains a null character", what, obj);
        return NULL;
    }
    return tag;
}

PyObject *tms_py_list_of_dicts(const void *rows, size_t n, size_t row_size, PyObject *(*to_dict)(const void *))
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *d = to_dict((const char *)rows + i * row_size);
        if (!d) {
            Py_CLEAR(list);
            break;
        }
        if (PyList_SetItem(list, (Py_ssize_t)i, d) < 0) {  /* steals d */
            Py_CLEAR(list);
            break;
        }
    }
    return list;
}

/* The package's own classes (torch_memory_saver/_errors.py), so both variants
 * raise the same torch_memory_saver.Error. A variant loaded outside the
 * package (a C build's test) makes classes of its own. */
static int import_error_types(module_state *st)
{
    PyObject *errors = PyImport_ImportModule("torch_memory_saver._errors");
    if (errors) {
        st->error = PyObject_GetAttrString(errors, "Error");
        st->oom_error = st->error ? PyObject_GetAttrString(errors, "OutOfMemoryError") : NULL;
        st->disk_dir_error = st->oom_error ? PyObject_GetAttrString(errors, "DiskBackupDirError") : NULL;
        st->integrity_error = st->disk_dir_error ? PyObject_GetAttrString(errors, "IntegrityError") : NULL;
        Py_DECREF(errors);
        return st->integrity_error ? 0 : -1;
    }
    if (!PyErr_ExceptionMatches(PyExc_ImportError)) return -1;
    PyErr_Clear();
    st->error = PyErr_NewExceptionWithDoc("torch_memory_saver." TMS_MODULE_NAME ".Error",
                                          "A torch_memory_saver operation failed; the message says which and why.",
                                          PyExc_RuntimeError, NULL);
    if (!st->error) return -1;
    PyObject *oom_bases = PyTuple_Pack(2, st->error, PyExc_MemoryError);
    if (!oom_bases) return -1;
    st->oom_error = PyErr_NewExceptionWithDoc("torch_memory_saver." TMS_MODULE_NAME ".OutOfMemoryError",
                                              "Device or host memory ran out (or the margin was reached).",
                                              oom_bases, NULL);
    Py_DECREF(oom_bases);
    st->disk_dir_error = Py_NewRef(PyExc_ValueError);
    st->integrity_error = Py_NewRef(st->error);
    return st->oom_error ? 0 : -1;
}

static int module_exec(PyObject *module)
{
    struct tms_err env_err = {0};
    if (tms_env_check(&env_err)) {
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s", env_err.msg);
        return -1;
    }
    tms_job_register();  /* TMS_JOB (or the job setting) makes this process a member */
    module_state *st = tms_py_state(module);
    if (import_error_types(st) < 0) return -1;
    st->view_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tms_py_view_spec, NULL);
    if (!st->view_type) return -1;
    PyObject *views = PyImport_ImportModule("torch_memory_saver._backup_view");
    if (views) {
        st->make_view = PyObject_GetAttrString(views, "view");
        Py_DECREF(views);
        if (!st->make_view) return -1;
    } else if (PyErr_ExceptionMatches(PyExc_ImportError)) {
        PyErr_Clear();  /* loaded outside the package: get_cpu_backup says why it cannot */
    } else {
        return -1;
    }
    if (PyModule_AddFunctions(module, tms_py_ops_methods) < 0 || PyModule_AddFunctions(module, tms_py_table_methods) < 0 ||
        PyModule_AddFunctions(module, tms_py_process_methods) < 0 || PyModule_AddFunctions(module, tms_py_share_methods) < 0)
        return -1;
    if (tms_variant_hooks_allocator() && PyModule_AddFunctions(module, tms_py_preload_methods) < 0) return -1;
    if (PyModule_AddObjectRef(module, "Error", st->error) < 0) return -1;
    if (PyModule_AddObjectRef(module, "OutOfMemoryError", st->oom_error) < 0) return -1;
    if (PyModule_AddObjectRef(module, "BackupView", (PyObject *)st->view_type) < 0) return -1;
    if (PyModule_AddStringConstant(module, "VARIANT", TMS_STR(TMS_VARIANT)) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *st = tms_py_state(module);
    Py_VISIT(st->error);
    Py_VISIT(st->oom_error);
    Py_VISIT(st->disk_dir_error);
    Py_VISIT(st->integrity_error);
    Py_VISIT(st->view_type);
    Py_VISIT(st->make_view);
    return 0;
}

static int module_clear(PyObject *module)
{
    module_state *st = tms_py_state(module);
    Py_CLEAR(st->error);
    Py_CLEAR(st->oom_error);
    Py_CLEAR(st->disk_dir_error);
    Py_CLEAR(st->integrity_error);
    Py_CLEAR(st->view_type);
    Py_CLEAR(st->make_view);
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = TMS_MODULE_NAME,
    .m_doc = "torch_memory_saver core (" TMS_STR(TMS_VARIANT) " hook variant).",
    .m_size = sizeof(module_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

TMS_EXPORT PyObject *TMS_CAT(PyInit__tms_, TMS_VARIANT)(void) { return PyModuleDef_Init(&module_def); }
