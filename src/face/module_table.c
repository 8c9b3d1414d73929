/* The CPython face's reading of the core: allocations, statistics, and host backups as Python buffers. */
#include "face/module.h"

#include <stdlib.h>

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

PyType_Spec tms_py_view_spec = {
    .name = "torch_memory_saver." TMS_MODULE_NAME ".BackupView",
    .basicsize = sizeof(backup_keeper),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = view_slots,
};

PyDoc_STRVAR(get_cpu_backup_doc,
"get_cpu_backup($module, ptr, nbytes, zero_copy=True, copy_out=False, /)\n--\n\n"
"A memoryview of the host backup of [ptr, ptr+nbytes), or None if the allocation\n"
"holding ptr has no host copy now. The view keeps the bytes alive. zero_copy: it is\n"
"writable (False: read-only). Its bytes can be written through it all the same, so the\n"
"backup's fingerprints are trusted no more (unchanged memory is not found by comparing\n"
"with it, and a resume restores it unchecked), but where copy_out says the caller only\n"
"copies out of it at once and drops it (the package's get_cpu_backup).");

static PyObject *py_get_cpu_backup(PyObject *module, PyObject *args)
{
    PyObject *ptr_obj;
    Py_ssize_t nbytes;
    int zero_copy = 1, copy_out = 0;
    if (!PyArg_ParseTuple(args, "O!n|pp:get_cpu_backup", &PyLong_Type, &ptr_obj, &nbytes, &zero_copy, &copy_out))
        return NULL;
    unsigned long long ptr = PyLong_AsUnsignedLongLong(ptr_obj);  /* checks sign and range */
    if (ptr == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "get_cpu_backup: pointer %R is not a 64-bit address", ptr_obj);
    }
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "torch_memory_saver: get_cpu_backup: nbytes must be >= 0, got %zd", nbytes);
    struct tms_err err = {0};
    struct tms_backup *b = NULL;
    size_t offset = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* waits while a pause or resume moves that allocation */
    rc = tms_core_backup_of(ptr, (size_t)nbytes, zero_copy || !copy_out, &b, &offset, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    if (!b) Py_RETURN_NONE;
    module_state *st = tms_py_state(module);
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
    return PyObject_CallFunction(st->make_view, "NnNN", PyLong_FromVoidPtr((char *)tms_core_backup_bytes(b) + offset), nbytes,
                                 (PyObject *)keeper, PyBool_FromLong(zero_copy));
}

/* ---- introspection ----------------------------------------------------------- */

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
        "{s:K,s:n,s:n,s:i,s:s,s:s,s:O,s:s,s:O,s:O,s:O,s:i,s:O,s:O,s:n,s:n,s:O,s:s}", "ptr", (unsigned long long)r->ptr, "size",
        (Py_ssize_t)r->size, "reserved", (Py_ssize_t)r->reserved, "device", r->device, "tag",
        tms_core_tag_name(r->tag_id), "state", state_name(r->state), "cpu_backup",
        r->backup && !disk ? Py_True : Py_False, "cpu_backup_backend", tms_core_backup_kind_name(r->backup_kind),
        "has_cpu_backup", r->has_host_copy && !disk ? Py_True : Py_False, "disk_backup", disk ? Py_True : Py_False,
        "has_disk_backup", r->has_host_copy && disk ? Py_True : Py_False, "chunks", r->n_chunks, "adopted",
        r->adopted ? Py_True : Py_False, "cpu_backup_page_locked", r->host_copy_pinned ? Py_True : Py_False,
        "backup_bytes", (Py_ssize_t)r->backup_bytes, "skipped_bytes", (Py_ssize_t)r->skipped_bytes, "wrong_bytes",
        r->wrong_bytes ? Py_True : Py_False, "restore", tms_core_restore_mode_name(r->restore));
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
    if (rc) return tms_py_raise(module, &err);
    PyObject *list = tms_py_list_of_dicts(rows, n, sizeof *rows, alloc_row_dict);
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
"src/core/stats.h. Reads counters only: cheap enough for every step.");

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
    if (rc) return tms_py_raise(module, &err);
    PyObject *list = tms_py_list_of_dicts(rows, n, sizeof *rows, stats_row_dict);
    free(rows);
    return list;
}

