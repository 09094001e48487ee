/* stfs.formats.hdf5._scan: the two loops the HDF5 walk runs for every object of an old-style file, in C: the
 * messages of a version 1 object header's first block (objects.read_object) and a symbol table node's entries
 * named from their group's local heap (walk._symbol_table). Each does what the Python loop beside it does, to the
 * same records; anything out of the ordinary (a continuation, a message past its block, a name that does not end in
 * the heap) is handed back to Python, which says what is wrong. The bytes come from a hostile file: every offset is
 * checked against the length of the bytes object it indexes before it is read. setup.py builds it where it can;
 * without it (or with STFS_NATIVE=0) the Python loops run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <string.h>

enum { NIL = 0x00, CONTINUATION = 0x10, ENTRY_CACHE = 24 };

/* A record of ``type`` (a NamedTuple, checked to be a tuple subclass) holding ``count`` new references, stolen. */
static PyObject *record(PyTypeObject *type, Py_ssize_t count, PyObject **items) {
    PyObject *made = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (items[i] == NULL)
            goto fail;
    }
    made = type->tp_alloc(type, count);
    if (made == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++)
        PyTuple_SET_ITEM(made, i, items[i]);
    return made;
fail:
    for (Py_ssize_t i = 0; i < count; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

static int tuple_type(PyObject *type) {
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "a record type must be a tuple subclass");
        return 0;
    }
    return 1;
}

static unsigned long long little(const unsigned char *p, int size) {
    unsigned long long value = 0;
    for (int i = size - 1; i >= 0; i--)
        value = value << 8 | p[i];
    return value;
}

/* v1_messages(first, length, address, Message) -> ([Message, ...], count) | None: the messages of first[16:length],
 * a version 1 object header at ``address`` whose first block ends at ``length``; count: the messages read, NIL ones
 * too. None where the block continues elsewhere or a message ends past it. */
static PyObject *v1_messages(PyObject *self, PyObject *args) {
    PyObject *first, *address_object, *type;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "SnOO", &first, &length, &address_object, &type) || !tuple_type(type))
        return NULL;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(first);
    unsigned long long address = PyLong_AsUnsignedLongLong(address_object);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (length < 16 || length > PyBytes_GET_SIZE(first) || address > ULLONG_MAX - (unsigned long long)length)
        Py_RETURN_NONE;
    PyObject *messages = PyList_New(0);
    if (messages == NULL)
        return NULL;
    Py_ssize_t pos = 16, count = 0;
    while (pos + 8 <= length) {
        unsigned kind = p[pos] | p[pos + 1] << 8, size = p[pos + 2] | p[pos + 3] << 8, flags = p[pos + 4];
        Py_ssize_t end = pos + 8 + (Py_ssize_t)size;
        if (end > length || kind == CONTINUATION) {
            Py_DECREF(messages);
            Py_RETURN_NONE;
        }
        if (kind != NIL) {
            PyObject *items[4] = {PyLong_FromUnsignedLong(kind), PyLong_FromUnsignedLong(flags),
                                  PyBytes_FromStringAndSize((const char *)p + pos + 8, (Py_ssize_t)size),
                                  PyLong_FromUnsignedLongLong(address + (unsigned long long)pos + 8)};
            PyObject *message = record((PyTypeObject *)type, 4, items);
            if (message == NULL || PyList_Append(messages, message) < 0) {
                Py_XDECREF(message);
                Py_DECREF(messages);
                return NULL;
            }
            Py_DECREF(message);
        }
        count++;
        pos = end;
    }
    return Py_BuildValue("(Nn)", messages, count);
}

/* symbol_entries(entries, offset_size, names, max_name, Link) -> [Link, ...] | int: a symbol table node's entries
 * (each its name's offset in the local heap ``names``, its object header's address, 24 bytes of cache) as links
 * named by the heap's NUL-ended strings of at most ``max_name`` bytes; the offset of the first name that does not
 * end in the heap instead, for Python to refuse. */
