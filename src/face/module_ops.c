/* The CPython face's operations: a thread's region, pause and resume with their reports, direct allocation. */
#include "face/module.h"

#include <limits.h>
#include <string.h>

/* ---- region settings (thread-local in C) ----------------------------------- */

PyDoc_STRVAR(set_region_doc,
"set_region($module, active, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup=False,\n"
"           skip_unchanged=None, restore=None, /)\n--\n\n"
"Set the calling thread's region: allocations it makes while active are pauseable\n"
"(backed up to a file each when enable_disk_backup, which wins over enable_cpu_backup);\n"
"skip_unchanged: their pauses copy only what changed (None: the process's setting);\n"
"restore: what those paused without backup hold after resume, 'none', 'zero' or 'poison'\n"
"(None: TMS_RESTORE).");

static PyObject *py_set_region(PyObject *module, PyObject *args)
{
    int active, backup, disk = 0, skip = -1, restore = -1;
    PyObject *tag_obj, *skip_obj = Py_None, *restore_obj = Py_None;
    const char *kind_name;
    if (!PyArg_ParseTuple(args, "pOps|pOO:set_region", &active, &tag_obj, &backup, &kind_name, &disk, &skip_obj,
                          &restore_obj))
        return NULL;
    if (skip_obj != Py_None && !PyBool_Check(skip_obj))
        return tms_py_type_error("set_region: skip_unchanged", "a bool or None", skip_obj);
    if (skip_obj != Py_None) skip = skip_obj == Py_True;
    if (restore_obj != Py_None && !PyUnicode_Check(restore_obj))
        return tms_py_type_error("region(restore=...)", "a str or None", restore_obj);
    Py_ssize_t restore_len = 0;
    const char *restore_text = restore_obj != Py_None ? PyUnicode_AsUTF8AndSize(restore_obj, &restore_len) : NULL;
    if (restore_obj != Py_None && (!restore_text || (size_t)restore_len != strlen(restore_text) ||
                                   tms_core_restore_mode_parse(restore_text, &restore))) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "torch_memory_saver: region(restore=%R) must be 'none', 'zero' or 'poison'",
                         restore_obj);
        return NULL;
    }
    const char *tag = tms_py_tag_bytes(tag_obj, "set_region: tag");
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
    if (rc) return tms_py_raise(module, &err);
    tms_core_region_set_skip_unchanged(skip);
    tms_core_region_set_restore(restore);
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
    const char *tag = tms_py_tag_bytes(tag_obj, "tag");
    if (!tag) return NULL;
    const char *backend = NULL;
    if (backend_obj != Py_None && !(backend = tms_py_tag_bytes(backend_obj, "cpu_backup_backend"))) return NULL;
    struct tms_region_request req = {.tag = tag, .cpu_backup = backup, .backend = backend, .disk_backup = disk};
    struct tms_err err = {0};
    int kind = 0;
    if (tms_core_check_region(&req, &kind, &err)) return tms_py_raise(module, &err);
    return PyUnicode_FromString(tms_core_backup_kind_name(kind));
}

PyDoc_STRVAR(get_region_doc,
"get_region($module, /)\n--\n\n"
"The calling thread's region as (active, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup,\n"
"skip_unchanged, restore), skip_unchanged None where the process's setting decides, restore None where\n"
"TMS_RESTORE does.");

static PyObject *py_get_region(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const struct tms_region *r = tms_core_region();
    PyObject *skip = r->skip_unchanged < 0 ? Py_None : r->skip_unchanged ? Py_True : Py_False;
    Py_INCREF(skip);
    PyObject *restore = r->restore < 0 ? Py_NewRef(Py_None) : PyUnicode_FromString(tms_core_restore_mode_name(r->restore));
    return Py_BuildValue("(NsNsNNN)", PyBool_FromLong(r->active), tms_core_tag_name(r->tag_id),
                         PyBool_FromLong(r->backup), tms_core_backup_kind_name(r->backup_kind),
                         PyBool_FromLong(r->disk_backup), skip, restore);
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
    if (arg != Py_None && !PyUnicode_Check(arg) && !list) return tms_py_type_error(what, "a str, a list of str or None", arg), -1;
    if (arg == Py_None) return *seq = NULL, 0;
    /* A tuple: a list may change under us once the GIL goes. */
    if (!(*seq = list ? PySequence_Tuple(arg) : PyTuple_Pack(1, arg))) return -1;
    *n = PyTuple_Size(*seq);
    if (!(*tags = PyMem_Calloc(*n ? (size_t)*n : 1, sizeof **tags))) return PyErr_NoMemory(), -1;
    if (list) snprintf(what, sizeof what, "%s: tag in the list", name);
    for (Py_ssize_t i = 0; i < *n; i++)
        if (!((*tags)[i] = tms_py_tag_bytes(PyTuple_GetItem(*seq, i), what))) return -1;
    return 0;
}

