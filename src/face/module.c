/* The CPython face of the core: module _tms_preload or _tms_torch, one per hook variant. */
#define PY_SSIZE_T_CLEAN
/* The stable ABI of CPython 3.10 and later: one abi3 build serves them all. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#include <Python.h>

#include <dlfcn.h>
#include <limits.h>
#include <string.h>

#include "core/core.h"
#include "face/py_weak.h"
#include "hooks/hook_preload.h"

#ifndef TMS_VARIANT
#error "TMS_VARIANT must be defined (preload or torch)"
#endif
#define TMS_STR_(x) #x
#define TMS_STR(x) TMS_STR_(x)
#define TMS_CAT_(a, b) a##b
#define TMS_CAT(a, b) TMS_CAT_(a, b)
#define TMS_MODULE_NAME "_tms_" TMS_STR(TMS_VARIANT)
#define TMS_IS_preload 1
#define TMS_IS_torch 0
#define TMS_VARIANT_IS_PRELOAD TMS_CAT(TMS_IS_, TMS_VARIANT)

#define TMS_EXPORT __attribute__((visibility("default")))

/* Module state: Python objects only. */
typedef struct {
    PyObject *error;          /* torch_memory_saver.Error(RuntimeError) */
    PyObject *oom_error;      /* torch_memory_saver.OutOfMemoryError(Error, MemoryError) */
    PyTypeObject *view_type;  /* BackupView: keeps a host backup alive */
    PyObject *make_view;      /* torch_memory_saver._backup_view.view, or NULL outside the package */
} module_state;

static module_state *state_of(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* type(obj).__name__ as a new str (the limited API has no tp_name), or NULL. */
static PyObject *type_name(PyObject *obj)
{
    return PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
}

/* Raises TypeError "<what> must be <expected>, not <type name>"; returns NULL. */
static PyObject *type_error(const char *what, const char *expected, PyObject *obj)
{
    PyObject *name = type_name(obj);
    if (name) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, not %U", what, expected, name);
        Py_DECREF(name);
    }
    return NULL;
}

/* The one place a library status becomes a Python exception. */
static PyObject *raise_err(PyObject *module, const struct tms_err *err)
{
    module_state *st = state_of(module);
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
    PyErr_Format(type, "torch_memory_saver: %s", err->msg[0] ? err->msg : tms_status_name(err->status));
    return NULL;
}

/* The UTF-8 bytes of a str tag (what C checks), or NULL with an exception
 * naming the tag: a str the codec cannot encode (a lone surrogate), or one
 * holding a NUL that C would cut it at. */
