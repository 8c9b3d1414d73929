/* The CPython face of sharing: handles for this process's memory, and another process's memory opened from one. */
#include "face/module.h"

#include <stdint.h>

#include "hooks/variant.h"
#include "share/share.h"

PyDoc_STRVAR(share_doc,
"share($module, ptr, /)\n--\n\n"
"(handle, base, size): a 64-byte handle for the allocation holding ptr, for another\n"
"process of this user to open; base and size are the allocation's (the handle maps\n"
"it whole). ValueError if ptr is not this library's memory.");
static PyObject *py_share(PyObject *module, PyObject *args)
{
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K:share", &ptr)) return NULL;
    unsigned char handle[TMS_SHARE_HANDLE_BYTES];
    uint64_t base = 0;
    size_t size = 0;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* the table lock, and the sender's thread starting */
    rc = tms_share_export(ptr, handle, &base, &size, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    return Py_BuildValue("(y#Kn)", (const char *)handle, (Py_ssize_t)sizeof handle, (unsigned long long)base,
                         (Py_ssize_t)size);
}

PyDoc_STRVAR(open_shared_doc,
"open_shared($module, handle, device=-1, /)\n--\n\n"
"(ptr, size): the allocation another process shared as handle, mapped here for\n"
"device (-1: the current one). Held until close_shared(ptr); opening the same\n"
"handle again returns the same ptr and needs one more close.");
static PyObject *py_open_shared(PyObject *module, PyObject *args)
{
    const char *handle;
    Py_ssize_t len;
    int device = -1;
    if (!PyArg_ParseTuple(args, "y#|i:open_shared", &handle, &len, &device)) return NULL;
    if (len != TMS_SHARE_HANDLE_BYTES || !tms_share_is_handle((const unsigned char *)handle)) {
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: open_shared: not a handle of torch_memory_saver "
                     "(%zd bytes; a handle is %d bytes made by share())", len, TMS_SHARE_HANDLE_BYTES);
        return NULL;
    }
    uint64_t va = 0;
    size_t size = 0;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* waits for the sender's answer */
    rc = tms_share_open((const unsigned char *)handle, device, &va, &size, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    return Py_BuildValue("(Kn)", (unsigned long long)va, (Py_ssize_t)size);
}

PyDoc_STRVAR(close_shared_doc,
"close_shared($module, ptr, /)\n--\n\n"
"Undoes one open_shared of ptr; the last unmaps it and tells the sender.");
static PyObject *py_close_shared(PyObject *module, PyObject *args)
{
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K:close_shared", &ptr)) return NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_share_close(ptr, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(open_shared_count_doc,
"open_shared_count($module, /)\n--\n\nMappings of other processes' memory this process holds open.");
static PyObject *py_open_shared_count(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyLong_FromSize_t(tms_share_open_count());
}

PyDoc_STRVAR(install_ipc_hooks_doc,
"install_ipc_hooks($module, /)\n--\n\n"
"Route the runtime's cudaIpcGetMemHandle / cudaIpcOpenMemHandle / cudaIpcCloseMemHandle\n"
"(PyTorch's CUDA tensor sharing) through this library: on its memory and handles it\n"
"serves them, anything else goes to the runtime. Idempotent. NotImplementedError if\n"
"TMS_RELOC_HOOKS=0 where LD_PRELOAD does not already interpose them.");
static PyObject *py_install_ipc_hooks(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* walks every object's relocations, or waits for the walk begun later */
    rc = tms_variant_install_ipc_hooks(&err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(install_ipc_hooks_later_doc,
"install_ipc_hooks_later($module, /)\n--\n\n"
"Start install_ipc_hooks() on a thread of its own and return at once; install_ipc_hooks()\n"
"waits for it. Errors are logged at debug level: the next install_ipc_hooks() raises them.");
static PyObject *py_install_ipc_hooks_later(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    tms_variant_install_ipc_hooks_later();
    Py_RETURN_NONE;
}

PyMethodDef tms_py_share_methods[] = {
    {"share", py_share, METH_VARARGS, share_doc},
    {"open_shared", py_open_shared, METH_VARARGS, open_shared_doc},
    {"close_shared", py_close_shared, METH_VARARGS, close_shared_doc},
    {"open_shared_count", py_open_shared_count, METH_NOARGS, open_shared_count_doc},
    {"install_ipc_hooks", py_install_ipc_hooks, METH_NOARGS, install_ipc_hooks_doc},
    {"install_ipc_hooks_later", py_install_ipc_hooks_later, METH_NOARGS, install_ipc_hooks_later_doc},
    {NULL, NULL, 0, NULL},
};