/* The skip argument of pause: None, or bytes of (start, length) pairs of
 * native uint64, sorted and disjoint (the core checks). -1 with an exception. */
static int skip_of(PyObject *arg, struct tms_free_span **spans, size_t *n)
{
    *spans = NULL, *n = 0;
    if (arg == Py_None) return 0;
    if (!PyBytes_Check(arg)) return tms_py_type_error("pause: skip", "bytes of (start, length) uint64 pairs or None", arg), -1;
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

/* The driver's free memory around a call, or None where it was not measured. */
static PyObject *free_bytes(int measured, size_t n)
{
    if (measured) return PyLong_FromSize_t(n);
    Py_RETURN_NONE;
}

/* Why the driver made memory the job's members were asked for, in words;
 * None: they were not asked, or lent all of it. */
static const char *fallback_name(int fallback)
{
    switch (fallback) {
    case TMS_JOB_NO_MEMBER: return "no member";
    case TMS_JOB_TIMED_OUT: return "member timed out";
    case TMS_JOB_NOTHING_TO_LEND: return "nothing to lend";
    case TMS_JOB_BAD_LEND: return "bad lend";
    default: return NULL;
    }
}

/* {pid: bytes} of the first lenders, and [pid] of the first members that timed out. */
static PyObject *lenders_dict(const struct tms_op_device *d)
{
    PyObject *out = PyDict_New();
    for (int i = 0; out && i < d->lenders && i < TMS_REPORT_PIDS; i++) {
        PyObject *pid = PyLong_FromLong(d->lender_pids[i]), *bytes = PyLong_FromSize_t(d->lender_bytes[i]);
        int bad = !pid || !bytes || PyDict_SetItem(out, pid, bytes) < 0;
        Py_XDECREF(pid);
        Py_XDECREF(bytes);
        if (bad) Py_CLEAR(out);
    }
    return out;
}

static PyObject *timed_out_list(const struct tms_op_device *d)
{
    int shown = d->timed_out < TMS_REPORT_PIDS ? d->timed_out : TMS_REPORT_PIDS;
    PyObject *out = PyList_New(shown);
    for (int i = 0; out && i < shown; i++) {
        PyObject *pid = PyLong_FromLong(d->timed_out_pids[i]);
        if (!pid || PyList_SetItem(out, i, pid) < 0) Py_CLEAR(out);  /* steals pid */
    }
    return out;
}

/* Sets d[key] = value, dropping the reference to value; -1 with an exception set. */
static int set_item(PyObject *d, const char *key, PyObject *value)
{
    int rc = value ? PyDict_SetItemString(d, key, value) : -1;
    Py_XDECREF(value);
    return rc;
}

static PyObject *device_report_dict(const void *row)
{
    const struct tms_op_device *d = row;
    PyObject *out = PyDict_New();
    int bad = !out || set_item(out, "device", PyLong_FromLong(d->device)) ||
              set_item(out, "allocations", PyLong_FromSize_t(d->allocations));
#define TMS_REPORT_ITEM(field, name, doc) bad = bad || set_item(out, name, PyLong_FromSize_t(d->field));
    TMS_REPORT_BYTES(TMS_REPORT_ITEM)
#undef TMS_REPORT_ITEM
    const char *fallback = fallback_name(d->fallback);
    bad = bad || set_item(out, "free_before", free_bytes(d->free_measured, d->free_before)) ||
          set_item(out, "free_after", free_bytes(d->free_measured, d->free_after)) ||
          set_item(out, "lenders", lenders_dict(d)) ||
          set_item(out, "fallback", fallback ? PyUnicode_FromString(fallback) : Py_NewRef(Py_None)) ||
          set_item(out, "timed_out", timed_out_list(d));
    if (bad) Py_CLEAR(out);
    return out;
}

static PyObject *unconfirmed_dict(const void *row)
{
    const struct tms_op_unconfirmed *u = row;
    int shown = u->receivers < TMS_REPORT_PIDS ? u->receivers : TMS_REPORT_PIDS;
    PyObject *pids = PyList_New(shown);
    for (int i = 0; pids && i < shown; i++) {
        PyObject *pid = PyLong_FromSize_t(u->pids[i] > 0 ? (size_t)u->pids[i] : 0);
        if (!pid || PyList_SetItem(pids, i, pid) < 0) Py_CLEAR(pids);  /* steals pid */
    }
    return pids ? Py_BuildValue("{s:K,s:n,s:i,s:s,s:i,s:N}", "ptr", (unsigned long long)u->va, "bytes",
                                (Py_ssize_t)u->reserved, "device", u->device, "tag", u->tag, "receivers",
                                u->receivers, "pids", pids)
                : NULL;
}

static PyObject *report_dict(const struct tms_op_report *r)
{
    size_t listed = r->n_unconfirmed < TMS_REPORT_UNCONFIRMED ? r->n_unconfirmed : TMS_REPORT_UNCONFIRMED;
    PyObject *devices = tms_py_list_of_dicts(r->devices, r->n_devices, sizeof *r->devices, device_report_dict);
    PyObject *unconfirmed = devices ? tms_py_list_of_dicts(r->unconfirmed, listed, sizeof *r->unconfirmed,
                                                           unconfirmed_dict)
                                    : NULL;
    if (!unconfirmed) {
        Py_XDECREF(devices);
        return NULL;
    }
    size_t shown = r->n_wrong < TMS_REPORT_PIDS ? r->n_wrong : TMS_REPORT_PIDS;
    PyObject *wrong = PyList_New((Py_ssize_t)shown);
    for (size_t i = 0; wrong && i < shown; i++) {
        PyObject *ptr = PyLong_FromUnsignedLongLong(r->wrong[i]);
        if (!ptr || PyList_SetItem(wrong, (Py_ssize_t)i, ptr) < 0) Py_CLEAR(wrong);  /* steals ptr */
    }
    if (!wrong) {
        Py_DECREF(devices);
        Py_DECREF(unconfirmed);
        return NULL;
    }
    return Py_BuildValue("{s:K,s:N,s:N,s:K,s:K,s:s,s:s,s:N}", "ns", (unsigned long long)r->ns, "devices", devices,
                         "unconfirmed", unconfirmed, "fingerprint_ns", (unsigned long long)r->fingerprint_ns,
                         "verify_ns", (unsigned long long)r->verify_ns, "why_not_skipped", r->why_not_skipped,
                         "why_not_verified", r->why_not_verified, "wrong_bytes", wrong);
}

/* What a pause may leave out: skip as skip_of takes it, or a callable returning
 * that, called (with the GIL) only if the pause would back something up. */
static int skip_for(PyObject *arg, const char *const *tags, size_t n_tags, struct tms_free_span **spans, size_t *n)
{
    if (!PyCallable_Check(arg)) return skip_of(arg, spans, n);
    int backs_up;
    Py_BEGIN_ALLOW_THREADS
    backs_up = tms_core_selects_backup(tags, n_tags);
    Py_END_ALLOW_THREADS
    *spans = NULL, *n = 0;
    if (!backs_up) return 0;
    PyObject *got = PyObject_CallObject(arg, NULL);
    if (!got) return -1;
    int rc = skip_of(got, spans, n);
    Py_DECREF(got);
    return rc;
}

/* A failed call's report (what it did before it failed: allocations it left
 * holding wrong bytes among it) as the raised exception's report_raw. */
static void attach_report(const struct tms_op_report *report)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *raw = value ? report_dict(report) : NULL;
    if (!raw || PyObject_SetAttrString(value, "report_raw", raw) < 0) PyErr_Clear();  /* the error itself goes on */
    Py_XDECREF(raw);
    PyErr_Restore(type, value, tb);
}

