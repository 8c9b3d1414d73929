/* Inside the CPython face (module*.c): the module's state, the one status-to-exception mapping, argument helpers, and each part's methods. */
#ifndef TMS_FACE_MODULE_H
#define TMS_FACE_MODULE_H

#define PY_SSIZE_T_CLEAN
/* The stable ABI of CPython 3.10 and later: one abi3 build serves them all. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#include <Python.h>

#include "core/core.h"
#include "face/py_weak.h"

#ifndef TMS_VARIANT
#error "TMS_VARIANT must be defined (preload or torch)"
#endif
#define TMS_STR_(x) #x
#define TMS_STR(x) TMS_STR_(x)
#define TMS_CAT_(a, b) a##b
#define TMS_CAT(a, b) TMS_CAT_(a, b)
#define TMS_MODULE_NAME "_tms_" TMS_STR(TMS_VARIANT)

/* Module state: Python objects only. */
typedef struct {
    PyObject *error;          /* torch_memory_saver.Error(RuntimeError) */
    PyObject *oom_error;      /* torch_memory_saver.OutOfMemoryError(Error, MemoryError) */
    PyObject *disk_dir_error; /* torch_memory_saver.DiskBackupDirError(ValueError, OSError) */
    PyObject *integrity_error; /* torch_memory_saver.IntegrityError(Error): restored bytes differ from their pause's */
    PyTypeObject *view_type;  /* BackupView: keeps a host backup alive */
    PyObject *make_view;      /* torch_memory_saver._backup_view.view, or NULL outside the package */
} module_state;

module_state *tms_py_state(PyObject *module);
/* The one place a library status becomes a Python exception; returns NULL. */
PyObject *tms_py_raise(PyObject *module, const struct tms_err *err);
/* Raises TypeError "<what> must be <expected>, not <type name>"; returns NULL. */
PyObject *tms_py_type_error(const char *what, const char *expected, PyObject *obj);
/* The UTF-8 bytes of a str tag (what C checks), or NULL with an exception
 * naming the tag: a str the codec cannot encode (a lone surrogate), or one
 * holding a NUL that C would cut it at. */
const char *tms_py_tag_bytes(PyObject *obj, const char *what);
/* A Python list with one dict per C row; NULL with an exception set if a dict fails. */
PyObject *tms_py_list_of_dicts(const void *rows, size_t n, size_t row_size, PyObject *(*to_dict)(const void *));

/* BackupView, made per module at its exec (module_table.c). */
extern PyType_Spec tms_py_view_spec;

/* Each part's methods, added to the module at its exec. */
extern PyMethodDef tms_py_ops_methods[];      /* module_ops.c: regions, pause and resume, allocation */
extern PyMethodDef tms_py_table_methods[];    /* module_table.c: the table, statistics, host backups as views */
extern PyMethodDef tms_py_process_methods[];  /* module_process.c: settings, backends and devices, hooks */
extern PyMethodDef tms_py_share_methods[];    /* module_share.c: sharing memory with other processes */
/* module_process.c: the allocator hooks' questions, added only where the variant has them
 * (hooks/variant.h: tms_variant_hooks_allocator). */
extern PyMethodDef tms_py_preload_methods[];

#endif