static const char *tag_bytes(PyObject *obj, const char *what)
{
    if (!PyUnicode_Check(obj)) return type_error(what, "a str", obj), NULL;
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

/* ---- region settings (thread-local in C) ----------------------------------- */

PyDoc_STRVAR(set_region_doc,
"set_region($module, active, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup=False, /)\n--\n\n"
"Set the calling thread's region: allocations it makes while active are pauseable\n"
"(backed up to a file each when enable_disk_backup, which wins over enable_cpu_backup).");

static PyObject *py_set_region(PyObject *module, PyObject *args)
{
    int active, backup, disk = 0;
    PyObject *tag_obj;
    const char *kind_name;
    if (!PyArg_ParseTuple(args, "pOps|p:set_region", &active, &tag_obj, &backup, &kind_name, &disk)) return NULL;
    const char *tag = tag_bytes(tag_obj, "set_region: tag");
    if (!tag) return NULL;
    struct tms_err err = {0};
    int kind, rc = TMS_E_ARG;
    if (tms_core_backup_kind_parse(kind_name, &kind) != TMS_OK) {
        tms_fail(&err, TMS_E_ARG, 0, "cpu_backup_backend must be 'pinned' or 'mmap', got '%.64s'", kind_name);
    } else {
        Py_BEGIN_ALLOW_THREADS  /* the table lock: no C lock is awaited holding the GIL */
        rc = tms_core_set_region(active, tag, backup, kind, disk, &err);
        Py_END_ALLOW_THREADS
    }
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(check_region_doc,
"check_region($module, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup, /)\n--\n\n"
"The CPU backup backend a region asked for this way gets (cpu_backup_backend None: the\n"
"default), or ValueError naming what is wrong with the request.");

static PyObject *py_check_region(PyObject *module, PyObject *args)
{
    PyObject *tag_obj, *backend_obj;
    int backup, disk;
    if (!PyArg_ParseTuple(args, "OpOp:check_region", &tag_obj, &backup, &backend_obj, &disk)) return NULL;
    const char *tag = tag_bytes(tag_obj, "tag");
    if (!tag) return NULL;
    const char *backend = NULL;
    if (backend_obj != Py_None && !(backend = tag_bytes(backend_obj, "cpu_backup_backend"))) return NULL;
    struct tms_region_request req = {.tag = tag, .cpu_backup = backup, .backend = backend, .disk_backup = disk};
    struct tms_err err = {0};
    int kind = 0;
    if (tms_core_check_region(&req, &kind, &err)) return raise_err(module, &err);
    return PyUnicode_FromString(tms_core_backup_kind_name(kind));
}

PyDoc_STRVAR(get_region_doc,
"get_region($module, /)\n--\n\n"
"The calling thread's region as (active, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup).");

static PyObject *py_get_region(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const struct tms_region *r = tms_core_region();
    return Py_BuildValue("(NsNsN)", PyBool_FromLong(r->active), tms_core_tag_name(r->tag_id),
                         PyBool_FromLong(r->backup), tms_core_backup_kind_name(r->backup_kind),
                         PyBool_FromLong(r->disk_backup));
}

/* ---- pause / resume ---------------------------------------------------------- */


/* pause/resume's tag argument in C: None (every tag: *n 0, *tags NULL), a
 * str (*n 1), or a list or tuple of them. *seq holds the bytes alive (caller
 * drops it and frees *tags). -1 with an exception set. */
static int tags_of(PyObject *arg, const char *name, PyObject **seq, const char ***tags, Py_ssize_t *n)
{
    char what[64];
    snprintf(what, sizeof what, "%s: tag", name);
    *tags = NULL, *n = 0;
    int list = PyList_Check(arg) || PyTuple_Check(arg);
    if (arg != Py_None && !PyUnicode_Check(arg) && !list) return type_error(what, "a str, a list of str or None", arg), -1;
    if (arg == Py_None) return *seq = NULL, 0;
    /* A tuple: a list may change under us once the GIL goes. */
    if (!(*seq = list ? PySequence_Tuple(arg) : PyTuple_Pack(1, arg))) return -1;
    *n = PyTuple_Size(*seq);
    if (!(*tags = PyMem_Calloc(*n ? (size_t)*n : 1, sizeof **tags))) return PyErr_NoMemory(), -1;
    if (list) snprintf(what, sizeof what, "%s: tag in the list", name);
    for (Py_ssize_t i = 0; i < *n; i++)
        if (!((*tags)[i] = tag_bytes(PyTuple_GetItem(*seq, i), what))) return -1;
    return 0;
}

/* The skip argument of pause: None, or bytes of (start, length) pairs of
 * native uint64, sorted and disjoint (the core checks). -1 with an exception. */
static int skip_of(PyObject *arg, struct tms_free_span **spans, size_t *n)
{
    *spans = NULL, *n = 0;
    if (arg == Py_None) return 0;
    if (!PyBytes_Check(arg)) return type_error("pause: skip", "bytes of (start, length) uint64 pairs or None", arg), -1;
    const char *data = PyBytes_AsString(arg);
    Py_ssize_t len = PyBytes_Size(arg);
    if (!data || len < 0) return -1;
    if (len % (Py_ssize_t)sizeof **spans) {
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: pause: skip is %zd bytes, not whole (start, length) pairs "
                     "of 16 bytes", len);
        return -1;
    }
    if (!len) return 0;
    if (!(*spans = PyMem_Malloc((size_t)len))) return PyErr_NoMemory(), -1;
    memcpy(*spans, data, (size_t)len);  /* aligned, and ours while the GIL is away */
    *n = (size_t)len / sizeof **spans;
    return 0;
}

static PyObject *list_of_dicts(const void *rows, size_t n, size_t row_size, PyObject *(*to_dict)(const void *));

static PyObject *device_report_dict(const void *row)
{
    const struct tms_op_device *d = row;
    return Py_BuildValue("{s:i,s:n,s:n,s:n,s:n,s:n,s:n}", "device", d->device, "allocations", (Py_ssize_t)d->allocations,
                         "released", (Py_ssize_t)d->released, "copied", (Py_ssize_t)d->copied, "skipped",
                         (Py_ssize_t)d->skipped, "free_before", (Py_ssize_t)d->free_before, "free_after",
                         (Py_ssize_t)d->free_after);
}

static PyObject *report_dict(const struct tms_op_report *r)
{
    PyObject *devices = list_of_dicts(r->devices, r->n_devices, sizeof *r->devices, device_report_dict);
    return devices ? Py_BuildValue("{s:K,s:N}", "ns", (unsigned long long)r->ns, "devices", devices) : NULL;
}

/* tag: None (every tag), a str, or a list or tuple of them (all or nothing).
 * Returns what the call did (report_dict). */
static PyObject *run_tag_op(PyObject *module, PyObject *arg, PyObject *skip_arg, int pause, const char *name)
{
    PyObject *seq = NULL;
    const char **tags = NULL;
    Py_ssize_t n = 0;
    struct tms_err err = {0};
    struct tms_op_report report = {0};
    struct tms_op_args args = {.report = &report};
    struct tms_free_span *skip = NULL;
    int rc = TMS_OK, list = PyList_Check(arg) || PyTuple_Check(arg);
    if (tags_of(arg, name, &seq, &tags, &n) < 0 || skip_of(skip_arg, &skip, &args.n_skip) < 0) {
        PyMem_Free(tags);
        Py_XDECREF(seq);
        return NULL;
    }
    args.skip = skip;
    if (!list || n > 0) {  /* an empty list: nothing to do, as a tag with no allocations */
        size_t n_tags = tags ? (size_t)n : 0;
        Py_BEGIN_ALLOW_THREADS
        rc = pause ? tms_core_pause_ex(tags, n_tags, &args, &err) : tms_core_resume_ex(tags, n_tags, &args, &err);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(skip);
    PyMem_Free(tags);
    Py_XDECREF(seq);
    if (rc) return raise_err(module, &err);
    return report_dict(&report);
}

PyDoc_STRVAR(selects_backup_doc,
"selects_backup($module, tag, /)\n--\n\n"
"True if a pause of tag (None, a str or a list of them) would back up an allocation.");
static PyObject *py_selects_backup(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *seq = NULL;
    const char **tags = NULL;
    Py_ssize_t n = 0;
    int found = 0;
    if (tags_of(arg, "selects_backup", &seq, &tags, &n) == 0) {
        Py_BEGIN_ALLOW_THREADS
        found = tms_core_selects_backup(tags, tags ? (size_t)n : 0);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(tags);
    Py_XDECREF(seq);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(found);
}

PyDoc_STRVAR(check_tags_doc,
"check_tags($module, op, tag, /)\n--\n\n"
"Raise as op ('pause' or 'resume') would for tag (None, a str or a list of them),\n"
"without touching the table.");
static PyObject *py_check_tags(PyObject *module, PyObject *args)
{
    const char *op;
    PyObject *arg, *seq = NULL;
    if (!PyArg_ParseTuple(args, "sO:check_tags", &op, &arg)) return NULL;
    const char **tags = NULL;
    Py_ssize_t n = 0;
    struct tms_err err = {0};
    int rc = TMS_OK;
    if (tags_of(arg, op, &seq, &tags, &n) < 0) {
        PyMem_Free(tags);
        Py_XDECREF(seq);
        return NULL;
    }
    if (PyList_Check(arg) || PyTuple_Check(arg)) rc = n ? tms_core_check_tags(op, tags, (size_t)n, &err) : TMS_OK;
    else if (tags) rc = tms_core_check_tag(tags[0], &err);
    PyMem_Free(tags);
    Py_XDECREF(seq);
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pause_doc,
"pause($module, tag, skip=None, /)\n--\n\n"
"Release the memory of tag (None: all tags; a list: all of them or none). skip: bytes of\n"
"native uint64 (start, length) pairs, sorted and disjoint, of device memory whose contents\n"
"need no backup. Returns {'ns', 'devices': [{device, allocations, released, copied,\n"
"skipped, free_before, free_after}]}.");
static PyObject *py_pause(PyObject *module, PyObject *args)
{
    PyObject *tag, *skip = Py_None;
    if (!PyArg_UnpackTuple(args, "pause", 1, 2, &tag, &skip)) return NULL;
    return run_tag_op(module, tag, skip, 1, "pause");
}

PyDoc_STRVAR(resume_doc,
"resume($module, tag, /)\n--\n\nMap tag's memory back at the same addresses (a list: all of them or none).\n"
"Returns a report as pause does.");
static PyObject *py_resume(PyObject *module, PyObject *tag)
{
    return run_tag_op(module, tag, Py_None, 0, "resume");
}

/* ---- direct allocation (host backend, tests) --------------------------------- */

PyDoc_STRVAR(malloc_doc,
"malloc($module, size, device=-1, /)\n--\n\n"
"Allocate through the core with the calling thread's region settings, as the hooks do.");

static PyObject *py_malloc(PyObject *module, PyObject *args)
{
    PyObject *size_obj, *device_obj = NULL;
    if (!PyArg_ParseTuple(args, "O!|O!:malloc", &PyLong_Type, &size_obj, &PyLong_Type, &device_obj)) return NULL;
    Py_ssize_t size = PyLong_AsSsize_t(size_obj);
    if (size == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: malloc: nbytes %R is larger than any device", size_obj);
    }
    if (size < 0) return PyErr_Format(PyExc_ValueError, "torch_memory_saver: malloc: nbytes must be >= 0, got %zd", size);
    long device = device_obj ? PyLong_AsLong(device_obj) : -1;
    if (device_obj && ((device == -1 && PyErr_Occurred()) || device < -1 || device > INT_MAX)) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: malloc: device must be >= 0 (or -1: the current one), "
                            "got %R", device_obj);
    }
    if (!tms_core_region()->active)
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: malloc of %zd bytes outside a region: enter region() first",
                            size);
    struct tms_err err = {0};
    void *ptr = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_alloc((size_t)size, (int)device, tms_core_region(), &ptr, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    return PyLong_FromVoidPtr(ptr);
}

PyDoc_STRVAR(free_doc, "free($module, ptr, /)\n--\n\nFree an allocation made by the core (active or paused).");

static PyObject *py_free(PyObject *module, PyObject *arg)
{
    if (!PyLong_Check(arg))
        return type_error("free: pointer", "an int", arg);
    unsigned long long address = PyLong_AsUnsignedLongLong(arg);  /* rejects negatives: no wrap-around */
    if (address == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "free: pointer %R is not a 64-bit address", arg);
    }
    void *ptr = (void *)(uintptr_t)address;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_free(ptr, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

/* ---- host backups as Python buffers ------------------------------------------ */

/* Keeps one reference on a host backup. The limited API of 3.10 has no
 * buffer protocol, so the bytes are exported by a ctypes array that holds
 * this object (torch_memory_saver/_backup_view.py): any view of them keeps
 * them alive. */
typedef struct {
    PyObject_HEAD
    struct tms_backup *backup;  /* one reference, dropped in dealloc */
} backup_keeper;

static void view_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    tms_core_backup_release(((backup_keeper *)self)->backup);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

static PyType_Slot view_slots[] = {
    {Py_tp_dealloc, view_dealloc},
    {Py_tp_doc, "Keeps the host backup of a paused (or retained) allocation alive while a view of it exists."},
    {0, NULL},
};

static PyType_Spec view_spec = {
    .name = "torch_memory_saver." TMS_MODULE_NAME ".BackupView",
    .basicsize = sizeof(backup_keeper),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = view_slots,
};

PyDoc_STRVAR(get_cpu_backup_doc,
"get_cpu_backup($module, ptr, nbytes, /)\n--\n\n"
"A writable memoryview of the host backup of [ptr, ptr+nbytes), or None if the\n"
"allocation holding ptr has no host copy now. The view keeps the bytes alive.");

static PyObject *py_get_cpu_backup(PyObject *module, PyObject *args)
{
    PyObject *ptr_obj;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "O!n:get_cpu_backup", &PyLong_Type, &ptr_obj, &nbytes)) return NULL;
    unsigned long long ptr = PyLong_AsUnsignedLongLong(ptr_obj);  /* checks sign and range */
    if (ptr == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "get_cpu_backup: pointer %R is not a 64-bit address", ptr_obj);
    }
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "get_cpu_backup: nbytes must be >= 0, got %zd", nbytes);
    struct tms_err err = {0};
    struct tms_backup *b = NULL;
    size_t offset = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* waits while a pause or resume moves that allocation */
    rc = tms_core_backup_of(ptr, (size_t)nbytes, &b, &offset, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    if (!b) Py_RETURN_NONE;
    module_state *st = state_of(module);
    if (!st->make_view) {
        tms_core_backup_release(b);
        return PyErr_Format(PyExc_ImportError, "get_cpu_backup needs torch_memory_saver._backup_view");
    }
    backup_keeper *keeper = PyObject_New(backup_keeper, st->view_type);
    if (!keeper) {
        tms_core_backup_release(b);
        return NULL;
    }
    keeper->backup = b;
    return PyObject_CallFunction(st->make_view, "NnN", PyLong_FromVoidPtr((char *)tms_core_backup_bytes(b) + offset), nbytes,
                                 (PyObject *)keeper);
}