/* tag: None (every tag), a str, or a list or tuple of them (all or nothing).
 * The tags are checked, the skip asked for, and the call made in one go.
 * Returns what the call did (report_dict). */
static PyObject *run_tag_op(PyObject *module, PyObject *arg, PyObject *skip_arg, int measure_free, int pause,
                            const char *name)
{
    PyObject *seq = NULL;
    const char **tags = NULL;
    Py_ssize_t n = 0;
    struct tms_err err = {0};
    struct tms_op_report report = {0};
    struct tms_op_args args = {.report = &report, .measure_free = measure_free};
    struct tms_free_span *skip = NULL;
    int rc = TMS_OK, list = PyList_Check(arg) || PyTuple_Check(arg);
    size_t n_tags = 0;
    if (tags_of(arg, name, &seq, &tags, &n) < 0) goto fail;
    n_tags = tags ? (size_t)n : 0;
    /* A bad tag is refused before the skip is asked for. */
    if ((list && n && (rc = tms_core_check_tags(name, tags, n_tags, &err))) ||
        (!list && tags && (rc = tms_core_check_tag(tags[0], &err))))
        goto fail;
    if ((!list || n > 0) && skip_for(skip_arg, tags, n_tags, &skip, &args.n_skip) < 0) goto fail;
    args.skip = skip;
    if (!list || n > 0) {  /* an empty list: nothing to do, as a tag with no allocations */
        Py_BEGIN_ALLOW_THREADS
        rc = pause ? tms_core_pause_ex(tags, n_tags, &args, &err) : tms_core_resume_ex(tags, n_tags, &args, &err);
        Py_END_ALLOW_THREADS
    }
fail:
    PyMem_Free(skip);
    PyMem_Free(tags);
    Py_XDECREF(seq);
    if (PyErr_Occurred()) return NULL;
    if (rc) {
        tms_py_raise(module, &err);
        attach_report(&report);
        return NULL;
    }
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
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pause_doc,
"pause($module, tag, skip=None, measure_free=False, /)\n--\n\n"
"Release the memory of tag (None: all tags; a list: all of them or none). skip: bytes of\n"
"native uint64 (start, length) pairs, sorted and disjoint, of device memory whose contents\n"
"need no backup, or a callable returning them (or None), called only if the pause backs\n"
"something up. measure_free: ask the driver for its free memory around the call.\n"
"Returns {'ns', 'devices': [{device, allocations, released, copied, skipped,\n"
"free_before, free_after}], 'unconfirmed': [...]}; free_* are None unless measured.");
static PyObject *py_pause(PyObject *module, PyObject *args)
{
    PyObject *tag, *skip = Py_None;
    int measure_free = 0;
    if (!PyArg_ParseTuple(args, "O|Op:pause", &tag, &skip, &measure_free)) return NULL;
    return run_tag_op(module, tag, skip, measure_free, 1, "pause");
}