static PyObject *symbol_entries(PyObject *self, PyObject *args) {
    PyObject *entries, *names, *type;
    int offset_size;
    Py_ssize_t max_name;
    if (!PyArg_ParseTuple(args, "SiSnO", &entries, &offset_size, &names, &max_name, &type) || !tuple_type(type))
        return NULL;
    if (offset_size != 2 && offset_size != 4 && offset_size != 8) {
        PyErr_SetString(PyExc_ValueError, "offsets are 2, 4 or 8 bytes");
        return NULL;
    }
    Py_ssize_t entry = 2 * offset_size + ENTRY_CACHE, length = PyBytes_GET_SIZE(entries);
    if (length % entry != 0 || max_name < 0) {
        PyErr_SetString(PyExc_ValueError, "symbol table entries of a whole number of entries");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(entries);
    const char *heap = PyBytes_AS_STRING(names);
    unsigned long long heap_size = (unsigned long long)PyBytes_GET_SIZE(names);
    Py_ssize_t count = length / entry;
    PyObject *links = PyList_New(count);
    if (links == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        const unsigned char *at = p + i * entry;
        unsigned long long offset = little(at, offset_size), address = little(at + offset_size, offset_size);
        if (offset >= heap_size) {
            Py_DECREF(links);
            return PyLong_FromUnsignedLongLong(offset);
        }
        unsigned long long room = heap_size - offset;
        size_t span = (size_t)(room < (unsigned long long)max_name ? room : (unsigned long long)max_name);
        const char *name = heap + offset, *nul = memchr(name, 0, span);
        if (nul == NULL) {
            Py_DECREF(links);
            return PyLong_FromUnsignedLongLong(offset);
        }
        PyObject *items[3] = {PyUnicode_DecodeUTF8(name, nul - name, "surrogateescape"),
                              PyLong_FromUnsignedLongLong(address), PyLong_FromLong(0)};
        PyObject *link = record((PyTypeObject *)type, 3, items);
        if (link == NULL) {
            Py_DECREF(links);
            return NULL;
        }
        PyList_SET_ITEM(links, i, link);
    }
    return links;
}

/* The windows a symbol table's structures were found in, each kept alive (``held``) while its bytes are read. */
typedef struct {
    PyObject *lookup; /* Reader.window_for */
    PyObject *held;   /* a list of the windows' bytes */
    unsigned long long base;
} Windows;

/* The bytes at file address ``address`` of the window Reader.window_for(address, least, what) finds (reading it as
 * Reader.upto would: the same reads in the same order), at least ``least`` of them, and in ``*room`` how many the
 * window holds from there. NULL with Python's exception set where it raises (the file ends first, a bound). */
static const unsigned char *window_for(Windows *windows, unsigned long long address, unsigned long long least,
                                       const char *what, unsigned long long *room) {
    PyObject *found = PyObject_CallFunction(windows->lookup, "KKs", address, least, what);
    if (found == NULL)
        return NULL;
    PyObject *first_object, *window;
    if (!PyArg_ParseTuple(found, "OS", &first_object, &window) || PyList_Append(windows->held, window) < 0) {
        Py_DECREF(found);
        return NULL;
    }
    unsigned long long first = PyLong_AsUnsignedLongLong(first_object);
    Py_DECREF(found); /* the window stays alive in ``held`` */
    if (PyErr_Occurred())
        return NULL;
    unsigned long long length = (unsigned long long)PyBytes_GET_SIZE(window), offset;
    if (address > ULLONG_MAX - windows->base || (offset = windows->base + address) < first ||
        offset - first > length || least > length - (offset - first)) {
        PyErr_SetString(PyExc_ValueError, "window_for gave a window that does not hold the bytes asked for");
        return NULL;
    }
    *room = length - (offset - first);
    return (const unsigned char *)PyBytes_AS_STRING(window) + (offset - first);
}

/* symbol_table(window_for, base, message, offset_size, length_size, max_name, Link, budget) -> ([Link, ...], steps)
 * | None: the links of an old-style group whose symbol table message is ``message`` and whose B-tree's root is a
 * leaf, each structure read through ``window_for`` (Reader.window_for: as walk._symbol_table reads them, in the same
 * order, so that a file that ends first fails alike); steps: the walk's steps Python counts for them, at most
 * ``budget`` (a leaf's children may name one node many times: the steps bound the links made). None for anything
 * else (a wrong signature, a root that is no leaf, a name that does not end, more steps than the budget):
 * walk._symbol_table walks it then, from the windows now held, and says what is wrong. */
static PyObject *symbol_table(PyObject *self, PyObject *args) {
    PyObject *lookup, *base_object, *message, *type;
    int o, n;
    Py_ssize_t max_name, budget;
    if (!PyArg_ParseTuple(args, "OOSiinOn", &lookup, &base_object, &message, &o, &n, &max_name, &type, &budget) ||
        !tuple_type(type))
        return NULL;
    if ((o != 2 && o != 4 && o != 8) || (n != 2 && n != 4 && n != 8) || max_name < 0) {
        PyErr_SetString(PyExc_ValueError, "sizes of 2, 4 or 8 bytes");
        return NULL;
    }
    Windows windows = {lookup, NULL, PyLong_AsUnsignedLongLong(base_object)};
    if (PyErr_Occurred())
        return NULL;
    const unsigned char *m = (const unsigned char *)PyBytes_AS_STRING(message);
    if (PyBytes_GET_SIZE(message) < 2 * o)
        Py_RETURN_NONE;
    unsigned long long btree = little(m, o), heap_address = little(m + o, o), room;
    unsigned long long undefined = o == 8 ? ULLONG_MAX : (1ULL << (8 * o)) - 1;
    PyObject *links = NULL;
    windows.held = PyList_New(0);
    if (windows.held == NULL)
        return NULL;
    /* the local heap: its header, then its data segment (the names) */
    const unsigned char *heap = window_for(&windows, heap_address, 8 + 2 * n + o, "a local heap", &room);
    if (heap == NULL)
        goto fail;
    if (memcmp(heap, "HEAP\0", 5) != 0)
        goto python;
    unsigned long long names_size = little(heap + 8, n), names_address = little(heap + 8 + 2 * n, o);
    const unsigned char *names = window_for(&windows, names_address, names_size, "a local heap's data segment", &room);
    if (names == NULL)
        goto fail;
    if (btree == undefined || budget < 1)
        goto python;
    /* the B-tree's root, a leaf whose keys and children are at hand (up to 1024 bytes of it, as Python takes it) */
    unsigned long long body = 8 + 2 * (unsigned long long)o;
    const unsigned char *node = window_for(&windows, btree, body, "a version 1 B-tree node", &room);
    if (node == NULL)
        goto fail;
    unsigned long long used = node[6] | node[7] << 8, at_hand = room < 1024 ? room : 1024;
    if (memcmp(node, "TREE\0\0", 6) != 0 || body + used * (unsigned long long)(n + o) + n > at_hand)
        goto python;
    unsigned long long entry = 2 * (unsigned long long)o + ENTRY_CACHE, steps = 1;
    links = PyList_New(0);
    if (links == NULL)
        goto fail;
    for (unsigned long long k = 0; k < used; k++) {
        unsigned long long child = little(node + body + k * (n + o) + n, o);
        const unsigned char *snod = window_for(&windows, child, 8, "a symbol table node", &room);
        if (snod == NULL)
            goto fail;
        if (memcmp(snod, "SNOD\1", 5) != 0)
            goto python;
        unsigned long long count = snod[6] | snod[7] << 8;
        const unsigned char *entries = snod + 8;
        if (8 + count * entry > (room < 1024 ? room : 1024)) { /* past what Python takes at once: read apart */
            entries = window_for(&windows, child + 8, count * entry, "a symbol table node", &room);
            if (entries == NULL)
                goto fail;
        }
        steps += count;
        if (steps > (unsigned long long)budget)
            goto python;
        for (unsigned long long i = 0; i < count; i++) {
            const unsigned char *at = entries + i * entry;
            unsigned long long offset = little(at, o), address = little(at + o, o);
            if (offset >= names_size)
                goto python;
            unsigned long long left = names_size - offset;
            size_t span = (size_t)(left < (unsigned long long)max_name ? left : (unsigned long long)max_name);
            const char *name = (const char *)names + offset, *nul = memchr(name, 0, span);
            if (nul == NULL)
                goto python;
            PyObject *items[3] = {PyUnicode_DecodeUTF8(name, nul - name, "surrogateescape"),
                                  PyLong_FromUnsignedLongLong(address), PyLong_FromLong(0)};
            PyObject *link = record((PyTypeObject *)type, 3, items);
            if (link == NULL || PyList_Append(links, link) < 0) {
                Py_XDECREF(link);
                goto fail;
            }
            Py_DECREF(link);
        }
    }
    Py_DECREF(windows.held);
    return Py_BuildValue("(NK)", links, steps);
python:
    Py_XDECREF(links);
    Py_DECREF(windows.held);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(links);
    Py_DECREF(windows.held);
    return NULL;
}

static PyMethodDef methods[] = {
    {"symbol_table", symbol_table, METH_VARARGS, "An old-style group's links read through Reader.window_for, or None."},
    {"v1_messages", v1_messages, METH_VARARGS, "The messages of a version 1 object header's first block, or None."},
    {"symbol_entries", symbol_entries, METH_VARARGS, "A symbol table node's entries as links, or a bad name's offset."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "stfs.formats.hdf5._scan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