/* ---- introspection ----------------------------------------------------------- */

/* A Python list with one dict per C row; NULL with an exception set if a dict fails. */
static PyObject *list_of_dicts(const void *rows, size_t n, size_t row_size, PyObject *(*to_dict)(const void *))
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

PyDoc_STRVAR(allocations_doc,
"allocations($module, /)\n--\n\nA list of dicts, one per allocation the core holds.");

static const char *state_name(int state)
{
    switch (state) {
    case TMS_ACTIVE: return "active";
    case TMS_PAUSED: return "paused";
    case TMS_PAUSING: return "pausing";
    case TMS_RESUMING: return "resuming";
    }
    return "?";
}

static PyObject *alloc_row_dict(const void *row)
{
    const struct tms_alloc_info *r = row;
    int disk = r->backup_to_file;
    return Py_BuildValue(
        "{s:K,s:n,s:n,s:i,s:s,s:s,s:O,s:s,s:O,s:O,s:O,s:i,s:O,s:O,s:n,s:n}", "ptr", (unsigned long long)r->ptr, "size",
        (Py_ssize_t)r->size, "reserved", (Py_ssize_t)r->reserved, "device", r->device, "tag",
        tms_core_tag_name(r->tag_id), "state", state_name(r->state), "cpu_backup",
        r->backup && !disk ? Py_True : Py_False, "cpu_backup_backend", tms_core_backup_kind_name(r->backup_kind),
        "has_cpu_backup", r->has_host_copy && !disk ? Py_True : Py_False, "disk_backup", disk ? Py_True : Py_False,
        "has_disk_backup", r->has_host_copy && disk ? Py_True : Py_False, "chunks", r->n_chunks, "adopted",
        r->adopted ? Py_True : Py_False, "cpu_backup_page_locked", r->host_copy_pinned ? Py_True : Py_False,
        "backup_bytes", (Py_ssize_t)r->backup_bytes, "skipped_bytes", (Py_ssize_t)r->skipped_bytes);
}