PyDoc_STRVAR(resume_doc,
"resume($module, tag, measure_free=False, /)\n--\n\nMap tag's memory back at the same addresses (a list: all of them or none).\n"
"Returns a report as pause does.");
static PyObject *py_resume(PyObject *module, PyObject *args)
{
    PyObject *tag;
    int measure_free = 0;
    if (!PyArg_ParseTuple(args, "O|p:resume", &tag, &measure_free)) return NULL;
    return run_tag_op(module, tag, Py_None, measure_free, 0, "resume");
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
    if (rc) return tms_py_raise(module, &err);
    return PyLong_FromVoidPtr(ptr);
}

PyDoc_STRVAR(free_doc, "free($module, ptr, /)\n--\n\nFree an allocation made by the core (active or paused).");

static PyObject *py_free(PyObject *module, PyObject *arg)
{
    if (!PyLong_Check(arg))
        return tms_py_type_error("free: pointer", "an int", arg);
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
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyMethodDef tms_py_ops_methods[] = {
    {"set_region", py_set_region, METH_VARARGS, set_region_doc},
    {"check_region", py_check_region, METH_VARARGS, check_region_doc},
    {"check_tags", py_check_tags, METH_VARARGS, check_tags_doc},
    {"get_region", py_get_region, METH_NOARGS, get_region_doc},
    {"pause", py_pause, METH_VARARGS, pause_doc},
    {"selects_backup", py_selects_backup, METH_O, selects_backup_doc},
    {"resume", py_resume, METH_VARARGS, resume_doc},
    {"malloc", py_malloc, METH_VARARGS, malloc_doc},
    {"free", py_free, METH_O, free_doc},
    {NULL, NULL, 0, NULL},
};