/* ---- fingerprints, for tests ------------------------------------------------------ */

static PyObject *fingerprints_list(uint64_t (*fp)[4], size_t n)
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *row = Py_BuildValue("(KKKK)", (unsigned long long)fp[i][0], (unsigned long long)fp[i][1],
                                      (unsigned long long)fp[i][2], (unsigned long long)fp[i][3]);
        if (!row || PyList_SetItem(list, (Py_ssize_t)i, row) < 0) Py_CLEAR(list);  /* steals row */
    }
    return list;
}

PyDoc_STRVAR(fingerprint_doc,
"fingerprint($module, device, ptr, chunks, /)\n--\n\n"
"The fingerprints (four ints each) of the chunks of 2 MiB from ptr on device, computed\n"
"as a pause that skips unchanged memory computes them (on the GPU where it can).");
static PyObject *py_fingerprint(PyObject *module, PyObject *args)
{
    int device;
    unsigned long long ptr;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKn:fingerprint", &device, &ptr, &n)) return NULL;
    if (n < 0 || (size_t)n > ((size_t)1 << 30))
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: fingerprint: chunks must be 0 to 2**30, got %zd", n);
    uint64_t (*out)[4] = PyMem_Calloc(n ? (size_t)n : 1, sizeof *out);
    if (!out) return PyErr_NoMemory();
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_fingerprint(device, ptr, (size_t)n, out, &err);
    Py_END_ALLOW_THREADS
    PyObject *list = rc ? tms_py_raise(module, &err) : fingerprints_list(out, (size_t)n);
    PyMem_Free(out);
    return list;
}

PyDoc_STRVAR(fingerprint_bytes_doc,
"fingerprint_bytes($module, data, chunk_bytes, key=None, /)\n--\n\n"
"The fingerprints of each chunk of data (bytes) on the CPU, under the process's key or\n"
"key (bytes: 4 x 256 uint32 NH words, then 4 uint64 points, native order).");
static PyObject *py_fingerprint_bytes(PyObject *module, PyObject *args)
{
    PyObject *data, *key = Py_None;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "O!n|O:fingerprint_bytes", &PyBytes_Type, &data, &chunk, &key)) return NULL;
    if (key != Py_None && (!PyBytes_Check(key) || PyBytes_Size(key) != 4 * 256 * 4 + 4 * 8))
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: fingerprint_bytes: key must be %d bytes or None",
                            4 * 256 * 4 + 4 * 8);
    Py_ssize_t len = PyBytes_Size(data);
    if (chunk <= 0 || len % chunk)
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: fingerprint_bytes: %zd bytes are not whole chunks "
                            "of %zd", len, chunk);
    size_t n = (size_t)(len / chunk);
    uint64_t (*out)[4] = PyMem_Calloc(n ? n : 1, sizeof *out);
    if (!out) return PyErr_NoMemory();
    struct tms_err err = {0};
    int rc = tms_core_fingerprint_bytes(PyBytes_AsString(data), (size_t)len, (size_t)chunk,
                                        key == Py_None ? NULL : PyBytes_AsString(key), out, &err);
    PyObject *list = rc ? tms_py_raise(module, &err) : fingerprints_list(out, n);
    PyMem_Free(out);
    return list;
}

PyMethodDef tms_py_table_methods[] = {
    {"get_cpu_backup", py_get_cpu_backup, METH_VARARGS, get_cpu_backup_doc},
    {"fingerprint", py_fingerprint, METH_VARARGS, fingerprint_doc},
    {"fingerprint_bytes", py_fingerprint_bytes, METH_VARARGS, fingerprint_bytes_doc},
    {"allocations", py_allocations, METH_NOARGS, allocations_doc},
    {"allocation_at", py_allocation_at, METH_O, allocation_at_doc},
    {"stats", py_stats, METH_NOARGS, stats_doc},
    {NULL, NULL, 0, NULL},
};