static PyObject *py_allocations(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    struct tms_alloc_info *rows = NULL;
    size_t n = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_list(&rows, &n, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    PyObject *list = list_of_dicts(rows, n, sizeof *rows, alloc_row_dict);
    free(rows);
    return list;
}

PyDoc_STRVAR(allocation_at_doc,
"allocation_at($module, ptr, /)\n--\n\nThe allocations() row of the allocation holding ptr, or None.");

static PyObject *py_allocation_at(PyObject *module, PyObject *ptr_obj)
{
    (void)module;
    unsigned long long ptr = PyLong_AsUnsignedLongLong(ptr_obj);
    if (ptr == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "allocation_at: pointer %R is not a 64-bit address", ptr_obj);
    }
    struct tms_alloc_info row;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_find(ptr, &row);
    Py_END_ALLOW_THREADS
    if (rc) Py_RETURN_NONE;
    return alloc_row_dict(&row);
}

PyDoc_STRVAR(stats_doc,
"stats($module, /)\n--\n\n"
"A list of dicts, one per (tag, device) with anything to report: the fields of\n"
"src/stats.h. Reads counters only: cheap enough for every step.");

static PyObject *stats_row_dict(const void *row)
{
    const struct tms_stats_row *r = row;
    PyObject *d = Py_BuildValue("{s:s,s:i}", "tag", tms_core_tag_name(r->tag_id), "device", r->device);
#define TMS_STAT_ITEM(name, kind, doc)                                                        \
    if (d) {                                                                                  \
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)r->stats.name);         \
        if (!v || PyDict_SetItemString(d, #name, v) < 0) Py_CLEAR(d);                         \
        Py_XDECREF(v);                                                                        \
    }
    TMS_STAT_FIELDS(TMS_STAT_ITEM)
#undef TMS_STAT_ITEM
    return d;
}

