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

/* The ``size`` bytes at file address ``address`` (``base`` + ``address`` from the start of the HDF5 file) if they
 * lie in ``window`` (read from byte ``first``), else NULL. */
static const unsigned char *within(const unsigned char *window, unsigned long long first, unsigned long long length,
                                   unsigned long long base, unsigned long long address, unsigned long long size) {
    if (address > ULLONG_MAX - base)
        return NULL;
    unsigned long long offset = base + address;
    if (offset < first || offset - first > length || size > length - (offset - first))
        return NULL;
    return window + (offset - first);
}

/* symbol_table(window, first, base, message, offset_size, length_size, max_name, Link, budget) -> ([Link, ...], steps)
 * | None: the links of an old-style group whose symbol table message is ``message``, where its local heap, its
 * B-tree's root (a leaf) and that leaf's symbol table nodes all lie in ``window`` (the bytes read from ``first``);
 * steps: the walk's steps Python counts for them, at most ``budget`` (the leaf's children may name one node many
 * times: the steps bound the links made). None for anything else (a structure elsewhere, a wrong signature, a name
 * that does not end, more steps than the budget): walk._symbol_table reads it then, and says what is wrong. */
static PyObject *symbol_table(PyObject *self, PyObject *args) {
    PyObject *window_object, *first_object, *base_object, *message, *type;
    int o, n;
    Py_ssize_t max_name, budget;
    if (!PyArg_ParseTuple(args, "SOOSiinOn", &window_object, &first_object, &base_object, &message, &o, &n, &max_name,
                          &type, &budget) ||
        !tuple_type(type))
        return NULL;
    if ((o != 2 && o != 4 && o != 8) || (n != 2 && n != 4 && n != 8) || max_name < 0) {
        PyErr_SetString(PyExc_ValueError, "sizes of 2, 4 or 8 bytes");
        return NULL;
    }
    unsigned long long first = PyLong_AsUnsignedLongLong(first_object), base = PyLong_AsUnsignedLongLong(base_object);
    if (PyErr_Occurred())
        return NULL;
    const unsigned char *window = (const unsigned char *)PyBytes_AS_STRING(window_object);
    unsigned long long length = (unsigned long long)PyBytes_GET_SIZE(window_object);
    const unsigned char *m = (const unsigned char *)PyBytes_AS_STRING(message);
    if (PyBytes_GET_SIZE(message) < 2 * o)
        Py_RETURN_NONE;
    unsigned long long btree = little(m, o), heap_address = little(m + o, o);
    unsigned long long undefined = o == 8 ? ULLONG_MAX : (1ULL << (8 * o)) - 1;
    /* the local heap: its header, then its data segment (the names) */
    const unsigned char *heap = within(window, first, length, base, heap_address, 8 + 2 * n + o);
    if (heap == NULL || memcmp(heap, "HEAP\0", 5) != 0)
        Py_RETURN_NONE;
    unsigned long long names_size = little(heap + 8, n), names_address = little(heap + 8 + 2 * n, o);
    const unsigned char *names = within(window, first, length, base, names_address, names_size);
    if (names == NULL || btree == undefined)
        Py_RETURN_NONE;
    /* the B-tree's root, a leaf whose keys and children lie in the window: as walk._symbol_table takes it, up to 1024
     * bytes of it at hand */
    unsigned long long body = 8 + 2 * (unsigned long long)o;
    const unsigned char *node = within(window, first, length, base, btree, body);
    if (node == NULL || memcmp(node, "TREE\0\0", 6) != 0)
        Py_RETURN_NONE;
    unsigned long long used = node[6] | node[7] << 8, at_hand = length - (base + btree - first);
    if (at_hand > 1024)
        at_hand = 1024;
    if (body + used * (unsigned long long)(n + o) + n > at_hand)
        Py_RETURN_NONE;
    unsigned long long entry = 2 * (unsigned long long)o + ENTRY_CACHE, steps = 1;
    PyObject *links = PyList_New(0);
    if (links == NULL)
        return NULL;
    for (unsigned long long k = 0; k < used; k++) {
        unsigned long long child = little(node + body + k * (n + o) + n, o);
        const unsigned char *snod = within(window, first, length, base, child, 8);
        if (snod == NULL || memcmp(snod, "SNOD\1", 5) != 0)
            goto python;
        unsigned long long count = snod[6] | snod[7] << 8;
        const unsigned char *entries = within(window, first, length, base, child, 8 + count * entry);
        if (entries == NULL)
            goto python;
        steps += count;
        if (budget < 0 || steps > (unsigned long long)budget)
            goto python;
        for (unsigned long long i = 0; i < count; i++) {
            const unsigned char *at = entries + 8 + i * entry;
            unsigned long long offset = little(at, o), address = little(at + o, o);
            if (offset >= names_size)
                goto python;
            unsigned long long room = names_size - offset;
            size_t span = (size_t)(room < (unsigned long long)max_name ? room : (unsigned long long)max_name);
            const char *name = (const char *)names + offset, *nul = memchr(name, 0, span);
            if (nul == NULL)
                goto python;
            PyObject *items[3] = {PyUnicode_DecodeUTF8(name, nul - name, "surrogateescape"),
                                  PyLong_FromUnsignedLongLong(address), PyLong_FromLong(0)};
            PyObject *link = record((PyTypeObject *)type, 3, items);
            if (link == NULL || PyList_Append(links, link) < 0) {
                Py_XDECREF(link);
                Py_DECREF(links);
                return NULL;
            }
            Py_DECREF(link);
        }
    }
    return Py_BuildValue("(NK)", links, steps);
python:
    Py_DECREF(links);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"symbol_table", symbol_table, METH_VARARGS, "An old-style group's links where its table lies in a window, or None."},
    {"v1_messages", v1_messages, METH_VARARGS, "The messages of a version 1 object header's first block, or None."},
    {"symbol_entries", symbol_entries, METH_VARARGS, "A symbol table node's entries as links, or a bad name's offset."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "stfs.formats.hdf5._scan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
