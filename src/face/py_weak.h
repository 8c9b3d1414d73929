/* Every CPython symbol the CPython face (module*.c) uses, declared weak: the preload library is
 * loaded into any child process (shells, compilers, nvidia-smi), where there
 * is no libpython; a weak reference resolves to NULL there instead of failing
 * the load, also under LD_BIND_NOW=1. Inside Python they
 * resolve to the interpreter's. tests/test_build.py fails if one is missing.
 * Superset across CPython 3.10-3.13 (macros expand to different names). */
#ifndef TMS_PY_WEAK_H
#define TMS_PY_WEAK_H

#pragma weak PyArg_ParseTuple
#pragma weak PyArg_ParseTupleAndKeywords
#pragma weak PyArg_UnpackTuple
#pragma weak PyBool_FromLong
#pragma weak PyBool_Type
#pragma weak PyBuffer_FillInfo
#pragma weak PyBytes_AsString
#pragma weak PyBytes_Size
#pragma weak PyBytes_Type
#pragma weak PyCallable_Check
#pragma weak PyDict_New
#pragma weak PyDict_SetItem
#pragma weak PyDict_SetItemString
#pragma weak PyErr_Format
#pragma weak PyObject_SetAttrString
#pragma weak PyErr_Fetch
#pragma weak PyErr_NormalizeException
#pragma weak PyErr_Restore
#pragma weak PyLong_Type
#pragma weak PyErr_Clear
#pragma weak PyErr_ExceptionMatches
#pragma weak PyExc_ImportError
#pragma weak PyImport_ImportModule
#pragma weak PyObject_GetAttrString
#pragma weak PyLong_AsUnsignedLongLong
#pragma weak PyUnicode_AsUTF8AndSize
#pragma weak PyUnicode_FSConverter
#pragma weak PyLong_FromUnsignedLongLong
#pragma weak PyErr_NewExceptionWithDoc
#pragma weak PyErr_Occurred
#pragma weak PyEval_RestoreThread
#pragma weak PyEval_SaveThread
#pragma weak PyExc_MemoryError
#pragma weak PyExc_NotImplementedError
#pragma weak PyExc_OverflowError
#pragma weak PyExc_OSError
#pragma weak PyExc_RuntimeError
#pragma weak PyExc_TypeError
#pragma weak PyExc_ValueError
#pragma weak PyList_New
#pragma weak PyList_SetItem
#pragma weak PyObject_CallFunction
#pragma weak PyObject_CallObject
#pragma weak PyType_GetSlot
#pragma weak _PyObject_CallFunction_SizeT
#pragma weak PyLong_AsSize_t
#pragma weak PyLong_AsSsize_t
#pragma weak PyLong_AsLong
#pragma weak PyLong_AsVoidPtr
#pragma weak PyLong_FromLong
#pragma weak PyLong_FromSize_t
#pragma weak PyLong_FromVoidPtr
#pragma weak PyMemoryView_FromObject
#pragma weak PyModuleDef_Init
#pragma weak PyModule_AddFunctions
#pragma weak PyModule_AddObjectRef
#pragma weak PyModule_AddStringConstant
#pragma weak PyModule_GetState
#pragma weak PyObject_Free
#pragma weak PyObject_Init
#pragma weak PyObject_IsTrue
#pragma weak PyObject_RichCompareBool
#pragma weak PyObject_Str
#pragma weak PyTuple_Pack
#pragma weak PySequence_Tuple
#pragma weak PyTuple_Size
#pragma weak PyTuple_GetItem
#pragma weak PyMem_Calloc
#pragma weak PyMem_Free
#pragma weak PyMem_Malloc
#pragma weak PyErr_NoMemory
#pragma weak PyType_FromModuleAndSpec
#pragma weak PyType_GenericAlloc
#pragma weak PyType_GetFlags
#pragma weak PyUnicode_AsUTF8
#pragma weak PyUnicode_DecodeFSDefault
#pragma weak PyUnicode_FromString
#pragma weak Py_BuildValue
#pragma weak Py_DecRef
#pragma weak Py_IncRef
#pragma weak _PyArg_ParseTupleAndKeywords_SizeT
#pragma weak _PyArg_ParseTuple_SizeT
#pragma weak _PyObject_New
#pragma weak _Py_BuildValue_SizeT
#pragma weak _Py_Dealloc
#pragma weak _Py_DecRef
#pragma weak _Py_FalseStruct
#pragma weak _Py_IncRef
#pragma weak _Py_NoneStruct
#pragma weak _Py_TrueStruct

#endif