static PyObject *py_stats(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    struct tms_stats_row *rows = NULL;
    size_t n = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_stats(&rows, &n, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    PyObject *list = list_of_dicts(rows, n, sizeof *rows, stats_row_dict);
    free(rows);
    return list;
}

PyDoc_STRVAR(set_margin_doc, "set_memory_margin_bytes($module, n, /)\n--\n\nAllocations fail with OOM if they would leave fewer than n bytes free.");

static PyObject *py_set_margin(PyObject *module, PyObject *arg)
{
    (void)module;
    if (!PyLong_Check(arg))
        return type_error("memory_margin_bytes", "an int", arg);
    if (PyObject_RichCompareBool(arg, Py_False, Py_LT) == 1)
        return PyErr_Format(PyExc_ValueError, "memory_margin_bytes must be >= 0, got %R", arg);
    size_t n = PyLong_AsSize_t(arg);
    if (n == (size_t)-1 && PyErr_Occurred()) return NULL;
    tms_core_set_margin(n);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(get_margin_doc, "get_memory_margin_bytes($module, /)\n--\n\n");
static PyObject *py_get_margin(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyLong_FromSize_t(tms_core_margin());
}

PyDoc_STRVAR(set_retain_doc, "set_retain_cpu_backup($module, retain, /)\n--\n\nKeep host backups across resume.");
static PyObject *py_set_retain(PyObject *module, PyObject *arg)
{
    (void)module;
    int v = PyObject_IsTrue(arg);
    if (v < 0) return NULL;
    tms_core_set_retain(v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(get_retain_doc, "get_retain_cpu_backup($module, /)\n--\n\n");
static PyObject *py_get_retain(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(tms_core_retain());
}

PyDoc_STRVAR(set_spill_doc, "set_spill_to_disk($module, spill, /)\n--\n\nBackups past the host budget go to disk.");
static PyObject *py_set_spill(PyObject *module, PyObject *arg)
{
    (void)module;
    int v = PyObject_IsTrue(arg);
    if (v < 0) return NULL;
    tms_core_set_spill(v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(get_spill_doc, "get_spill_to_disk($module, /)\n--\n\n");
static PyObject *py_get_spill(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(tms_core_spill());
}

PyDoc_STRVAR(host_budget_doc,
"host_budget($module, /)\n--\n\n"
"The host backup budget: {'name', 'limit' (0: none), 'reserved' (every process of the ledger),\n"
"'mine' (this process), 'free', 'mem_total', 'mem_available', 'safety', 'spill_to_disk'}.");
static PyObject *py_host_budget(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_host_budget info;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_host_budget(&info, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    size_t free_bytes = info.limit > info.reserved ? info.limit - info.reserved : 0;
    return Py_BuildValue("{s:s,s:n,s:n,s:n,s:n,s:n,s:n,s:O,s:O}", "name", info.name, "limit", (Py_ssize_t)info.limit,
                         "reserved", (Py_ssize_t)info.reserved, "mine", (Py_ssize_t)info.mine, "free",
                         (Py_ssize_t)free_bytes, "mem_total", (Py_ssize_t)info.mem_total, "mem_available",
                         (Py_ssize_t)info.mem_available, "safety", info.safety ? Py_True : Py_False,
                         "spill_to_disk", tms_core_spill() ? Py_True : Py_False);
}

PyDoc_STRVAR(use_backend_doc, "use_backend($module, name, /)\n--\n\nChoose 'cuda', 'hip' or 'host' before first use.");
static PyObject *py_use_backend(PyObject *module, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, NULL) : NULL;
    if (!name && !PyErr_Occurred()) return type_error("use_backend: name", "a str", arg);
    if (!name) return NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* the driver lock is held while a backend loads */
    rc = tms_core_use_backend(name, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(backend_doc, "backend($module, /)\n--\n\nLoad the backend if needed and return its name.");
static PyObject *py_backend(PyObject *module, PyObject *unused)
{
    (void)unused;
    const char *name = NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_backend(&name, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    return PyUnicode_FromString(name);
}

PyDoc_STRVAR(warm_backups_doc,
"warm_backups($module, /)\n--\n\n"
"Start the copy workers and pin their staging buffers now rather than in the\n"
"first backed-up pause.");
static PyObject *py_warm_backups(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_warm_backups(&err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_progress_doc,
"copy_progress($module, /)\n--\n\n(bytes done, bytes total) of the backup copy running now (or the last one).");
static PyObject *py_copy_progress(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    size_t done, total;
    tms_core_copy_progress(&done, &total);
    return Py_BuildValue("(nn)", (Py_ssize_t)done, (Py_ssize_t)total);
}

PyDoc_STRVAR(set_platform_hint_doc,
"set_platform_hint($module, platform, /)\n--\n\n"
"The platform PyTorch was built for ('cuda' or 'hip'; None: unknown): the backend\n"
"chosen when TMS_BACKEND and TMS_PLATFORM say nothing.");
static PyObject *py_set_platform_hint(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *platform = NULL;
    if (arg != Py_None && !(platform = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, NULL) : NULL)) {
        if (!PyErr_Occurred()) return type_error("set_platform_hint: platform", "a str or None", arg);
        return NULL;
    }
    tms_core_set_platform_hint(platform);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(loaded_backend_doc, "loaded_backend($module, /)\n--\n\nName of the loaded backend, or None.");
static PyObject *py_loaded_backend(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const char *name = tms_core_loaded_backend();
    if (!name) Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

PyDoc_STRVAR(device_active_doc,
"device_active($module, device, /)\n--\n\n"
"True if the process already uses the device (its primary context is active); asking creates nothing there.");
static PyObject *py_device_active(PyObject *module, PyObject *args)
{
    int device, active = 0;
    if (!PyArg_ParseTuple(args, "i:device_active", &device)) return NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_device_active(device, &active, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    return PyBool_FromLong(active);
}

PyDoc_STRVAR(mem_get_info_doc,
"mem_get_info($module, device, /)\n--\n\n"
"(free bytes, total bytes) of a device, as the backend reports them (loads it).");
static PyObject *py_mem_get_info(PyObject *module, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i:mem_get_info", &device)) return NULL;
    if (device < 0) return PyErr_Format(PyExc_ValueError, "torch_memory_saver: device must be >= 0, got %d", device);
    struct tms_err err = {0};
    size_t free_bytes = 0, total = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_mem_get_info(device, &free_bytes, &total, &err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    return Py_BuildValue("(nn)", (Py_ssize_t)free_bytes, (Py_ssize_t)total);
}

#if TMS_VARIANT_IS_PRELOAD
PyDoc_STRVAR(preload_active_doc,
"preload_active($module, /)\n--\n\n"
"(active, winner): active is True if this library's cudaMalloc is the one the\n"
"process uses (loaded through LD_PRELOAD); winner is the path of the library\n"
"whose cudaMalloc the process resolves, or None.");
static PyObject *py_preload_active(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const char *winner = NULL;
    int active = tms_preload_active(&winner);
    if (!winner) return Py_BuildValue("(NO)", PyBool_FromLong(active), Py_None);
    return Py_BuildValue("(Ns)", PyBool_FromLong(active), winner);
}

PyDoc_STRVAR(install_relocation_hooks_doc,
"install_relocation_hooks($module, /)\n--\n\n"
"Point every loaded object's GOT entries for cudaMalloc/cudaFree (hipMalloc/hipFree)\n"
"at this library's hooks, and those of objects loaded later (through dlopen): preload\n"
"mode without LD_PRELOAD. Idempotent. NotImplementedError if TMS_RELOC_HOOKS=0.");
static PyObject *py_install_relocation_hooks(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* walks every object's relocations */
    rc = tms_preload_install_relocation(&err);
    Py_END_ALLOW_THREADS
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(relocation_report_doc,
"relocation_report($module, /)\n--\n\n"
"(patched, static_runtime): the objects whose GOT entries were patched, and those that\n"
"define cudaMalloc themselves (a statically linked runtime, not hookable by relocation).");
static PyObject *py_relocation_report(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    char patched[8192], statics[4096];
    tms_preload_relocation_report(patched, sizeof patched, statics, sizeof statics);
    return Py_BuildValue("(ss)", patched, statics);
}

PyDoc_STRVAR(preload_method_doc,
"preload_method($module, /)\n--\n\n"
"How this process's allocations reach the hooks: 'ld_preload', 'relocation', or None.");
static PyObject *py_preload_method(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const char *method = tms_preload_method();
    if (!method) Py_RETURN_NONE;
    return PyUnicode_FromString(method);
}
#endif

PyDoc_STRVAR(library_path_doc, "library_path($module, /)\n--\n\nPath of this shared library.");
static PyObject *py_library_path(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    Dl_info info;
    if (!dladdr((void *)py_library_path, &info) || !info.dli_fname)
        return PyErr_Format(PyExc_OSError, "dladdr cannot name the library holding " TMS_MODULE_NAME);
    return PyUnicode_DecodeFSDefault(info.dli_fname);
}

PyDoc_STRVAR(last_hook_error_doc, "last_hook_error($module, /)\n--\n\nMessage of this thread's last failed hook call.");
static PyObject *py_last_hook_error(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyUnicode_FromString(tms_core_last_error());
}

PyDoc_STRVAR(defaults_doc, "defaults($module, /)\n--\n\nProcess defaults read from TMS_* environment variables.");
static PyObject *py_defaults(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    struct tms_core_defaults defaults, *d = &defaults;
    tms_core_defaults(d);
    return Py_BuildValue("{s:O,s:O,s:s,s:O,s:O,s:n,s:n,s:O,s:O,s:O}", "init_enable", d->init_enable ? Py_True : Py_False,
                         "init_enable_cpu_backup", d->init_backup ? Py_True : Py_False,
                         "init_cpu_backup_backend", tms_core_backup_kind_name(d->init_backup_kind),
                         "init_enable_disk_backup", d->init_disk_backup ? Py_True : Py_False,
                         "retain_cpu_backup", d->retain_backup ? Py_True : Py_False, "chunk_bytes",
                         (Py_ssize_t)d->chunk_bytes, "disk_backup_chunk_bytes", (Py_ssize_t)d->disk_block_bytes,
                         "progress", d->progress ? Py_True : Py_False, "backup_live_only",
                         d->backup_live_only ? Py_True : Py_False, "spill_to_disk", d->spill_to_disk ? Py_True : Py_False);
}

PyDoc_STRVAR(set_disk_backup_dir_doc,
"set_disk_backup_dir($module, path, /)\n--\n\n"
"Make path (created if missing) the process's directory for backup files; files left\n"
"there by dead processes are removed.");
static PyObject *py_set_disk_backup_dir(PyObject *module, PyObject *arg)
{
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(arg, &bytes)) return NULL;
    const char *path = PyBytes_AsString(bytes);
    struct tms_err err = {0};
    int rc = TMS_E_ARG;
    if (path && strlen(path) != (size_t)PyBytes_Size(bytes)) {
        tms_fail(&err, TMS_E_ARG, 0, "disk backup directory contains a null character");
    } else if (path) {
        Py_BEGIN_ALLOW_THREADS  /* mkdir, locks and a directory sweep */
        rc = tms_core_set_disk_dir(path, &err);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(bytes);
    if (!path) return NULL;
    if (rc) return raise_err(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(disk_backup_dir_doc, "disk_backup_dir($module, /)\n--\n\nThe directory backup files are created in now.");
static PyObject *py_disk_backup_dir(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    char dir[4096];
    Py_BEGIN_ALLOW_THREADS
    tms_core_disk_dir(dir, sizeof dir);
    Py_END_ALLOW_THREADS
    return PyUnicode_DecodeFSDefault(dir);
}

static PyMethodDef module_methods[] = {
    {"set_region", py_set_region, METH_VARARGS, set_region_doc},
    {"check_region", py_check_region, METH_VARARGS, check_region_doc},
    {"check_tags", py_check_tags, METH_VARARGS, check_tags_doc},
    {"set_platform_hint", py_set_platform_hint, METH_O, set_platform_hint_doc},
    {"get_region", py_get_region, METH_NOARGS, get_region_doc},
    {"pause", py_pause, METH_VARARGS, pause_doc},
    {"selects_backup", py_selects_backup, METH_O, selects_backup_doc},
    {"resume", py_resume, METH_O, resume_doc},
    {"malloc", py_malloc, METH_VARARGS, malloc_doc},
    {"free", py_free, METH_O, free_doc},
    {"get_cpu_backup", py_get_cpu_backup, METH_VARARGS, get_cpu_backup_doc},
    {"allocations", py_allocations, METH_NOARGS, allocations_doc},
    {"allocation_at", py_allocation_at, METH_O, allocation_at_doc},
    {"stats", py_stats, METH_NOARGS, stats_doc},
    {"set_memory_margin_bytes", py_set_margin, METH_O, set_margin_doc},
    {"get_memory_margin_bytes", py_get_margin, METH_NOARGS, get_margin_doc},
    {"set_retain_cpu_backup", py_set_retain, METH_O, set_retain_doc},
    {"get_retain_cpu_backup", py_get_retain, METH_NOARGS, get_retain_doc},
    {"set_spill_to_disk", py_set_spill, METH_O, set_spill_doc},
    {"get_spill_to_disk", py_get_spill, METH_NOARGS, get_spill_doc},
    {"host_budget", py_host_budget, METH_NOARGS, host_budget_doc},
    {"use_backend", py_use_backend, METH_O, use_backend_doc},
    {"backend", py_backend, METH_NOARGS, backend_doc},
    {"loaded_backend", py_loaded_backend, METH_NOARGS, loaded_backend_doc},
    {"warm_backups", py_warm_backups, METH_NOARGS, warm_backups_doc},
    {"copy_progress", py_copy_progress, METH_NOARGS, copy_progress_doc},
    {"mem_get_info", py_mem_get_info, METH_VARARGS, mem_get_info_doc},
    {"device_active", py_device_active, METH_VARARGS, device_active_doc},
#if TMS_VARIANT_IS_PRELOAD
    {"preload_active", py_preload_active, METH_NOARGS, preload_active_doc},
    {"install_relocation_hooks", py_install_relocation_hooks, METH_NOARGS, install_relocation_hooks_doc},
    {"relocation_report", py_relocation_report, METH_NOARGS, relocation_report_doc},
    {"preload_method", py_preload_method, METH_NOARGS, preload_method_doc},
#endif
    {"library_path", py_library_path, METH_NOARGS, library_path_doc},
    {"last_hook_error", py_last_hook_error, METH_NOARGS, last_hook_error_doc},
    {"defaults", py_defaults, METH_NOARGS, defaults_doc},
    {"set_disk_backup_dir", py_set_disk_backup_dir, METH_O, set_disk_backup_dir_doc},
    {"disk_backup_dir", py_disk_backup_dir, METH_NOARGS, disk_backup_dir_doc},
    {NULL, NULL, 0, NULL},
};

/* The package's own classes (torch_memory_saver/_errors.py), so both variants
 * raise the same torch_memory_saver.Error. A variant loaded outside the
 * package (a C build's test) makes classes of its own. */
static int import_error_types(module_state *st)
{
    PyObject *errors = PyImport_ImportModule("torch_memory_saver._errors");
    if (errors) {
        st->error = PyObject_GetAttrString(errors, "Error");
        st->oom_error = st->error ? PyObject_GetAttrString(errors, "OutOfMemoryError") : NULL;
        Py_DECREF(errors);
        return st->oom_error ? 0 : -1;
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
    return st->oom_error ? 0 : -1;
}

static int module_exec(PyObject *module)
{
    struct tms_err env_err = {0};
    if (tms_core_env_check(&env_err)) {
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s", env_err.msg);
        return -1;
    }
    module_state *st = state_of(module);
    if (import_error_types(st) < 0) return -1;
    st->view_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &view_spec, NULL);
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
    if (PyModule_AddObjectRef(module, "Error", st->error) < 0) return -1;
    if (PyModule_AddObjectRef(module, "OutOfMemoryError", st->oom_error) < 0) return -1;
    if (PyModule_AddObjectRef(module, "BackupView", (PyObject *)st->view_type) < 0) return -1;
    if (PyModule_AddStringConstant(module, "VARIANT", TMS_STR(TMS_VARIANT)) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *st = state_of(module);
    Py_VISIT(st->error);
    Py_VISIT(st->oom_error);
    Py_VISIT(st->view_type);
    Py_VISIT(st->make_view);
    return 0;
}

static int module_clear(PyObject *module)
{
    module_state *st = state_of(module);
    Py_CLEAR(st->error);
    Py_CLEAR(st->oom_error);
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
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

TMS_EXPORT PyObject *TMS_CAT(PyInit__tms_, TMS_VARIANT)(void) { return PyModuleDef_Init(&module_def); }
